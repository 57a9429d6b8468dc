"""Shared bench helpers: a server process, chat prompts, and writing results."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
    }


def write_results(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **results}, indent=2))
    print(json.dumps(results, indent=2))
    return path


class Server:
    def __init__(self, port: int, cache_dir: Path, *args: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "semantic.cli",
            "serve",
            "--port",
            str(port),
            "--cache-dir",
            str(cache_dir),
            *args,
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health/ready", timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
