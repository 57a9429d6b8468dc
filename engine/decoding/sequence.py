"""A running sequence's state in the batch, and a finished one's cache waiting to be kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semantic.engine.cache_store.agent_cache import Checkpoint
from semantic.engine.cache_store.cache_tensors import StatePoint
from semantic.engine.decoding.text_stream import TextStream
from semantic.engine.decoding.token_logprobs import TokenLogprob, TokenTexts, token_logprob
from semantic.engine.loop.messages import (
    Event,
    EventChannel,
    Finished,
    FinishReason,
    GenerationRequest,
    PromptProgress,
    TokenDelta,
)


@dataclass(slots=True)
class Sequence:
    request: GenerationRequest
    events: EventChannel
    agent_id: str
    text: TextStream
    reserved_block_ids: list[int]
    num_cached_tokens: int
    generated_token_ids: list[int] = field(default_factory=list)
    outbox: list[Event] = field(default_factory=list)  # this tick's events, posted at its end
    published_block_ids: list[int] = field(default_factory=list)  # its prompt's blocks, shared early
    early_token: int | None = None  # its first token, taken before the generator returns it
    is_prefilling: bool = True  # until the generator has run its whole prompt
    queued_at: float = 0.0  # when its request was queued (monotonic; in a group, rank 0's clock)
    sampler: Any = None  # what it was inserted with, to insert it again after it was set aside
    logits_processors: list[Any] = field(default_factory=list)
    num_left_to_prefill: int | None = None  # by the generator's last progress report (None: none yet)
    prefill_offset: int = 0  # uncached prompt tokens already prefilled when it was last inserted
    # Where its prefill stops to keep what resuming there takes for other agents (segment ends: a
    # recurrent model's state, a sliding one's windows), what was kept there (`Checkpoint`s, shared
    # once its blocks are), and the agent's own point (`GenerationRequest.own_point`).
    state_checkpoints: list[int] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    prompt_state: StatePoint | None = None
    num_drafted_tokens: int = 0  # speculative decoding's drafts verified for it, and those kept
    num_accepted_tokens: int = 0

    @property
    def num_prefilled(self) -> int:
        """Prompt tokens in its cache by the generator's last progress report."""
        if self.num_left_to_prefill is None:
            return self.num_cached_tokens
        return len(self.request.prompt_tokens) - self.num_left_to_prefill

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.request.prompt_tokens) - self.num_cached_tokens

    def prefilled(self, done: int, total: int) -> None:
        """The generator's progress report on this prompt (`done` of `total` since it was inserted)."""
        self.num_left_to_prefill = total - done
        self.outbox.append(PromptProgress(done + self.prefill_offset, total + self.prefill_offset))

    def take_token(self, token: int, logprobs: Any = None, texts: TokenTexts | None = None) -> None:
        """Take the next token; with the step's log-probabilities (and the tokens' texts), its entry
        where the request asks (an end token, which is not part of the reply's text, has none)."""
        self.generated_token_ids.append(token)
        num_top = self.request.sampling.top_logprobs
        entries: list[TokenLogprob] = []
        if (
            num_top is not None
            and logprobs is not None
            and texts is not None
            and not self.text.is_end_token(token)
        ):
            entries.append(token_logprob(logprobs, token, num_top, texts))
        self.outbox.append(TokenDelta([token], self.text.add_token(token), entries))

    def end_reason(self) -> FinishReason | None:
        """Why the sequence ends with the token it just took, if it does."""
        if self.text.stop_hit is not None or self.text.is_end_token(self.generated_token_ids[-1]):
            return FinishReason.STOP
        if len(self.generated_token_ids) >= self.request.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        """Queue its last events: the text held back for stop strings (unless cancelled), then the end."""
        tail = self.text.finish() if reason is not FinishReason.CANCELLED else ""
        if tail:
            self.outbox.append(TokenDelta([], tail))
        self.outbox.append(
            Finished(
                reason,
                self.text.stop_hit,
                len(self.request.prompt_tokens),
                self.num_cached_tokens,
                len(self.generated_token_ids),
                self.generated_token_ids,
                self.num_drafted_tokens,
                self.num_accepted_tokens,
            )
        )


@dataclass(slots=True)
class SetAside:
    """A prompt taken out of the generator part-way through its prefill, with the cache it has so far
    (views into the generator's arrays), to be inserted again behind a shorter turn."""

    sequence: Sequence
    layer_caches: list[Any]


@dataclass(slots=True)
class FinishedCache:
    """A sequence that ended this tick with its cache (layer caches and their tokens), to keep."""

    sequence: Sequence
    layer_caches: list[Any]
    token_ids: list[int]
