"""What crosses the engine thread's boundary: requests in, per-request events out."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from semantic.engine.cache_store.prefix_pins import CachePin
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.decoding.token_logprobs import TokenLogprob

if TYPE_CHECKING:
    from semantic.engine.decoding.grammar_matcher import GrammarMatcher


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    agent_id: str | None = None
    # The model the prompt was tokenized for; the engine refuses it if another model is loaded.
    model_fingerprint: str | None = None
    # Roots the prefix-block hash chain: only requests with the same salt share blocks.
    cache_salt: str | None = None
    # The logits mask of a constrained reply (engine/decoding/grammar_matcher.py); the engine thread's
    # from submit on.
    grammar: GrammarMatcher | None = None
    # The reply continues the prompt's text (a prefill, a raw completion): its first space is kept.
    continues_text: bool = False
    # How many leading prompt tokens other agents' prompts are likely to share (the rendered system
    # prompt and tools): a model with recurrent layers keeps its state there for them (0: unknown).
    shared_head_tokens: int = 0
    # Where the prompt's generation prompt (the assistant header) begins: templates rewrite what follows
    # when they re-render the reply, so a model that cannot cut its cache back keeps its point for the
    # agent's next turn there (0: unknown; then before the prompt's last token).
    generation_prompt_start: int = 0
    # Anthropic `cache_control` breakpoints: leading prompt tokens (whole blocks) kept for a ttl.
    cache_pins: tuple[CachePin, ...] = ()

    @property
    def own_point(self) -> int:
        """Where the agent's own point (recurrent states, sliding windows) is kept for its next turn:
        the generation prompt's start where known, else the prompt's end but for its last token (a
        re-rendered reply may tokenize that token, the header's newline say, with its own)."""
        start, end = self.generation_prompt_start, len(self.prompt_tokens) - 1
        return start if 0 < start < end else end


@dataclass(slots=True)
class PromptStarted:
    """Sent when the request joins the batch: how much of the prompt came from cache, when the
    engine got the request (`time.monotonic()`; 0 where unknown) and how long it waited to join."""

    num_prompt_tokens: int
    num_cached_tokens: int
    cache_tier: str
    queued_at: float = 0.0
    waited_s: float = 0.0


@dataclass(slots=True)
class PromptProgress:
    num_processed: int
    num_total: int


@dataclass(slots=True)
class TokenDelta:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens', where the request asks


@dataclass(slots=True)
class Finished:
    reason: FinishReason
    stop_sequence: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    generated_token_ids: list[int] = field(default_factory=list)
    num_drafted_tokens: int = 0  # speculative decoding: drafts verified, and those kept
    num_accepted_tokens: int = 0


Event = PromptStarted | PromptProgress | TokenDelta | Finished | BaseException


class EventChannel:
    """Where the engine posts one request's events; `done` resolves with the last one. With
    `holds_final` a Finished resolves `done` only: the reader's comes from whoever holds it."""

    __slots__ = ("__weakref__", "done", "holds_final", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done: asyncio.Future[Finished | BaseException] = loop.create_future()
        self.holds_final = False

    def put(self, event: Event) -> None:
        if not (self.holds_final and isinstance(event, Finished)):
            self.queue.put_nowait(event)
        if isinstance(event, Finished | BaseException) and not self.done.done():
            self.done.set_result(event)
