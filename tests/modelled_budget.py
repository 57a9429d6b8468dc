"""A prefill budget told a fixed backend's step times instead of the wall clock's, for tests whose
assertions follow the chunks it chooses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from semantic.engine.decoding.batch import Batch
from semantic.engine.scheduling.prefill_budget import PrefillBudget


@dataclass(slots=True)
class ModelledBudget(PrefillBudget):
    """The engine's budget, told the times of a fixed backend instead of the wall clock: a decode
    step takes `DECODE_S` and each prompt token `TOKEN_S` more, so a whole chunk stalls a stream for
    ten decode steps. The chunks it chooses then depend on the tokens alone, not on how busy the
    machine running the test is."""

    DECODE_S: ClassVar[float] = 0.1
    TOKEN_S: ClassVar[float] = 1.0 / 512
    chunks: list[int] = field(default_factory=list)  # each tick's prompt tokens while a stream decoded

    def observe(self, elapsed_s: float, num_decoding: int, num_prompt_tokens: int) -> None:
        if num_decoding and num_prompt_tokens:
            self.chunks.append(num_prompt_tokens)
        modelled_s = (self.DECODE_S if num_decoding else 0.0) + num_prompt_tokens * self.TOKEN_S
        PrefillBudget.observe(self, modelled_s, num_decoding, num_prompt_tokens)

    @classmethod
    def like(cls, budget: PrefillBudget) -> ModelledBudget:
        """One with `budget`'s settings."""
        return cls(budget.max_tokens, budget.stall_ratio, budget.short_turn_tokens)


@contextmanager
def modelled_budget_in(batch: Batch) -> Iterator[ModelledBudget]:
    """`batch` (the engine's `Batch`, between ticks) with a `ModelledBudget` in its budget's
    settings; its own budget is put back afterwards."""
    engine_budget = batch.prefill_budget
    batch.prefill_budget = budget = ModelledBudget.like(engine_budget)
    try:
        yield budget
    finally:
        batch.prefill_budget = engine_budget
