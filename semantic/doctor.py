"""`semantic doctor`: checks this machine against the settings `serve` would run with, one line each
(OK, WARN or FAIL) with what to do where something is wrong; exit 1 when any check fails."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from semantic.cli_settings import add_settings_args, load_settings_from

if TYPE_CHECKING:
    from semantic.protocols.settings import Settings

Level = Literal["OK", "WARN", "FAIL"]
MIB = 1 << 20
MIN_FREE_DISK_MB = 1024  # below this an agent's cache file or a model conversion may not fit


class Check(msgspec.Struct, frozen=True):
    level: Level
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.level:<4} {self.name}: {self.detail}" + (f"\n     -> {self.fix}" if self.fix else "")


def check_backend() -> Check:
    try:
        import mlx.core as mx
    except ImportError as error:
        return Check("FAIL", "backend", f"mlx does not import: {error}", "pip install the package again")
    gpu = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else None
    device = mx.default_device()
    detail = f"mlx {getattr(mx, '__version__', '?')}, default device {device}, GPU backend: {gpu or 'none'}"
    if gpu is not None and device != mx.gpu:
        return Check("WARN", "backend", detail, "the GPU is there but not the default device")
    return Check("OK", "backend", detail)


def _loaded_libraries() -> list[str]:
    try:
        return [
            line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if ".so" in line
        ]
    except OSError:
        return []


def check_blas() -> Check:
    if sys.platform == "darwin":
        return Check("OK", "BLAS", "Accelerate (macOS)")
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return Check("OK", "BLAS", "not needed: MLX runs on the GPU (the launcher preloads nothing)")
    blas = sorted({Path(lib).name for lib in _loaded_libraries() if "blas" in Path(lib).name.lower()})
    if any("openblas" in name for name in blas):
        return Check("OK", "BLAS", f"OpenBLAS preloaded ({', '.join(blas)})")
    return Check(
        "WARN",
        "BLAS",
        f"no OpenBLAS in this process ({', '.join(blas) or 'reference BLAS'}): CPU prefill ~25x slower",
        "pip install ngsolve-openblas (x86_64), leave SEMANTIC_NO_FAST_BLAS unset, and start "
        "other commands through `python -m semantic.launch`",
    )


def _memory_mb() -> tuple[int, int | None]:
    """Total memory and, where the system says, what is available, in MiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return total, int(line.split()[1]) // 1024
    return total, None


def _model_dir(settings: Settings) -> Path | None:
    from semantic.cli import _models_dir
    from semantic.engine.model.default_model import default_model_dir
    from semantic.engine.model.loading import is_default_model

    if is_default_model(settings.model.name):
        return default_model_dir(settings.model.dtype, _models_dir(settings))
    path = Path(settings.model.name).expanduser()
    return path if path.is_dir() else None


def _weights_mb(model_dir: Path | None) -> int | None:
    if model_dir is None or not model_dir.is_dir():
        return None
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors")) // MIB


def check_memory(settings: Settings) -> Check:
    total, available = _memory_mb()
    weights = _weights_mb(_model_dir(settings))
    budget = settings.cache.budget_mb
    needed = budget + (weights or 0)
    detail = (
        f"{total} MiB total, {available if available is not None else '?'} MiB available; "
        f"KV budget {budget} MiB + weights {weights if weights is not None else '?'} MiB"
    )
    fix = "lower --cache-budget-mb (cache.budget_mb) or serve a smaller model"
    if needed > total:
        return Check("FAIL", "memory", detail, fix)
    if available is not None and needed > available:
        return Check("WARN", "memory", detail + ": more than is available now", fix)
    return Check("OK", "memory", detail)


def _writable(directory: Path) -> str | None:
    """None where a file can be made in `directory` (made if missing), else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".doctor-"):
            pass
    except OSError as error:
        return str(error)
    return None


def check_cache_dir(cache_dir: Path, settings: Settings) -> Check:
    problem = _writable(cache_dir)
    if problem is not None:
        return Check(
            "FAIL",
            "cache dir",
            f"{cache_dir} is not writable: {problem}",
            "fix its permissions or pass --cache-dir (cache.dir) a directory you can write",
        )
    free = shutil.disk_usage(cache_dir).free // MIB
    budget = settings.cache.disk_budget_mb
    detail = f"{cache_dir}: {free} MiB free, disk budget {budget or 'unlimited'} MiB"
    if free < MIN_FREE_DISK_MB:
        return Check("FAIL", "cache dir", detail, "free disk space or move --cache-dir")
    if budget == 0 or free < budget:
        fix = "lower --disk-budget-mb (cache.disk_budget_mb) below the free space"
        return Check("WARN", "cache dir", detail + ": the budget may not fit", fix)
    return Check("OK", "cache dir", detail)


def check_port(settings: Settings) -> Check:
    from semantic.service import probe_ready

    host, port = settings.server.host, settings.server.port
    where = f"{host}:{port}"
    answer = probe_ready(host, port)
    if answer == "ready":
        return Check("OK", "port", f"{where}: a semantic server runs there and is ready")
    if answer is not None and answer.startswith("HTTP 503"):
        return Check("WARN", "port", f"{where}: a semantic server runs there, not ready ({answer})")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            taken = f"{where} is taken by something other than a ready semantic server ({answer or error})"
            return Check("FAIL", "port", taken, "pick another --port (server.port) or stop that program")
    return Check("OK", "port", f"{where} is free (no server running)")


def check_model(settings: Settings, load: bool) -> Check:
    from semantic.engine.model.default_model import is_converted
    from semantic.engine.model.loading import is_default_model

    name = settings.model.name
    model_dir = _model_dir(settings)
    if model_dir is None:
        return Check("WARN", "model", f"{name!r} is no local directory: a hub id, not checked offline")
    if is_default_model(name) and not is_converted(model_dir):
        return Check(
            "WARN", "model", f"the default model is not converted yet in {model_dir}", "semantic fetch-model"
        )
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as error:
        return Check(
            "FAIL", "model", f"{model_dir}/config.json: {error}", "point --model at an MLX model dir"
        )
    detail = f"{model_dir} ({config.get('model_type', '?')}, {_weights_mb(model_dir)} MiB of weights)"
    if not load:
        return Check("OK", "model", detail + "; --load loads it")
    try:
        import mlx_lm

        started = time.monotonic()
        mlx_lm.load(str(model_dir))
    except Exception as error:  # any failure to load is the finding
        return Check(
            "FAIL", "model", f"{detail}: loading failed: {error}", "see the error; re-fetch the model"
        )
    return Check("OK", "model", f"{detail}: loaded in {time.monotonic() - started:.1f} s")


def checks(settings: Settings, load: bool) -> Iterator[Check]:
    from semantic.service import _cache_dir

    steps: list[Callable[[], Check]] = [
        check_backend,
        check_blas,
        lambda: check_memory(settings),
        lambda: check_cache_dir(_cache_dir(settings), settings),
        lambda: check_port(settings),
        lambda: check_model(settings, load),
    ]
    for step in steps:
        yield step()


def doctor(args: argparse.Namespace) -> None:
    settings = load_settings_from(args).settings
    failed = False
    for check in checks(settings, args.load):
        print(check.line(), flush=True)
        failed |= check.level == "FAIL"
    raise SystemExit(1 if failed else 0)


def add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("doctor", help="check this machine and the settings `serve` would use")
    add_settings_args(parser, server=True)
    parser.add_argument("--load", action="store_true", help="really load the model (slower)")
    parser.set_defaults(run=doctor)
