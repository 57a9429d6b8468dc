from __future__ import annotations

import contextlib
import importlib.util
import os
import py_compile
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from semantic.engine.loop.backend_profile import FAST_BLAS_MARKER
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess, Zygote
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


@pytest.fixture(scope="session", autouse=True)
def server_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers forked from one process that imported them (tests/server_zygote.py), on Linux where
    the session runs under the launcher (`just test`: the servers' environment is then the
    session's); elsewhere, or with FORK_TEST_SERVERS=0, each starts from nothing."""
    if (
        not sys.platform.startswith("linux")
        or not os.environ.get(FAST_BLAS_MARKER)
        or os.environ.get("FORK_TEST_SERVERS", "1") == "0"
    ):
        yield
        return
    zygote = Zygote(tmp_path_factory.mktemp("zygote") / "zygote.sock")
    ServerProcess.zygote = zygote
    yield
    ServerProcess.zygote = None
    zygote.close()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return ensure_default_model("float32")


@pytest.fixture(scope="session")
def tiny_model_dirs(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_tiny_model(kind, base / kind, default_model_dir) for kind in ("gemma3", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random-weight Llama with the default model's tokenizer: for tests of what the server
    does around the model (HTTP, limits, tenancy, shutdown), where a step should cost milliseconds
    and the words do not matter. Its greedy replies are still mlx-lm's, token for token."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama") / "llama", default_model_dir)


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
