"""The two servers the benchmarks compare: semantic and mlx-lm's own `mlx_lm.server`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

from tests.server_process import ROOT, ServerProcess, free_port


class Server(Protocol):
    name: str
    model: str  # what requests name as their model
    base_url: str

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def request_timings(self) -> dict[str, dict[str, float]]: ...


class Semantic:
    name = "semantic"
    model = "default"

    def __init__(self, model_dir: Path, cache_dir: Path, *extra_args: str) -> None:
        self.process = ServerProcess(
            cache_dir, "--model", str(model_dir), "--temperature", "0", "--log-format", "json", *extra_args
        )
        self.base_url = self.process.base_url

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.process.stop()

    def request_timings(self) -> dict[str, dict[str, float]]:
        """Each finished request's own timings from the server's JSON log, by request id: time to
        first token, the handler's time before the engine got it, the engine's wait to admit it."""
        timings: dict[str, dict[str, float]] = {}
        for line in self.process.log().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("request_id") and "ttft_s" in entry:
                names = ("ttft_s", "handled_s", "engine_wait_s")
                timings[entry["request_id"]] = {k: entry[k] for k in names if entry.get(k) is not None}
        return timings


class MlxLmServer:
    """`mlx_lm.server` (mlx-lm's own server, continuous batching and an in-memory prompt cache)."""

    name = "mlx_lm.server"

    def __init__(self, model_dir: Path, log_dir: Path, max_tokens: int, *extra_args: str) -> None:
        self.model_dir = model_dir
        self.max_tokens = max_tokens
        self.extra_args = list(extra_args)
        self.model = str(model_dir)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"mlx_lm_server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model_dir)]
        cmd += ["--port", str(self.port), "--max-tokens", str(self.max_tokens), *self.extra_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        raise TimeoutError("mlx_lm.server did not start")

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(60)

    def request_timings(self) -> dict[str, dict[str, float]]:
        return {}  # mlx_lm.server logs no per-request timings
