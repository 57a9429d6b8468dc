"""One writer per cache dir: an exclusive `flock` on `semantic.lock` inside it, held by a server for
its whole life or by an `agents`/`cache` command for its run.

The file states who holds it (pid, role, port) so that a command refused by a server can talk to
that server instead. The kernel drops the lock when its holder exits, however it exits, so a crash
never leaves the cache dir locked; the words left in the file are then only history.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import msgspec

LOCK_NAME = "semantic.lock"
HOLDER_WRITE_WAIT_S = 2.0  # a holder writes its record just after it locks: how long to wait for it


class LockHolder(msgspec.Struct, frozen=True):
    pid: int
    role: str  # "server" or "command"
    host: str = ""
    port: int = 0

    def describe(self) -> str:
        where = f" on {self.host}:{self.port}" if self.role == "server" else ""
        return f"a semantic {self.role} (pid {self.pid}){where}"


class CacheDirBusyError(RuntimeError):
    """Another process holds the cache dir's lock; `holder` is None while it has not said who."""

    def __init__(self, cache_dir: Path, holder: LockHolder | None) -> None:
        who = holder.describe() if holder is not None else "another process (starting up)"
        super().__init__(f"the cache dir {cache_dir} is in use by {who}")
        self.holder = holder


_decode_holder = msgspec.json.Decoder(LockHolder).decode


class CacheDirLock:
    """`with CacheDirLock(cache_dir, holder):` holds the lock or raises CacheDirBusyError at once."""

    def __init__(self, cache_dir: Path, holder: LockHolder) -> None:
        self.cache_dir = cache_dir
        self.path = cache_dir / LOCK_NAME
        self.holder = holder
        self._fd: int | None = None

    def acquire(self) -> None:
        assert self._fd is None, "CacheDirLock acquired twice: caller bug"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CacheDirBusyError(self.cache_dir, read_holder(self.path)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, msgspec.json.encode(self.holder), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a reader that finds the file unlocked finds it empty too
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> CacheDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def read_holder(path: Path, wait_s: float = HOLDER_WRITE_WAIT_S) -> LockHolder | None:
    """Who a held lock file says holds it; None when it says nothing within `wait_s` (its holder
    locked it but has not written yet, or an older release holds it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _decode_holder(path.read_bytes())
        except (OSError, msgspec.DecodeError):
            if time.monotonic() >= deadline:
                return None
        time.sleep(0.02)
