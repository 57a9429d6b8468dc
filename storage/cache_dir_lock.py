"""One writer per cache dir: an exclusive `flock` on `semantic.lock` inside it, held by a server for
its whole life or by an `agents`/`cache` command for its run.

The file states who holds it (pid, role, port) so that a command refused by a server can talk to
that server instead. The kernel drops the lock when its holder exits, however it exits, so a crash
never leaves the cache dir locked; the words left in the file are then only history.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
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


class LockFileError(RuntimeError):
    """The lock file's place holds a link, a folder or another special file: locking, writing or
    emptying it would act on something the cache dir does not own."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(
            f"the lock file {path} is {what}, not a file of its own; semantic never follows links out of "
            "the cache dir: remove it and try again"
        )


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
        fd = _open_own_file(self.path, os.O_RDWR | os.O_CREAT)
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
            return _decode_holder(_read_own_file(path))
        except LockFileError:
            return None  # it is not read through a link
        except (OSError, msgspec.DecodeError):
            if time.monotonic() >= deadline:
                return None
        time.sleep(0.02)


def _open_own_file(path: Path, flags: int) -> int:
    """Open `path` itself, never what a link in its place points at (a dangling one is not created
    either), and only a regular file with no other name; LockFileError otherwise."""
    try:  # O_NONBLOCK: a FIFO in its place must not hang the open
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        raise LockFileError(path, _what_is(os.lstat(path))) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise LockFileError(path, _what_is(info))
    return fd


def _read_own_file(path: Path) -> bytes:
    fd = _open_own_file(path, os.O_RDONLY)
    try:
        return os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


def _what_is(info: os.stat_result) -> str:
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(info.st_mode):
        return "a folder"
    if stat.S_ISREG(info.st_mode):
        return "a hard link (a file with other names)"
    return "a special file"
