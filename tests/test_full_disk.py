"""A disk that fills up, and writes a crash interrupts (issue 63, items 5 and 6).

A full disk is a real one where the tests may mount a small tmpfs (as root), so the real safetensors
runs out of space and raises its own error type; elsewhere those tests skip, and the ones that need
no mount fake only the disk: safetensors' save raising what it raises on a full disk, or a slow one.
The servers serve the tiny random-weight Llama, whose words do not matter here, with disks sized to
its caches.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger
from safetensors import SafetensorError

from semantic.storage import cache_file
from semantic.storage.agent_id import AgentId
from semantic.storage.cache_file import SAFETENSORS_TEMP_NAME, is_temp_name, write_cache_file
from semantic.storage.conversation_file import ConversationRecord
from semantic.storage.disk_full import DiskFullError
from semantic.storage.persistence import PersistenceActor
from tests.agent_api_client import call
from tests.server_process import ROOT, ServerProcess
from tests.test_cache_file import IDENTITY
from tests.test_disk_budget import a_cache_of, file_bytes
from tests.waiting import wait_until

# What safetensors 0.8.0 raises when the disk fills up under its save_file.
FULL_DISK_ERROR = "Error while serializing: I/O error: No space left on device (os error 28)"
# ~400 tokens of prompt: its cache is larger than the disk. The tiny Llama's KV is 2.25 KiB a token
# (3 layers, keys and values, 6 heads of 16 float32s): ~0.9 MiB for this prompt, ~0.1 MiB a small's.
LONG = "Remember these words: " + " ".join(f"word{i}" for i in range(100))
SMALL_AGENTS = ("s1", "s2", "s3")


@pytest.fixture
def small_disk() -> Iterator[Callable[[Path, int], Path]]:
    """Mount a tmpfs of `size_kb` at a folder (unmounted after the test)."""
    mounted: list[Path] = []

    def mount(folder: Path, size_kb: int) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            pytest.skip("a full disk here is a small tmpfs, and there is no mount command")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"a full disk here is a small tmpfs, and mounting one failed: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def errors_logged(level: str = "ERROR") -> tuple[list[str], int]:
    messages: list[str] = []
    return messages, logger.add(messages.append, level=level)


def chat(server: ServerProcess, agent: str, content: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{server.base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-agent-id": agent},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def cache_files(agents_root: Path) -> set[str]:
    return {path.name.removesuffix(".safetensors") for path in agents_root.glob("*/*.safetensors")}


def temp_names(agents_root: Path) -> list[str]:
    return [path.name for path in agents_root.glob("*/*") if is_temp_name(path.name)]


def make_big_and_small_agents(server: ServerProcess) -> None:
    """The big agent's turn first: the engine lists its cache first, so a flush meets it first."""
    chat(server, "big", LONG)
    for agent in SMALL_AGENTS:
        chat(server, agent, f"Hello, I am {agent}.")


# ---- in-process: the persistence actor on a disk that fills up ----


def test_a_cache_the_disk_cannot_take_is_logged_and_the_next_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = cache_file.save_file

    def save_until_full(tensors: Any, filename: str, metadata: Any = None) -> None:
        if metadata["agent_id"] == "big":  # runs out of space half-way, its temp file left
            (Path(filename).parent / ".tmpAb12Cd").write_bytes(b"\0" * 1000)
            raise SafetensorError(FULL_DISK_ERROR)
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(cache_file, "save_file", save_until_full)

    async def run() -> None:
        actor = PersistenceActor(tmp_path, IDENTITY)
        await actor.start()
        try:
            assert await actor.save([a_cache_of("big"), a_cache_of("small")]) == ["small"]
            with pytest.raises(DiskFullError) as raised:
                await actor.write(a_cache_of("big"))
            assert raised.value.errno == errno.ENOSPC and "big.safetensors" in str(raised.value)
            assert actor.disk_budget.num_writing_bytes == 0  # no longer counted once removed
            assert sorted(p.name for p in actor.agents_dir.iterdir()) == ["small.safetensors"]
        finally:
            await actor.stop()

    messages, sink = errors_logged()
    try:
        asyncio.run(run())
    finally:
        logger.remove(sink)
    assert any("agent big" in m and "No space left on device" in m for m in messages), messages


