"""What the asyncio side sends the engine thread: asks with a typed reply, and internal tells.

`await engine.ask(TakeCache("a"))` is typed by the command: each ask subclasses `EngineAsk[reply]`.
A failure while answering an ask goes to its caller; the engine thread lives on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.loop.messages import EventChannel, GenerationRequest
from semantic.engine.model.loading import LoadedModel

T = TypeVar("T")


class EngineAsk(Generic[T]):
    """A question for the engine thread whose answer has type `T`."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class CachedAgent:
    agent_id: str
    num_tokens: int
    last_used_s_ago: float


@dataclass(frozen=True, slots=True)
class PoolReport:
    """The block pool and batch as the engine thread sees them (for tests and benches)."""

    num_blocks: int
    num_free_blocks: int
    used_bytes: int
    num_running: int
    num_in_batch: int
    ref_counts: list[int]  # of every referenced block, sorted
    agent_id_to_block_ids: dict[str, list[int]]
    agent_id_to_num_tokens: dict[str, int]
    window_block_ids: list[int] = field(default_factory=list)  # blocks holding sliding layers too
    num_shared_states: int = 0  # resume points kept for other agents' prompts


@dataclass(frozen=True, slots=True)
class LoadModel(EngineAsk[LoadedModel]):
    """Load a model into an engine that has none; fails with its load error."""

    source: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class UnloadModel(EngineAsk[None]):
    """Drop the model, its batch and its block pool; fails while requests run or wait."""


@dataclass(frozen=True, slots=True)
class Drain(EngineAsk[int]):
    """Answered once nothing runs or waits; past `timeout_s` the rest fail. Replies how many failed.

    The caller stops new submissions first."""

    timeout_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class RestoreCache(EngineAsk[bool]):
    """Put a cache read from disk into memory; False if the loaded model is no longer `fingerprint`."""

    cache: SerializedCache
    fingerprint: str
    cache_salt: str | None = None  # of the turn that needs it: its shared blocks are filed under it


@dataclass(frozen=True, slots=True)
class TakeCache(EngineAsk[SerializedCache | None]):
    """Serialize an agent's cache and free its blocks; None if not in memory, running, or no model."""

    agent_id: str


@dataclass(frozen=True, slots=True)
class SnapshotCaches(EngineAsk[list[SerializedCache]]):
    """Serialize a named agent's cache in memory (it stays there), unless it has none or its tokens
    digest is `file_digest`, its file's (the file holds it already): [] then. "": no current file."""

    agent_id: str
    file_digest: str = ""


@dataclass(frozen=True, slots=True)
class DropCache(EngineAsk[None]):
    """Free an agent's cache from memory. In a group a follower deletes its shard file too (a
    forget), unless `keeps_files` (an evict, whose files were just written)."""

    agent_id: str
    keeps_files: bool = False


@dataclass(frozen=True, slots=True)
class ListCaches(EngineAsk[list[CachedAgent]]):
    """The agents with a cache in memory (or just `agent_id`); empty without a model."""

    agent_id: str | None = None


@dataclass(frozen=True, slots=True)
class InspectPool(EngineAsk[PoolReport]):
    pass


@dataclass(frozen=True, slots=True)
class ReferenceGenerate(EngineAsk[list[int]]):
    """The oracle for tests: greedy mlx-lm `stream_generate` outside the batch, eos removed."""

    prompt_tokens: list[int]
    max_tokens: int


# ---- internal: only `Engine` builds these ----


@dataclass(slots=True)
class Submit:
    request: GenerationRequest
    events: EventChannel
    queued_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Cancel:
    request_id: str


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class PendingAsk:
    """An ask on its way to the engine thread, and where its answer goes. The engine thread reads a
    thread queue (it blocks there while idle), not an actor's asyncio mailbox (storage/mailbox.py),
    so the answer crosses back to the loop, and there follows the actors' rule (`reply_to`)."""

    command: EngineAsk[Any]
    reply: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop = field(repr=False)

    def answer(self, value: Any) -> None:
        self.loop.call_soon_threadsafe(resolve, self.reply, value)

    def fail(self, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(reject, self.reply, error)


Message = Submit | Cancel | Shutdown | PendingAsk


def resolve(future: asyncio.Future[Any], value: Any) -> None:
    """Loop side: answer an ask unless its caller already gave up on it."""
    reply_to(future, value)


def reject(future: asyncio.Future[Any], error: BaseException) -> None:
    reply_to(future, error=error)


def reply_to(
    reply: asyncio.Future[Any] | None, result: Any = None, error: BaseException | None = None
) -> None:
    """Answer an ask with `result`, or fail it with `error`, unless its caller left or it has no reply."""
    if reply is None or reply.done():
        return
    if error is not None:
        reply.set_exception(error)
    else:
        reply.set_result(result)
