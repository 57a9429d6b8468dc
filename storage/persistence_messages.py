"""The messages the persistence actor answers, one named type each."""

from __future__ import annotations

from dataclasses import dataclass

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.storage.agent_id import AgentId
from semantic.storage.conversation_file import ConversationRecord


@dataclass(frozen=True, slots=True)
class SaveCaches:
    """Caches copied out of memory at `taken_at` (monotonic): an agent deleted since is not written."""

    caches: list[SerializedCache]
    taken_at: float


@dataclass(frozen=True, slots=True)
class WriteCache:
    """One cache, whose write failure goes to the asker (an evict keeps the cache in memory then)."""

    cache: SerializedCache


@dataclass(frozen=True, slots=True)
class LoadCache:
    agent_id: AgentId


@dataclass(frozen=True, slots=True)
class DescribeCache:
    """What the index knows of an agent's cache file, without reading it (restore by cost)."""

    agent_id: AgentId


@dataclass(frozen=True, slots=True)
class CacheOnDisk:
    num_tokens: int
    num_bytes: int  # the file's size; 0 where the disk budget has no record of it


@dataclass(frozen=True, slots=True)
class DeleteAgent:
    agent_id: AgentId


@dataclass(frozen=True, slots=True)
class SaveConversation:
    agent_id: AgentId
    record: ConversationRecord


@dataclass(frozen=True, slots=True)
class LoadConversation:
    agent_id: AgentId


@dataclass(frozen=True, slots=True)
class QuarantineCache:
    """The cache file read fine but could not be used (the engine refused it): move it aside."""

    agent_id: AgentId
    reason: str


@dataclass(frozen=True, slots=True)
class ListOnDisk:
    only: AgentId | None = None


@dataclass(frozen=True, slots=True)
class StopPersistence:
    pass


PersistenceMessage = (
    SaveCaches
    | WriteCache
    | LoadCache
    | DescribeCache
    | DeleteAgent
    | SaveConversation
    | LoadConversation
    | QuarantineCache
    | ListOnDisk
    | StopPersistence
)
