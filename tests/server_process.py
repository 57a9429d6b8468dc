"""`semantic serve` in a subprocess on a free loopback port: for tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

# A refused connection costs nothing: poll often, so a test does not wait on a ready server.
READY_POLL_S = 0.05
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process(Protocol):
    """What the tests use of a server's process: `subprocess.Popen`'s names."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Zygote:
    """A process that forks servers with their modules already imported (tests/server_zygote.py)."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.server_zygote", str(socket_path)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server zygote did not start ({self.proc.returncode})")
            time.sleep(READY_POLL_S)

    def ask(self, request: dict[str, object]) -> dict[str, object]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(self.socket_path))
            with client.makefile("rwb") as stream:
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                reply: dict[str, object] = json.loads(stream.readline())
                return reply

    def spawn(
        self, module: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> ForkedProcess:
        """`python -m module argv...` in the repository, its output appended to `log_path`, in `env`
        (by default, this process's environment)."""
        request = {"op": "spawn", "module": module, "argv": argv, "cwd": str(ROOT), "log": str(log_path)}
        pid = self.ask({**request, "env": dict(os.environ) if env is None else env})["pid"]
        assert isinstance(pid, int)
        return ForkedProcess(self, pid)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class ForkedProcess:
    """A server the zygote forked: signals go to it directly, its exit status comes from the zygote."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def poll(self) -> int | None:
        if self._returncode is None:
            code = self.zygote.ask({"op": "status", "pid": self.pid})["returncode"]
            assert code is None or isinstance(code, int)
            self._returncode = code
        return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0)
            time.sleep(READY_POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_module(module: str, argv: list[str], log_path: Path, timeout_s: float) -> int | None:
    """`python -m module argv...` to its end (forked from the zygote where the session has one),
    its output in `log_path`; its exit status, or None where it ran past `timeout_s` (then killed)."""
    log_path.write_bytes(b"")
    if ServerProcess.zygote is None:
        with log_path.open("ab") as log:
            command = [sys.executable, "-m", module, *argv]
            try:
                return subprocess.run(
                    command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                return None
    process = ServerProcess.zygote.spawn(module, argv, log_path)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


class ServerProcess:
    """`semantic serve` in its own process on a loopback port. Where `zygote` is set (the test
    session does, on Linux), the process is forked from it rather than started from nothing."""

    zygote: Zygote | None = None

    def __init__(self, cache_dir: Path, *args: str, port: int | None = None) -> None:
        self.cache_dir = cache_dir
        self.args = args
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: Process | None = None
        self.log_path = cache_dir / f"server-{self.port}.log"

    def start(self, timeout: float = 300) -> ServerProcess:
        argv = ["serve", "--port", str(self.port), "--cache-dir", str(self.cache_dir), *self.args]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        if self.zygote is not None:
            self.proc = self.zygote.spawn("semantic.cli", argv, self.log_path)
        else:
            with open(self.log_path, "ab") as log:
                cmd = [sys.executable, "-m", "semantic.cli", *argv]
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
