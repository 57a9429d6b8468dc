"""A group of `semantic serve` processes on loopback, joined by MLX's ring backend: for tests and benches.

Each rank gets the environment `mlx.launch` would give it (`MLX_HOSTFILE`, `MLX_RANK`), so the
group forms exactly as under the launcher, but each process is ours to signal or kill. Where the test
session has a zygote (tests/server_zygote.py), the ranks are forked from it like its servers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.server_process import READY_POLL_S, ROOT, Process, ServerProcess, free_port


class GroupProcesses:
    def __init__(self, cache_dir: Path, size: int, *args: str, port: int | None = None) -> None:
        self.cache_dir = cache_dir
        self.size = size
        self.args = args
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Process] = []

    def log_path(self, rank: int) -> Path:
        return self.cache_dir / f"rank-{rank}-{self.port}.log"

    def log(self, rank: int = 0) -> str:
        return self.log_path(rank).read_text()

    def start(self, timeout: float = 600) -> GroupProcesses:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        hostfile = self.cache_dir / f"hosts-{self.port}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(self.size)]))
        argv = ["serve", "--port", str(self.port), "--cache-dir", str(self.cache_dir), *self.args]
        for rank in range(self.size):
            env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
            if ServerProcess.zygote is not None:
                self.procs.append(ServerProcess.zygote.spawn("semantic.cli", argv, self.log_path(rank), env))
                continue
            with open(self.log_path(rank), "ab") as log:
                command = [sys.executable, "-m", "semantic.cli", *argv]
                self.procs.append(
                    subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"rank {rank} exited with {proc.returncode}: {self.log(rank)[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(READY_POLL_S)
        self.kill()
        raise TimeoutError(f"the group did not become ready: {self.log(0)[-3000:]}")

    def stop(self, timeout: float = 120) -> list[int]:
        """What mlx.launch does on Ctrl-C: SIGTERM to every rank; returns their exit statuses."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        return [proc.wait(max(0.1, deadline - time.monotonic())) for proc in self.procs]

    def wait_rank(self, rank: int, timeout: float = 120) -> int:
        return self.procs[rank].wait(timeout)

    def signal(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
