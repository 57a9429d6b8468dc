from __future__ import annotations

import contextlib
import importlib.util
import os
import py_compile
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess
from tests.tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from typecheck import package_sources


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile semantic's modules once, here: the servers the tests start (~55) import them, and where
    PYTHONDONTWRITEBYTECODE is set (as on the VMs this project is tested on) each would compile them
    again (~0.25 s a start)."""
    root = Path(__file__).resolve().parents[1]
    for source in package_sources():
        path = str(root / str(source.path))
        with contextlib.suppress(OSError):  # where it cannot write, nothing changes
            py_compile.compile(path, cfile=importlib.util.cache_from_source(path), quiet=2)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return ensure_default_model("float32")


@pytest.fixture(scope="session")
def tiny_model_dirs(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny_model(kind, base / kind, default_model_dir) for kind in ("gemma3", "qwen2")}


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[type[ServerProcess]]:
    started: list[ServerProcess] = []

    class Factory(ServerProcess):
        def __init__(self, *args: str, cache_dir: Path | None = None) -> None:
            super().__init__(cache_dir or tmp_path / "cache", *args)
            started.append(self)

    yield Factory
    for server in started:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def shared_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One default-model server for the tests that need nothing else and leave it as they would find
    it (each start costs seconds: imports, the model, the load probes)."""
    process = ServerProcess(
        tmp_path_factory.mktemp("shared"), "--model", str(default_model_dir), "--cache-budget-mb", "512"
    ).start()
    yield process
    process.stop()


os.environ.setdefault("SEMANTIC_TEST", "1")
