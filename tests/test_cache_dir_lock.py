"""One writer per cache dir: the lock refuses a second holder (naming the first), a server refuses
to start where a command holds it, and a holder that dies leaves the cache dir free."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from semantic.storage.cache_dir_lock import CacheDirBusyError, CacheDirLock, LockHolder
from tests.server_process import ServerProcess


def test_a_second_holder_is_refused_and_told_who_holds_it(tmp_path: Path) -> None:
    server = LockHolder(os.getpid(), "server", "127.0.0.1", 8123)
    with CacheDirLock(tmp_path, server):
        with pytest.raises(CacheDirBusyError, match=r"pid .* on 127\.0\.0\.1:8123") as refused:
            CacheDirLock(tmp_path, LockHolder(os.getpid(), "command")).acquire()
        assert refused.value.holder == server
    with CacheDirLock(tmp_path, LockHolder(os.getpid(), "command")):  # released: free again
        pass


def test_a_holder_that_is_killed_leaves_the_cache_dir_free(tmp_path: Path) -> None:
    hold = (
        "import os, sys, time; from pathlib import Path\n"
        "from semantic.storage.cache_dir_lock import CacheDirLock, LockHolder\n"
        "CacheDirLock(Path(sys.argv[1]), LockHolder(os.getpid(), 'command')).acquire()\n"
        "print('held', flush=True); time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(CacheDirBusyError, match=f"semantic command \\(pid {holder.pid}\\)"):
            CacheDirLock(tmp_path, LockHolder(os.getpid(), "command")).acquire()
    finally:
        holder.kill()
        holder.wait()
    with CacheDirLock(tmp_path, LockHolder(os.getpid(), "command")):
        pass


def test_a_server_refuses_a_cache_dir_a_command_holds(default_model_dir: Path, tmp_path: Path) -> None:
    with CacheDirLock(tmp_path, LockHolder(os.getpid(), "command")):
        server = ServerProcess(tmp_path, "--model", str(default_model_dir))
        with pytest.raises(RuntimeError, match=r"refusing to serve: the cache dir .* semantic command"):
            server.start()
        assert server.proc is not None and server.proc.returncode == 1
