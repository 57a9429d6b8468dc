"""A running sequence's state in the batch, and a finished one's cache waiting to be kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semantic.engine.messages import Event, EventChannel, GenerationRequest
from semantic.engine.text_stream import TextStream


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

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.request.prompt_tokens) - self.num_cached_tokens


@dataclass(slots=True)
class FinishedCache:
    """A sequence that ended this tick with its cache (layer caches and their tokens), to keep."""

    sequence: Sequence
    layer_caches: list[Any]
    token_ids: list[int]