def test_on_a_real_full_disk_caches_go_on_and_conversations_raise_enospc(
    tmp_path: Path, small_disk: Callable[[Path, int], Path]
) -> None:
    disk = small_disk(tmp_path / "disk", 64)
    big, small = a_cache_of("big", 2000), a_cache_of("small")  # 264 KB and 5 KB

    async def run() -> None:
        actor = PersistenceActor(disk, IDENTITY)
        await actor.start()
        try:
            assert await actor.save([big, small]) == ["small"]  # the real SafetensorError, logged
            with pytest.raises(DiskFullError) as raised:
                await actor.write(big)
            assert raised.value.errno == errno.ENOSPC
            assert sorted(p.name for p in actor.agents_dir.iterdir()) == ["small.safetensors"]
            with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
                while True:  # the rest of the disk
                    filler.write(b"\0" * 4096)
            # An unacknowledged turn must say it was not saved: this one raises, as ENOSPC.
            with pytest.raises(OSError) as raised_too:
                await actor.save_conversation(AgentId("small"), ConversationRecord(token_ids=[1, 2, 3]))
            assert raised_too.value.errno == errno.ENOSPC
            assert not any(is_temp_name(p.name) for p in actor.agents_dir.iterdir())
        finally:
            await actor.stop()

    asyncio.run(run())


# ---- temp files: counted while written, removed at start ----


CRASH_MID_WRITE = """
import resource, signal, sys
from pathlib import Path
from semantic.storage.cache_file import write_cache_file
from tests.test_cache_file import IDENTITY
from tests.test_disk_budget import a_cache_of
cache = a_cache_of("ada", 400)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; by default it kills the writer
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # past 4 KB a file write is fatal
write_cache_file(Path(sys.argv[1]), cache, IDENTITY)
"""


def test_what_an_interrupted_write_leaves_is_removed_at_the_next_start(tmp_path: Path) -> None:
    actor = PersistenceActor(tmp_path, IDENTITY)
    actor.agents_dir.mkdir(parents=True)
    target = actor.agents_dir / "ada.safetensors"
    crashed = subprocess.Popen([sys.executable, "-c", CRASH_MID_WRITE, str(target)], cwd=ROOT)
    assert crashed.wait() == -signal.SIGXFSZ  # killed in the middle of the real write
    # Measured: safetensors writes through its own ".tmpXXXXXX" beside its target, which is inside
    # our staging folder: the one name left in the agents' folder is ours.
    (left,) = actor.agents_dir.iterdir()
    assert left.is_dir() and left.name == f".ada.safetensors.{crashed.pid}.tmp"
    assert [SAFETENSORS_TEMP_NAME.fullmatch(p.name) is not None for p in left.iterdir()] == [True]
    # What older writers left: our temp file, and safetensors' own beside its target.
    (actor.agents_dir / ".bob.safetensors.4242.tmp").write_bytes(os.urandom(2**20))
    (actor.agents_dir / ".tmpQ1w2E3").write_bytes(os.urandom(2 * 2**20))
    write_cache_file(actor.agents_dir / "cy.safetensors", a_cache_of("cy"), IDENTITY)

    async def run() -> int:
        await actor.start()
        try:
            return actor.disk_budget.num_bytes
        finally:
            await actor.stop()

    messages, sink = errors_logged("INFO")
    try:
        num_bytes = asyncio.run(run())
    finally:
        logger.remove(sink)
    assert [p.name for p in actor.agents_dir.iterdir()] == ["cy.safetensors"]
    assert num_bytes == (actor.agents_dir / "cy.safetensors").stat().st_size
    assert any("removed 3 temp files" in m and "3.0 MiB freed" in m for m in messages), messages


