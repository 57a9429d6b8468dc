"""What the protocols use from below the actor layer, in one place.

The HTTP protocols import the actor layer and nothing under it (`tests/test_layers.py`): the values a
turn's stream carries and the errors a turn raises come from here, named as their homes in the engine
and storage name them, and what a health check, a metrics scrape or a model card reads of the running
engine and its cache files comes through `ServerView`, which only reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from semantic.actors.model_registry import ModelEntry, UnknownModelError
from semantic.actors.prompting.chat_format import ChatMessage
from semantic.actors.prompting.tool_format import HERMES, ToolFormat, ToolSchemas
from semantic.actors.request_stream import RequestStream
from semantic.engine.decoding.sampling import MAX_LOGIT_BIASES, MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams
from semantic.engine.decoding.token_logprobs import TokenLogprob
from semantic.engine.loop.config import EngineStats
from semantic.engine.loop.errors import EngineError, PromptTooLongError
from semantic.engine.loop.messages import (
    Event,
    Finished,
    FinishReason,
    PromptProgress,
    PromptStarted,
    TokenDelta,
)
from semantic.storage.agent_id import (
    MAX_AGENT_ID_LENGTH,
    NAMESPACE_PATTERN,
    AgentId,
    InvalidAgentIdError,
    agent_id_from,
)
from semantic.storage.persistence import PersistenceStoppedError

if TYPE_CHECKING:
    from semantic.actors.system import AgentSystem
    from semantic.engine.loop.backend_profile import BackendProfile

__all__ = [
    "HERMES",
    "MAX_AGENT_ID_LENGTH",
    "MAX_LOGIT_BIASES",
    "MAX_SEED",
    "MAX_TOP_LOGPROBS",
    "NAMESPACE_PATTERN",
    "AgentId",
    "ChatMessage",
    "DiskFigures",
    "EngineError",
    "EngineStats",
    "Event",
    "FinishReason",
    "Finished",
    "InvalidAgentIdError",
    "ModelEntry",
    "PersistenceStoppedError",
    "PromptProgress",
    "PromptStarted",
    "PromptTooLongError",
    "RequestStream",
    "SamplingParams",
    "ServerView",
    "TokenDelta",
    "TokenLogprob",
    "ToolFormat",
    "ToolSchemas",
    "UnknownModelError",
    "agent_id_from",
]


@dataclass(frozen=True, slots=True)
class DiskFigures:
    """The cache files' counters, as the persistence actor keeps them."""

    num_loads: int
    num_bytes: int
    num_evictions: int
    num_writes: int
    write_seconds_total: float


class ServerView:
    """A running system's engine and cache-file figures, read-only."""

    def __init__(self, system: AgentSystem) -> None:
        self._system = system

    @property
    def engine_running(self) -> bool:
        return self._system.engine.is_running

    @property
    def engine_stats(self) -> EngineStats:
        return self._system.engine.stats

    @property
    def backend_profile(self) -> BackendProfile:
        return self._system.config.engine.profile

    def group_report(self) -> dict[str, Any] | None:
        """The ranks of a model split over a group (None for one process)."""
        return self._system.engine.group_report()

    @property
    def num_evicted_caches_dropped(self) -> int:
        return self._system.models.evicted_writes.num_dropped

    def disk(self) -> DiskFigures | None:
        """The cache files' counters; None while no model (and so no cache folder) is loaded."""
        persistence = self._system.models.persistence
        if persistence is None:
            return None
        return DiskFigures(
            persistence.num_loads,
            persistence.disk_budget.num_bytes,
            persistence.num_disk_evictions,
            persistence.num_writes,
            persistence.write_seconds_total,
        )
