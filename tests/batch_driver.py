"""A real Batch on the real model, driven one step at a time by the test (no engine thread).

Fixtures and helpers shared by the tests that step a batch by hand.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.messages import Event, EventChannel, Finished, GenerationRequest, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    return Outbox(loop)


def load_served(model_dir: Path, outbox: Outbox) -> ServedModel:
    """`model_dir` loaded for a batch stepped by hand (the `served` fixture's, on any model)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the first token is taken early only where MLX runs the step before `next()` returns")
    # Chunks of 128 tokens (short turns up to 256): a prompt needs only a few hundred tokens to be
    # cut into chunks, set aside or overtaken, which keeps these tests' prefills and their mlx-lm
    # references short. The code paths are the ones the CPU's default 512 takes.
    config = EngineConfig(model=str(model_dir), cache_budget_mb=256, prefill_step_size=128)
    return ServedModel.load(config.model, None, config, mx.default_stream(mx.cpu), EngineStats(), outbox)


@pytest.fixture(scope="module")
def served(default_model_dir: Path, outbox: Outbox) -> ServedModel:
    return load_served(default_model_dir, outbox)


def chat(served: ServedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(served.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def deliver(served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop) -> None:
    """One engine tick's work after `step`, then the loop runs what it posted."""
    served.batch.flush()
    served.batch.keep_caches()
    outbox.flush()
    loop.run_until_complete(asyncio.sleep(0))


def submit(
    served: ServedModel,
    loop: asyncio.AbstractEventLoop,
    prompt: list[int],
    max_tokens: int,
    agent_id: str | None = None,
) -> Submit:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
    submit = Submit(GenerationRequest(uuid.uuid4().hex, prompt, sampling, agent_id), EventChannel(loop))
    needed = served.loaded.spec.num_blocks_for(len(prompt) + max_tokens)
    served.batch.insert(submit, served.pool.allocate(needed))
    return submit


def drain(submit: Submit) -> list[Event]:
    """The events delivered to a request so far and not yet read."""
    events = []
    while not submit.events.queue.empty():
        events.append(submit.events.queue.get_nowait())
    return events


def has_token(submit: Submit) -> bool:
    return any(isinstance(e, TokenDelta) for e in drain(submit))


def steps_until_finished(
    served: ServedModel,
    outbox: Outbox,
    loop: asyncio.AbstractEventLoop,
    prompt: list[int],
    max_tokens: int,
    agent_id: str | None = None,
) -> list[list[Event]]:
    """Insert one request, step until it finishes; the events each step delivered."""
    channel = submit(served, loop, prompt, max_tokens, agent_id).events
    per_step: list[list[Event]] = []
    while not any(isinstance(e, Finished) for events in per_step for e in events):
        assert len(per_step) < max_tokens + 4, "the request did not finish"
        served.batch.step()
        deliver(served, outbox, loop)
        delivered = []
        while not channel.queue.empty():
            delivered.append(channel.queue.get_nowait())
        per_step.append(delivered)
    return per_step
