"""One writer per cache dir: the lock refuses a second holder (naming the first), a server refuses
to start where a command holds it, a holder that dies leaves the cache dir free, and a lock file
that is a link or a folder is refused, its target left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from semantic.storage.cache_dir_lock import (
    LOCK_NAME,
    CacheDirBusyError,
    CacheDirLock,
    LockHolder,
    read_holder,
)
from tests.server_process import ServerProcess
from tests.test_agents_cli import semantic


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


def test_a_server_refuses_a_cache_dir_a_command_holds(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with CacheDirLock(tmp_path, LockHolder(os.getpid(), "command")):
        server = ServerProcess(tmp_path, "--model", str(tiny_llama_dir))
        with pytest.raises(RuntimeError, match=r"refusing to serve: the cache dir .* semantic command"):
            server.start()
        assert server.proc is not None and server.proc.returncode == 1


@pytest.mark.parametrize(
    "command", [["agents", "ls"], ["agents", "verify"], ["cache", "gc"], ["cache", "du"]]
)
def test_a_command_refuses_a_lock_file_that_is_a_link_and_leaves_its_target_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    cache_dir, victim = tmp_path / "cache", tmp_path / "victim.txt"
    cache_dir.mkdir()
    victim.write_bytes(b"precious")
    (cache_dir / LOCK_NAME).symlink_to(victim)
    code, _, err = semantic(capsys, cache_dir, *command)
    assert code == 1 and f"the lock file {cache_dir / LOCK_NAME} is a symbolic link" in err, err
    assert victim.read_bytes() == b"precious"


def test_a_dangling_link_or_a_folder_for_a_lock_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir, victim = tmp_path / "cache", tmp_path / "victim.txt"
    cache_dir.mkdir()
    (cache_dir / LOCK_NAME).symlink_to(victim)
    code, _, err = semantic(capsys, cache_dir, "cache", "gc")
    assert code == 1 and "is a symbolic link" in err and not victim.exists()
    (cache_dir / LOCK_NAME).unlink()
    (cache_dir / LOCK_NAME).mkdir()
    code, _, err = semantic(capsys, cache_dir, "agents", "ls")
    assert code == 1 and f"the lock file {cache_dir / LOCK_NAME} is a folder" in err, err
    assert "Traceback" not in err


def test_a_holder_is_never_read_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim.json"
    victim.write_bytes(msgspec.json.encode(LockHolder(4321, "server", "127.0.0.1", 9)))
    (tmp_path / LOCK_NAME).symlink_to(victim)
    assert read_holder(tmp_path / LOCK_NAME, wait_s=0) is None
    assert read_holder(victim, wait_s=0) == LockHolder(4321, "server", "127.0.0.1", 9)


def test_a_server_refuses_a_lock_file_that_is_a_link(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cache_dir, victim = tmp_path / "cache", tmp_path / "victim.txt"
    cache_dir.mkdir()
    victim.write_bytes(b"precious")
    (cache_dir / LOCK_NAME).symlink_to(victim)
    server = ServerProcess(cache_dir, "--model", str(tiny_llama_dir))
    with pytest.raises(RuntimeError, match=r"refusing to serve: the lock file .* is a symbolic link"):
        server.start()
    assert server.proc is not None and server.proc.returncode == 1
    assert victim.read_bytes() == b"precious" and "Traceback" not in server.log()


def test_a_server_refuses_a_linked_agents_folder(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """It would have written every agent's files where the link points, outside the cache dir."""
    cache_dir, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache_dir.mkdir()
    elsewhere.mkdir()
    (cache_dir / "agents").symlink_to(elsewhere, target_is_directory=True)
    server = ServerProcess(cache_dir, "--model", str(tiny_llama_dir))
    with pytest.raises(RuntimeError, match=r"refusing to serve: .*agents is a symbolic link"):
        server.start()
    assert server.proc is not None and server.proc.returncode == 1
    assert list(elsewhere.iterdir()) == [] and "Traceback" not in server.log()
