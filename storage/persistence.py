"""The persistence actor: agents' caches and conversations to and from disk, one model's folder.

A real actor: callers send named messages to its mailbox and await the reply; one task handles
them in order and alone owns the index of what is on disk; blocking file I/O runs in the one
worker thread it owns, never on the event loop or the engine thread. File names are built only
from validated `AgentId`s and every path is checked to stay inside the model's folder. Files that
cannot be used are moved to `quarantine/` with a log line.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from loguru import logger

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.loop.commands import reply_to
from semantic.storage.agent_id import AgentId, InvalidAgentIdError
from semantic.storage.agents_folder import (
    CONVERSATION_SUFFIX,
    NEWER_FORMAT_DIR,
    SUFFIX,
    DiskEntry,
    adopt_conversations,
    case_twin,
    ignores_case,
    move_aside,
    read_and_touch,
    refuse_case_twin,
    scan_folder,
    set_aside,
    unlink,
)
from semantic.storage.cache_file import CacheFileError, CacheIdentity, NewerCacheFileError, write_cache_file
from semantic.storage.conversation_file import (
    ConversationFileError,
    ConversationRecord,
    NewerConversationFileError,
    read_conversation,
    write_conversation,
)
from semantic.storage.disk_budget import DiskBudget
from semantic.storage.mailbox import Mailbox
from semantic.storage.persistence_messages import (
    CacheOnDisk,
    DeleteAgent,
    DescribeCache,
    ListOnDisk,
    LoadCache,
    LoadConversation,
    PersistenceMessage,
    QuarantineCache,
    SaveCaches,
    SaveConversation,
    StopPersistence,
    WriteCache,
)

# Deletes remembered, so that a cache copied before its agent was deleted is not written after.
MAX_TOMBSTONES = 4096


class PersistenceStoppedError(RuntimeError):
    pass


NAMES_ONE_AGENT = (
    LoadCache | DescribeCache | DeleteAgent | SaveConversation | LoadConversation | QuarantineCache
)


class PersistenceActor:
    def __init__(
        self,
        cache_dir: Path,
        identity: CacheIdentity,
        disk_budget_bytes: int | None = None,
        ignores_case: bool | None = None,  # None: ask the file system at start
    ) -> None:
        self.identity = identity
        self.disk_budget = DiskBudget(disk_budget_bytes)  # owned by the actor's task, as the index
        self.agents_dir = (
            cache_dir.resolve() / "agents" / identity.fingerprint[:16]
        )  # no link inside followed
        self.quarantine_dir = cache_dir.resolve() / "quarantine"  # never a link's target: see move_aside
        self._mailbox: Mailbox[PersistenceMessage] = Mailbox()  # unbounded: its callers are the server's own
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semantic-persist")
        self._task: asyncio.Task[None] | None = None
        self._index: dict[AgentId, DiskEntry] = {}  # owned by the actor's task
        self._deleted_at: OrderedDict[AgentId, float] = OrderedDict()  # monotonic, the newest last
        self.ignores_case = ignores_case
        self.num_writes = 0
        self.num_loads = 0
        self.num_quarantined = 0
        self.num_disk_evictions = 0
        self.last_write_s = 0.0
        self.write_seconds_total = 0.0
        self.num_read_bytes = 0  # cache files read, and the seconds their reads took (restore by cost)
        self.read_s_total = 0.0

    # ---- the asking side ----

    async def start(self) -> None:
        legacy = self.identity.legacy_fingerprint
        if legacy and legacy[:16] != self.identity.fingerprint[:16]:
            await self._io(adopt_conversations, self.agents_dir.parent / legacy[:16], self.agents_dir)
        if self.ignores_case is None:
            self.ignores_case = await self._io(ignores_case, self.agents_dir)
        self._index, self.disk_budget.files = await self._io(scan_folder, self.agents_dir)
        await self._keep_within_budget()  # the budget may be smaller than last time
        self._task = asyncio.get_running_loop().create_task(self._run(), name="semantic-persistence")

    async def stop(self) -> None:
        """Handle what is queued, then stop; later asks fail with PersistenceStoppedError."""
        if self._task is not None:
            await self._ask(StopPersistence())
            await self._task
            self._task = None
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    async def save(self, caches: list[SerializedCache], taken_at: float | None = None) -> list[AgentId]:
        """Write caches copied out of memory at `taken_at` (monotonic; None: now); returns the
        agents written. A failed write (a full disk, any error) is logged, leaves the file it would
        have replaced, and the next cache is still written. An agent deleted after `taken_at` is
        not written: a copy that was on its way must not bring it back."""
        taken_at = time.monotonic() if taken_at is None else taken_at
        written: list[AgentId] = await self._ask(SaveCaches(caches, taken_at))
        return written

    async def write(self, cache: SerializedCache) -> bool:
        """Write one cache; False where it is not to be written (larger than the disk budget, a
        case twin's). A failed write raises (DiskFullError when the disk is full), leaving the file
        it would have replaced."""
        written: bool = await self._ask(WriteCache(cache))
        return written

    async def load(self, agent_id: AgentId) -> SerializedCache | None:
        """An agent's cache, or None when it has none or its file was bad (quarantined: start cold)."""
        cache: SerializedCache | None = await self._ask(LoadCache(agent_id))
        return cache

    async def describe_cache(self, agent_id: AgentId) -> CacheOnDisk | None:
        """The agent's cache file's tokens and bytes, from the index (no read); None without one."""
        described: CacheOnDisk | None = await self._ask(DescribeCache(agent_id))
        return described

    async def delete(self, agent_id: AgentId) -> None:
        await self._ask(DeleteAgent(agent_id))

    async def save_conversation(self, agent_id: AgentId, record: ConversationRecord) -> None:
        """Write and fsync the record; raises OSError if it could not be written."""
        await self._ask(SaveConversation(agent_id, record))

    async def load_conversation(self, agent_id: AgentId) -> ConversationRecord | None:
        record: ConversationRecord | None = await self._ask(LoadConversation(agent_id))
        return record

    async def quarantine(self, agent_id: AgentId, reason: str) -> None:
        await self._ask(QuarantineCache(agent_id, reason))

    async def on_disk(self, only: AgentId | None = None) -> dict[AgentId, DiskEntry]:
        """What is on disk, for every agent or just `only`."""
        entries: dict[AgentId, DiskEntry] = await self._ask(ListOnDisk(only))
        return entries

    def path_for(self, agent_id: AgentId) -> Path:
        return self._inside(f"{AgentId(agent_id)}{SUFFIX}")

    def conversation_path_for(self, agent_id: AgentId) -> Path:
        return self._inside(f"{AgentId(agent_id)}{CONVERSATION_SUFFIX}")

    def _inside(self, name: str) -> Path:
        path = (self.agents_dir / name).resolve()
        if path.parent != self.agents_dir:
            raise InvalidAgentIdError(f"{name!r} would leave the cache folder")
        return path

    async def _ask(self, message: PersistenceMessage) -> Any:
        if self._task is None or self._task.done():
            raise PersistenceStoppedError("the persistence actor is not running")
        return await self._mailbox.ask(message)

    async def _io(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- the actor's task: the only code that reads or changes the index ----

    async def _run(self) -> None:
        try:
            while await self._answer_next():
                pass
        finally:  # what was asked after the stop fails, as what is asked from now on
            self._mailbox.close(lambda: PersistenceStoppedError("the persistence actor stopped"))

    async def _answer_next(self) -> bool:
        """Take the next message and answer it; False once told to stop. Its own frame, so that
        nothing a message carried (a cache's arrays, read or written) stays referenced while the
        actor waits for the next one."""
        envelope = await self._mailbox.get()
        if envelope is None:
            return False
        try:
            result = await self._handle(envelope.message)
        except Exception as error:
            reply_to(envelope.reply, error=error)
        else:
            reply_to(envelope.reply, result)
        return not isinstance(envelope.message, StopPersistence)

    async def _handle(self, message: PersistenceMessage) -> Any:
        if isinstance(message, NAMES_ONE_AGENT):
            refuse_case_twin(message.agent_id, self._index, bool(self.ignores_case))
        match message:
            case SaveCaches(caches=caches, taken_at=taken_at):
                kept = [cache for cache in caches if not self._deleted_since(cache.agent_id, taken_at)]
                return [
                    agent_id for cache in kept if (agent_id := await self._save_or_log(cache)) is not None
                ]
            case WriteCache(cache=cache):
                return await self._save(cache) is not None
            case LoadCache(agent_id=agent_id):
                return await self._load(agent_id)
            case DescribeCache(agent_id=agent_id):
                entry = self._index.get(agent_id)
                if entry is None or not entry.has_cache:
                    return None
                use = self.disk_budget.files.get(agent_id)
                return CacheOnDisk(entry.num_cached_tokens, use.num_bytes if use is not None else 0)
            case DeleteAgent(agent_id=agent_id):
                self._deleted_at.pop(agent_id, None)
                self._deleted_at[agent_id] = time.monotonic()
                if len(self._deleted_at) > MAX_TOMBSTONES:
                    self._deleted_at.popitem(last=False)
                self._index.pop(agent_id, None)
                self.disk_budget.forget(agent_id)
                await self._io(unlink, self.path_for(agent_id), self.conversation_path_for(agent_id))
                return None
            case SaveConversation(agent_id=agent_id, record=record):
                await self._io(write_conversation, self.conversation_path_for(agent_id), record)
                self._index.setdefault(agent_id, DiskEntry()).has_conversation = True
                return None
            case LoadConversation(agent_id=agent_id):
                return await self._load_conversation(agent_id)
            case QuarantineCache(agent_id=agent_id, reason=reason):
                await self._quarantine(agent_id, self.path_for(agent_id), reason)
                return None
            case ListOnDisk(only=only):
                if only is not None:
                    entry = self._index.get(only)
                    return {only: replace(entry)} if entry is not None else {}
                return {agent_id: replace(entry) for agent_id, entry in self._index.items()}
            case StopPersistence():
                return None

    def _deleted_since(self, agent_id: str, taken_at: float) -> bool:
        deleted_at = self._deleted_at.get(AgentId(agent_id))
        if deleted_at is None or deleted_at < taken_at:
            return False
        logger.info("not writing the cache of agent {}: deleted after it was copied", agent_id)
        return True

    async def _save_or_log(self, cache: SerializedCache) -> AgentId | None:
        try:
            return await self._save(cache)
        except Exception as error:  # one agent's failure must not keep the next from disk
            logger.error("could not write the cache of agent {}: {}", cache.agent_id, error)
            return None

    async def _save(self, cache: SerializedCache) -> AgentId | None:
        """Write one cache; None where it is not to be written. A failed write raises."""
        agent_id = AgentId(cache.agent_id)
        if (other := case_twin(agent_id, self._index, bool(self.ignores_case))) is not None:
            logger.warning("not writing the cache of {}: its file is {}'s on this disk", agent_id, other)
            return None
        num_bytes = sum(tensor.nbytes for tensor in cache.tensors.values())
        if not self.disk_budget.fits(num_bytes):
            logger.warning(
                "not writing the cache of agent {} ({:.0f} MiB): larger than the disk budget",
                agent_id,
                num_bytes / 2**20,
            )
            return None
        start = time.perf_counter()
        self.disk_budget.num_writing_bytes = num_bytes
        try:
            await self._keep_within_budget(keep=agent_id)  # room for the file while it is written
            num_bytes, digest = await self._io(
                write_cache_file, self.path_for(agent_id), cache, self.identity
            )
        finally:
            self.disk_budget.num_writing_bytes = 0
        seconds = time.perf_counter() - start
        entry = self._index.setdefault(agent_id, DiskEntry())
        entry.holds_cache(cache.num_tokens, digest)
        self.num_writes += 1
        self.last_write_s = seconds
        self.write_seconds_total += seconds
        self.disk_budget.note(agent_id, num_bytes, time.time())
        await self._keep_within_budget(keep=agent_id)
        return agent_id if agent_id in self.disk_budget.files else None  # alone over the budget: gone

    async def _keep_within_budget(self, keep: AgentId | None = None) -> None:
        """Delete the cache files used longest ago until the folder's are within the disk budget."""
        for agent_id in self.disk_budget.over(keep):
            use = self.disk_budget.files[agent_id]
            logger.info(
                "deleting the cache file of agent {} ({:.0f} MiB, last used {:.0f} s ago): over the "
                "disk budget; its next turn computes it again",
                agent_id,
                use.num_bytes / 2**20,
                time.time() - use.last_used,
            )
            await self._io(unlink, self.path_for(agent_id))
            self.disk_budget.forget(agent_id)
            self.num_disk_evictions += 1
            entry = self._index.get(agent_id)
            if entry is not None:
                entry.lose_cache()
                if not entry.has_conversation:
                    del self._index[agent_id]

    async def _load(self, agent_id: AgentId) -> SerializedCache | None:
        entry = self._index.get(agent_id)
        if entry is None or not entry.has_cache:
            return None
        path = self.path_for(agent_id)
        start = time.perf_counter()
        try:
            cache, digest = await self._io(read_and_touch, path, self.identity, agent_id)
        except CacheFileError as error:
            await self._quarantine(agent_id, path, str(error), isinstance(error, NewerCacheFileError))
            return None
        except FileNotFoundError:
            entry.lose_cache()
            self.disk_budget.forget(agent_id)
            return None
        self.num_loads += 1
        use = self.disk_budget.files.get(agent_id)
        if use is not None:
            self.num_read_bytes += use.num_bytes
            self.read_s_total += time.perf_counter() - start
        entry.holds_cache(cache.num_tokens, digest)  # of the token ids the read checked
        self.disk_budget.touch(agent_id, time.time())
        return cache

    async def _load_conversation(self, agent_id: AgentId) -> ConversationRecord | None:
        path = self.conversation_path_for(agent_id)
        try:
            record: ConversationRecord | None = await self._io(
                read_conversation, path, self.identity.vocab_size
            )
        except ConversationFileError as error:
            await self._quarantine(agent_id, path, str(error), isinstance(error, NewerConversationFileError))
            return None
        return record

    async def _quarantine(self, agent_id: AgentId, path: Path, reason: str, is_newer: bool = False) -> None:
        """Move a file that cannot be used aside: to quarantine/, or, one of a newer format, to
        newer-format/ (not corrupt: kept whole for the release that reads it)."""
        if is_newer:
            logger.warning(
                "setting {} of agent {} aside in {}/: {}", path.name, agent_id, NEWER_FORMAT_DIR, reason
            )
        else:
            logger.warning("quarantining {} of agent {}: {}", path.name, agent_id, reason)
        entry = self._index.get(agent_id)
        if entry is not None:
            if path.name.endswith(CONVERSATION_SUFFIX):
                entry.has_conversation = False
            else:
                entry.lose_cache()
                self.disk_budget.forget(agent_id)
            if not (entry.has_cache or entry.has_conversation):
                del self._index[agent_id]
        if is_newer:
            await self._io(set_aside, path, self.quarantine_dir.parent / NEWER_FORMAT_DIR)
        elif await self._io(move_aside, path, self.quarantine_dir):
            self.num_quarantined += 1