def test_a_file_being_written_is_counted_and_room_is_made_for_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 2 * file_bytes() + 4096  # room for two files (each with a header of ~1 KB), not three
    started, release = threading.Event(), threading.Event()
    real_save = cache_file.save_file

    def slow_save(tensors: Any, filename: str, metadata: Any = None) -> None:
        if metadata["agent_id"] == "cy":  # a slow disk: the write waits for the test
            started.set()
            release.wait(300)
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(cache_file, "save_file", slow_save)

    async def run() -> None:
        actor = PersistenceActor(tmp_path, IDENTITY, budget)
        await actor.start()
        try:
            for agent in ("ada", "bob"):
                assert await actor.save([a_cache_of(agent)]) == [agent]
                await asyncio.sleep(0.01)  # distinct times of use: ada's file is the oldest
            saving = asyncio.create_task(actor.save([a_cache_of("cy")]))
            assert await asyncio.to_thread(started.wait, 300)
            # Mid-write: cy's bytes count, and ada's file went before them, not after.
            assert actor.disk_budget.num_writing_bytes == file_bytes()
            assert actor.disk_budget.num_bytes <= budget
            assert not actor.path_for(AgentId("ada")).exists() and actor.path_for(AgentId("bob")).exists()
            staging = [p.name for p in actor.agents_dir.iterdir() if is_temp_name(p.name)]
            assert staging == [f".cy.safetensors.{os.getpid()}.tmp"]
            release.set()
            assert await saving == ["cy"]
            assert actor.disk_budget.num_writing_bytes == 0
            assert sorted(p.name for p in actor.agents_dir.iterdir()) == ["bob.safetensors", "cy.safetensors"]
        finally:
            release.set()
            await actor.stop()

    asyncio.run(run())


# ---- a real server on a small disk ----


def test_sigterm_on_a_full_disk_writes_every_cache_that_fits_and_exits_0(
    server_factory, tiny_llama_dir: Path, tmp_path: Path, small_disk: Callable[[Path, int], Path]
) -> None:
    agents_root = small_disk(tmp_path / "cache" / "agents", 512)  # the smalls' caches, not big's
    args = ("--model", str(tiny_llama_dir), "--checkpoint-idle-s", "0", "--cache-budget-mb", "256")
    server = server_factory(*args).start()
    make_big_and_small_agents(server)
    assert server.stop() == 0
    assert cache_files(agents_root) == set(SMALL_AGENTS)
    assert not temp_names(agents_root)
    log = server.log()
    assert "could not write the cache of agent big" in log and "No space left on device" in log
    assert "flushed 3 agent caches to disk" in log


def test_an_idle_checkpoint_goes_past_a_cache_the_disk_cannot_take(
    server_factory, tiny_llama_dir: Path, tmp_path: Path, small_disk: Callable[[Path, int], Path]
) -> None:
    agents_root = small_disk(tmp_path / "cache" / "agents", 512)
    args = ("--model", str(tiny_llama_dir), "--checkpoint-idle-s", "1", "--cache-budget-mb", "256")
    server = server_factory(*args).start()
    make_big_and_small_agents(server)
    wait_until(lambda: cache_files(agents_root) == set(SMALL_AGENTS), "a checkpoint wrote every small cache")
    assert "could not write the cache of agent big" in server.log()
    assert "checkpoint failed" not in server.log()
    assert not temp_names(agents_root)
    assert server.proc is not None
    server.proc.kill()
    server.proc.wait()


def test_evict_on_a_full_disk_answers_507_and_keeps_the_cache_for_the_next_turn(
    server_factory, tiny_llama_dir: Path, tmp_path: Path, small_disk: Callable[[Path, int], Path]
) -> None:
    agents_root = small_disk(tmp_path / "cache" / "agents", 64)  # conversations fit, the cache not
    args = ("--model", str(tiny_llama_dir), "--checkpoint-idle-s", "0", "--cache-budget-mb", "256")
    server = server_factory(*args).start()
    assert call(server, "POST", "/v1/agents", {"id": "ada", "system": "You are terse."})[0] == 201
    options = {"max_tokens": 4, "temperature": 0}
    status, first = call(server, "POST", "/v1/agents/ada/messages", {"content": LONG[:200], **options})
    assert status == 200, first

    status, body = call(server, "POST", "/v1/agents/ada/evict")
    assert status == 507, body
    assert "No space left on device" in body["error"]["message"]
    assert call(server, "GET", "/v1/agents/ada")[1]["tier"] == "memory"
    assert not temp_names(agents_root) and "ada" not in cache_files(agents_root)

    status, second = call(server, "POST", "/v1/agents/ada/messages", {"content": "Again.", **options})
    assert status == 200, second
    history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["cache_tier"] == "memory"
    assert second["usage"]["cached_tokens"] >= history - 1  # all but an unfed final token
    assert server.stop() == 0  # its flush meets the full disk again, and goes on
