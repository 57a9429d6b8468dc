"""`semantic serve` in a subprocess on a free loopback port: for tests and benchmarks."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# A refused connection costs nothing: poll often, so a test does not wait on a ready server.
READY_POLL_S = 0.05
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`semantic serve` in its own process on a loopback port."""

    def __init__(self, cache_dir: Path, *args: str, port: int | None = None) -> None:
        self.cache_dir = cache_dir
        self.args = args
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = cache_dir / f"server-{self.port}.log"

    def start(self, timeout: float = 300) -> ServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "semantic.cli",
            "serve",
            "--port",
            str(self.port),
            "--cache-dir",
            str(self.cache_dir),
            *self.args,
        ]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(READY_POLL_S)
        raise TimeoutError(f"server did not become ready: {self.log_path.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text()
