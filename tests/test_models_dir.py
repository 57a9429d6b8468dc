"""The default model lives under `--models-dir`, else `<--cache-dir>/models`, for every command.

The converted model is linked into a temporary models directory rather than converted again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from semantic.actors.engine_client import Engine, EngineConfig
from semantic.engine.model.default_model import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parent.parent


def link_default_model(default_model_dir: Path, models_dir: Path, temperature: float = 0.2) -> Path:
    """The converted model's files, linked under `models_dir`, with a generation config of our own
    so that loading it shows where it came from."""
    linked = models_dir / f"{DEFAULT_MODEL_NAME}-float32"
    linked.mkdir(parents=True)
    for source in default_model_dir.iterdir():
        if source.name != "generation_config.json":
            (linked / source.name).symlink_to(source)
    (linked / "generation_config.json").write_text(json.dumps({"temperature": temperature}))
    return linked


def fetch_model(*args: str, env: dict[str, str] | None = None) -> str:
    command = [sys.executable, "scripts/fetch_default_model.py", *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SEMANTIC_MODEL_")}
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**environ, **(env or {})}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_fetch_model_finds_the_model_under_the_cache_dir_or_the_models_dir(
    default_model_dir: Path, tmp_path: Path
) -> None:
    under_cache = link_default_model(default_model_dir, tmp_path / "cache" / "models")
    elsewhere = link_default_model(default_model_dir, tmp_path / "elsewhere")
    assert fetch_model("--cache-dir", str(tmp_path / "cache")) == str(under_cache)
    models_dir = ("--models-dir", str(tmp_path / "elsewhere"))
    assert fetch_model("--cache-dir", str(tmp_path / "cache"), *models_dir) == str(elsewhere)
    assert fetch_model(env={"SEMANTIC_MODEL_DIR": str(tmp_path / "elsewhere")}) == str(elsewhere)


async def test_the_engine_loads_the_default_model_from_its_models_dir(
    default_model_dir: Path, tmp_path: Path
) -> None:
    link_default_model(default_model_dir, tmp_path / "models", temperature=0.5)
    engine = Engine(EngineConfig(model="default", models_dir=tmp_path / "models", cache_budget_mb=64))
    await engine.start()
    try:
        assert engine.loaded is not None and engine.loaded.generation_defaults.temperature == 0.5
    finally:
        await engine.stop()
