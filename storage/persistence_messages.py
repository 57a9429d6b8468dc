"""The messages the persistence actor answers, one named type each."""

from __future__ import annotations

from dataclasses import dataclass

from semantic.actors.agent_id import AgentId
from semantic.engine.cache_tensors import SerializedCache
from semantic.storage.conversation_file import ConversationRecord


@dataclass(frozen=True, slots=True)
class SaveCaches:
    caches: list[SerializedCache]


@dataclass(frozen=True, slots=True)
class LoadCache:
    agent_id: AgentId


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
    | LoadCache
    | DeleteAgent
    | SaveConversation
    | LoadConversation
    | QuarantineCache
    | ListOnDisk
    | StopPersistence
)
