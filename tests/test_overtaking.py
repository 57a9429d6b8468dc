"""A short turn overtakes a long prompt part-way through its prefill, and the long one loses nothing.

The scheduler sets the lone long prompt aside (its cache so far read as views), admits the short
turn, and inserts the long one again behind it, to carry on from its cache. Driven step by step on
the real model: every reply equals mlx-lm's own greedy output and no prompt token is run twice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig
from semantic.engine.loop.messages import (
    EventChannel,
    Finished,
    GenerationRequest,
    PromptProgress,
    PromptStarted,
    TokenDelta,
)
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.mlx_adapter import generator_seams
from semantic.engine.mlx_adapter.last_token_fold import FoldingBatchGenerator
from semantic.engine.scheduling.scheduler import Scheduler
from tests.batch_driver import chat, deliver, drain, loop, outbox, served

__all__ = ["loop", "outbox", "served"]  # fixtures


def queued(loop: asyncio.AbstractEventLoop, prompt: list[int], max_tokens: int, queued_at: float) -> Submit:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    request = GenerationRequest(uuid.uuid4().hex, prompt, sampling, f"agent-{uuid.uuid4().hex}")
    return Submit(request, EventChannel(loop), queued_at)


class Driver:
    """Admit and step as the engine's tick does, recording what each request received per step."""

    def __init__(
        self, served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, config: EngineConfig
    ):
        self.served, self.outbox, self.loop, self.config = served, outbox, loop, config
        self.scheduler = Scheduler()
        self.events: dict[str, list[tuple[int, object]]] = {}
        self.step = 0

    def add(self, submit: Submit) -> None:
        self.scheduler.add(submit)
        self.events[submit.request.request_id] = []

    def tick(self, now: float) -> None:
        self.scheduler.plan_and_apply(self.served, self.config, self.outbox, now)
        self.served.batch.step()
        deliver(self.served, self.outbox, self.loop)
        self.step += 1

    def collect(self, *submits: Submit) -> None:
        for submit in submits:
            self.events[submit.request.request_id] += [(self.step, e) for e in drain(submit)]

    def first_token_step(self, submit: Submit) -> int | None:
        steps = [s for s, e in self.events[submit.request.request_id] if isinstance(e, TokenDelta)]
        return min(steps, default=None)

    def num_cached(self, submit: Submit) -> int:
        (started,) = [e for _, e in self.events[submit.request.request_id] if isinstance(e, PromptStarted)]
        return started.num_cached_tokens

    def finished(self, *submits: Submit) -> bool:
        return all(
            any(isinstance(e, Finished) for _, e in self.events[s.request.request_id]) for s in submits
        )

    def tokens(self, submit: Submit) -> list[int]:
        (finished,) = [e for _, e in self.events[submit.request.request_id] if isinstance(e, Finished)]
        return [t for t in finished.generated_token_ids if t not in self.served.loaded.eos_token_ids]


def served_config(served: ServedModel) -> EngineConfig:
    """The scheduler's settings as the batch was built with them (its chunk, its short turns)."""
    budget = served.batch.prefill_budget
    return replace(
        EngineConfig(), prefill_step_size=budget.max_tokens, short_turn_tokens=budget.short_turn_tokens
    )


def test_a_short_turn_overtakes_a_long_prefill_which_then_carries_on_from_its_cache(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    config = served_config(served)
    chunk = config.num_tokens_per_prefill_step
    long = chat(served, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 70)
    short = chat(served, f"{uuid.uuid4().hex} Name three colours.")
    assert len(long) > chunk + config.num_short_turn_tokens and len(short) <= chunk
    driver = Driver(served, outbox, loop, config)
    now = time.monotonic()
    long_submit, short_submit = queued(loop, long, 4, now), queued(loop, short, 4, now)
    processed_before = generator_seams.num_prompt_tokens_processed(served.batch._generator)

    driver.add(long_submit)
    driver.tick(now)  # the long prompt goes in and prefills its first chunk
    driver.collect(long_submit)
    assert any(isinstance(e, PromptProgress) for _, e in driver.events[long_submit.request.request_id])
    driver.add(short_submit)
    while not driver.finished(long_submit, short_submit):
        assert driver.step < 100, "the requests did not finish"
        driver.tick(now)
        driver.collect(long_submit, short_submit)

    short_first, long_first = driver.first_token_step(short_submit), driver.first_token_step(long_submit)
    assert short_first is not None and long_first is not None
    assert short_first < long_first  # it did not wait for the rest of the long prompt
    assert short_first <= 3  # set aside at once: one step prefills the turn whole, the next samples
    assert driver.tokens(long_submit) == served.reference_generate(long, 4)
    assert driver.tokens(short_submit) == served.reference_generate(short, 4)
    # Each prompt token ran once: the long prompt went on from its cache, not from the start. mlx-lm
    # runs a prompt's last token as its first decode step, not counted; the fold prefills it, counted.
    held_back = 0 if isinstance(served.batch._generator, FoldingBatchGenerator) else 1
    uncached_long = len(long) - driver.num_cached(long_submit)
    uncached_short = len(short) - driver.num_cached(short_submit)
    processed = generator_seams.num_prompt_tokens_processed(served.batch._generator) - processed_before
    assert processed == uncached_long - held_back + uncached_short - held_back
    progress = [e for _, e in driver.events[long_submit.request.request_id] if isinstance(e, PromptProgress)]
    done = [p.num_processed for p in progress]
    assert done == sorted(done) and {p.num_total for p in progress} == {uncached_long}  # one count throughout


def test_a_long_prefill_that_has_waited_too_long_is_not_overtaken(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    config = served_config(served)
    long = chat(served, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 70)
    short = chat(served, f"{uuid.uuid4().hex} Name three colours.")
    driver = Driver(served, outbox, loop, config)
    now = time.monotonic()
    long_submit = queued(loop, long, 2, now - config.shortest_first_max_wait_s)  # overdue
    short_submit = queued(loop, short, 2, now)
    driver.add(long_submit)
    driver.tick(now)
    driver.add(short_submit)
    while not driver.finished(short_submit):
        assert driver.step < 100, "the requests did not finish"
        driver.tick(now)
        driver.collect(long_submit, short_submit)
    long_first, short_first = driver.first_token_step(long_submit), driver.first_token_step(short_submit)
    assert long_first is not None and short_first is not None and long_first < short_first
