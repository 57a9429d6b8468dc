"""A sequence's first token leaves the engine in the step that computes it, and exactly once.

mlx-lm returns each token one step after computing it; on the CPU that step has already run when
`next()` returns, so the batch takes the first token early. Driven step by step on the real model.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from semantic.engine.commands import Submit
from semantic.engine.config import EngineConfig, EngineStats
from semantic.engine.messages import Event, EventChannel, Finished, GenerationRequest, TokenDelta
from semantic.engine.outbox import Outbox
from semantic.engine.runtime import Runtime
from semantic.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    return Outbox(loop)


@pytest.fixture(scope="module")
def runtime(default_model_dir: Path, outbox: Outbox) -> Runtime:
    if mx.default_device() != mx.cpu:
        pytest.skip("the first token is taken early only where MLX runs the step before `next()` returns")
    config = EngineConfig(model=str(default_model_dir), cache_budget_mb=256)
    return Runtime.load(config.model, None, config, mx.default_stream(mx.cpu), EngineStats(), outbox)


def chat(runtime: Runtime, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(runtime.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def deliver(runtime: Runtime, outbox: Outbox, loop: asyncio.AbstractEventLoop) -> None:
    """One engine tick's work after `step`, then the loop runs what it posted."""
    runtime.batch.flush()
    runtime.batch.keep_caches()
    outbox.flush()
    loop.run_until_complete(asyncio.sleep(0))


def submit(runtime: Runtime, loop: asyncio.AbstractEventLoop, prompt: list[int], max_tokens: int) -> Submit:
    submit = Submit(
        GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=max_tokens, temperature=0)),
        EventChannel(loop),
    )
    needed = runtime.loaded.spec.num_blocks_for(len(prompt) + max_tokens)
    runtime.batch.insert(submit, runtime.pool.allocate(needed))
    return submit


def has_token(submit: Submit) -> bool:
    events = []
    while not submit.events.queue.empty():
        events.append(submit.events.queue.get_nowait())
    return any(isinstance(e, TokenDelta) for e in events)


def steps_until_finished(
    runtime: Runtime, outbox: Outbox, loop: asyncio.AbstractEventLoop, prompt: list[int], max_tokens: int
) -> list[list[Event]]:
    """Insert one request, step until it finishes; the events each step delivered."""
    channel = EventChannel(loop)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    request = GenerationRequest(uuid.uuid4().hex, prompt, sampling)
    needed = runtime.loaded.spec.num_blocks_for(len(prompt) + max_tokens)
    runtime.batch.insert(Submit(request, channel), runtime.pool.allocate(needed))
    per_step: list[list[Event]] = []
    while not any(isinstance(e, Finished) for events in per_step for e in events):
        assert len(per_step) < max_tokens + 4, "the request did not finish"
        runtime.batch.step()
        runtime.batch.flush()
        runtime.batch.keep_caches()
        outbox.flush()
        loop.run_until_complete(asyncio.sleep(0))  # deliver what the step posted
        delivered = []
        while not channel.queue.empty():
            delivered.append(channel.queue.get_nowait())
        per_step.append(delivered)
    return per_step


def test_the_first_token_is_posted_in_the_step_that_runs_the_last_prompt_token(
    runtime: Runtime, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = chat(runtime, "Name a fruit.")
    per_step = steps_until_finished(runtime, outbox, loop, prompt, 6)
    first = next(i for i, events in enumerate(per_step) if any(isinstance(e, TokenDelta) for e in events))
    # Step 0 prefills all but the last prompt token; step 1 runs that token and samples the first.
    assert first == 1
    tokens = [t for events in per_step for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    finished = [e for events in per_step for e in events if isinstance(e, Finished)]
    assert finished[0].generated_token_ids == tokens  # each token posted once, none missing
    eos = runtime.loaded.eos_token_ids
    assert [t for t in tokens if t not in eos] == runtime.reference_generate(prompt, 6)


def test_a_reply_of_one_token_is_posted_once_and_then_finishes(
    runtime: Runtime, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = chat(runtime, "Say hi.")
    per_step = steps_until_finished(runtime, outbox, loop, prompt, 1)
    tokens = [t for events in per_step for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert len(tokens) == 1
    # Its reservation went back to the pool once its cache was kept: only cached agents hold blocks.
    held = {b for agent in runtime.store.agents.values() for b in agent.block_ids}
    assert runtime.pool.num_used_blocks == len(held)


def test_a_short_turn_goes_in_whole_while_a_stream_decodes_and_a_long_prompt_in_chunks(
    runtime: Runtime, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    assert runtime.batch.prefill_budget.stall_ratio > 0  # the default
    counting = list(runtime.loaded.tokenizer.encode(", ".join(str(i) for i in range(1, 21)) + ","))
    runner = submit(runtime, loop, counting, 600)
    while not has_token(runner):
        runtime.batch.step()
        deliver(runtime, outbox, loop)

    def steps_to_first_token(prompt: list[int]) -> int:
        turn = submit(runtime, loop, prompt, 2)
        for steps in range(1, 200):
            runtime.batch.step()
            deliver(runtime, outbox, loop)
            if has_token(turn):
                return steps
        raise AssertionError("no first token")

    short = chat(runtime, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 60)
    long = chat(runtime, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 250)
    chunk = runtime.batch.prefill_budget.max_tokens
    assert len(short) <= chunk < len(long)
    assert steps_to_first_token(short) == 2  # one step prefills it whole, the next samples
    assert steps_to_first_token(long) > 2 * math.ceil(len(long) / chunk)  # small chunks
    runtime.batch.cancel(runner.request.request_id)
    deliver(runtime, outbox, loop)
