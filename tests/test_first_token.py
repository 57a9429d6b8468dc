"""A sequence's first token leaves the engine in the step that computes it, and exactly once.

mlx-lm returns each token one step after computing it; on the CPU that step has already run when
`next()` returns, so the batch takes the first token early. Driven step by step on the real model.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator

import pytest

from semantic.engine.loop.messages import Finished, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.mlx_adapter.last_token_fold import FoldingBatchGenerator
from tests.batch_driver import chat, deliver, has_token, loop, outbox, served, steps_until_finished, submit
from tests.modelled_budget import ModelledBudget, modelled_budget_in

__all__ = ["loop", "outbox", "served"]  # fixtures


def folds(served: ServedModel) -> bool:
    return isinstance(served.batch._generator, FoldingBatchGenerator)


def test_the_first_token_is_posted_in_the_step_that_runs_the_last_prompt_token(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = chat(served, "Name a fruit.")
    per_step = steps_until_finished(served, outbox, loop, prompt, 6)
    first = next(i for i, events in enumerate(per_step) if any(isinstance(e, TokenDelta) for e in events))
    # Folded (last_token_fold.py), step 0 prefills the whole prompt and samples the first token;
    # in mlx-lm's own way, step 0 prefills all but the last prompt token and step 1 runs it.
    assert first == (0 if folds(served) else 1)
    tokens = [t for events in per_step for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    finished = [e for events in per_step for e in events if isinstance(e, Finished)]
    assert finished[0].generated_token_ids == tokens  # each token posted once, none missing
    eos = served.loaded.eos_token_ids
    assert [t for t in tokens if t not in eos] == served.reference_generate(prompt, 6)


def test_a_reply_of_one_token_is_posted_once_and_then_finishes(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = chat(served, "Say hi.")
    per_step = steps_until_finished(served, outbox, loop, prompt, 1)
    tokens = [t for events in per_step for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert len(tokens) == 1
    # Its reservation went back to the pool once its cache was kept: only cached agents hold blocks.
    held = {b for agent in served.store.agents.values() for b in agent.block_ids}
    assert served.pool.num_used_blocks == len(held)


@pytest.fixture
def modelled_budget(served: ServedModel) -> Iterator[ModelledBudget]:
    """The served's batch with a `ModelledBudget` in its engine budget's settings, for one test."""
    with modelled_budget_in(served.batch) as budget:
        yield budget


def test_a_short_turn_goes_in_whole_while_a_stream_decodes_and_a_long_prompt_in_chunks(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, modelled_budget: ModelledBudget
) -> None:
    budget = modelled_budget
    assert budget.stall_ratio > 0  # the default

    def tick() -> None:
        served.batch.step()
        deliver(served, outbox, loop)

    counting = list(served.loaded.tokenizer.encode(", ".join(str(i) for i in range(1, 21)) + ","))
    runner = submit(served, loop, counting, 600)
    while not has_token(runner):
        tick()
    for _ in range(3):  # it decodes alone for a while: the budget learns its step's time
        tick()

    def steps_to_first_token(prompt: list[int]) -> int:
        turn = submit(served, loop, prompt, 2)
        for steps in range(1, 200):
            tick()
            if has_token(turn):
                return steps
        raise AssertionError("no first token")

    short = chat(served, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 9)
    long = chat(served, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 60)
    chunk = budget.max_tokens
    assert len(short) <= chunk and budget.short_turn_tokens < len(long)
    # One step prefills it whole and (folded) samples, or the next one samples.
    del budget.chunks[:]
    assert steps_to_first_token(short) == (1 if folds(served) else 2)
    assert len(budget.chunks) == 1  # one stall, however long
    del budget.chunks[:]
    assert steps_to_first_token(long) > 2 * math.ceil(len(long) / chunk)  # small chunks
    # A whole chunk would stall the stream for 2.5 decode steps (ModelledBudget); each kept it near one.
    allowed = budget.stall_ratio * ModelledBudget.DECODE_S / ModelledBudget.TOKEN_S
    assert budget.chunks and max(budget.chunks) <= 1.5 * allowed
    served.batch.cancel(runner.request.request_id)
    deliver(served, outbox, loop)
