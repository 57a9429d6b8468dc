"""The engine on the real default model: batching oracle, cancellation, sampling, limits; a tiny
model's engine, stopped, refusing asks and submissions."""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import pytest_asyncio

from semantic.actors.engine_client import Engine, EngineConfig, EngineError, PromptTooLongError, RequestStream
from semantic.engine.cache_store.cache_matching import is_anonymous
from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.cpu import cpu_attention
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import (
    Cancel,
    Drain,
    InspectPool,
    ListCaches,
    Message,
    PendingAsk,
    ReferenceGenerate,
    RestoreCache,
    Shutdown,
    Submit,
)
from semantic.engine.loop.leader_loop import unanswered
from semantic.engine.loop.messages import Finished, FinishReason, GenerationRequest, PromptStarted, TokenDelta
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2+2?",
    "Write a haiku about the sea.",
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(default_model_dir: Path) -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model=str(default_model_dir), cache_budget_mb=512))
    await engine.start()
    yield engine
    await engine.stop()


def chat(engine: Engine, text: str) -> list[int]:
    return list(
        engine.model.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    )


def submit(engine: Engine, prompt: list[int], **sampling: object) -> RequestStream:
    return engine.submit(GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(**sampling)))  # type: ignore[arg-type]


async def collect(stream: RequestStream) -> tuple[str, list[int], Finished]:
    text, tokens, finished = [], [], None
    async for event in stream:
        if isinstance(event, TokenDelta):
            text.append(event.text)
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return "".join(text), tokens, finished


async def pool_state(engine: Engine) -> tuple[int, int, int]:
    report = await engine.ask(InspectPool())
    return report.num_free_blocks, report.num_running, report.num_in_batch


async def test_concurrent_requests_match_mlx_lm_generate_alone(engine: Engine) -> None:
    async def staggered(index: int, text: str) -> tuple[str, list[int], Finished]:
        await asyncio.sleep(0.12 * index)  # join the running batch at different ticks
        return await collect(submit(engine, chat(engine, text), max_tokens=24))

    steps_before = engine.stats.num_steps
    results = await asyncio.gather(*(staggered(i, text) for i, text in enumerate(PROMPTS)))
    # Fewer steps than the requests' tokens added up means they decoded together.
    assert engine.stats.num_steps - steps_before < sum(f.num_generated_tokens for _, _, f in results)
    eos = engine.model.eos_token_ids
    for text, (_, tokens, finished) in zip(PROMPTS, results, strict=True):
        expected = await engine.ask(ReferenceGenerate(chat(engine, text), max_tokens=24))
        assert [t for t in tokens if t not in eos] == expected
        assert finished.reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert results[0][0] == "The capital of France is Paris."


async def test_cancelled_stream_frees_its_slot_and_blocks(engine: Engine) -> None:
    free_before, running_before, batch_before = await pool_state(engine)
    stream = submit(engine, chat(engine, "Tell me a long story about a dragon."), max_tokens=200)
    other = submit(engine, chat(engine, "What is 2+2?"), max_tokens=12)
    received = 0
    async for event in stream:
        if isinstance(event, TokenDelta):
            received += 1
            if received == 3:
                break  # leaving the loop cancels the request
    _, _, finished_other = await collect(other)
    assert finished_other.reason in (FinishReason.STOP, FinishReason.LENGTH)

    async def settled() -> bool:
        return (await pool_state(engine))[1] == running_before

    await wait_until_async(settled, "the cancelled request has left the batch")
    free_after, running_after, batch_after = await pool_state(engine)
    assert (running_after, batch_after) == (running_before, batch_before)
    # The finished request kept its agent cache; the cancelled one left nothing behind.
    agents = await engine.ask(ListCaches())
    assert free_after >= free_before - sum(engine.model.spec.num_blocks_for(a.num_tokens) for a in agents)


async def test_stop_string_ends_generation_without_leaking_it(engine: Engine) -> None:
    text, _, finished = await collect(
        submit(engine, chat(engine, "What is the capital of France?"), max_tokens=20, stop=("Paris",))
    )
    assert text == "The capital of France is "
    assert finished.reason is FinishReason.STOP
    assert finished.stop_sequence == "Paris"


async def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = chat(engine, "Write a sentence about cats.")
    first = await collect(submit(engine, prompt, max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7))
    second = await collect(
        submit(engine, prompt, max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    )
    assert first[1] == second[1]


async def test_prompt_longer_than_context_is_refused_with_numbers(engine: Engine) -> None:
    limit = engine.model.context_length
    with pytest.raises(PromptTooLongError, match=f"{limit + 5} tokens.*{limit}"):
        submit(engine, [1] * (limit + 5))


async def test_max_tokens_is_clamped_to_context_keeping_every_other_option(engine: Engine) -> None:
    options: dict[str, object] = dict(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        stop=("\n",),
        seed=3,
        top_logprobs=2,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias=((42, 3.0),),
    )
    stream = submit(engine, chat(engine, "Hi"), max_tokens=10**6, **options)
    sampling = stream.request.sampling
    assert sampling.max_tokens == engine.model.context_length - len(chat(engine, "Hi"))
    assert {name: getattr(sampling, name) for name in options} == options
    stream.cancel()
    async for _ in stream:
        pass


async def test_prompt_started_reports_reuse(engine: Engine) -> None:
    prompt = chat(engine, "Name a fruit.")
    request = GenerationRequest("r1", prompt, SamplingParams(max_tokens=8), agent_id="fruit")
    _, tokens, _ = await collect(engine.submit(request))
    follow_up = [*prompt, *tokens, *engine.model.tokenizer.encode("\n<|im_start|>user\nAnother?<|im_end|>\n")]
    started = None
    async for event in engine.submit(
        GenerationRequest("r2", follow_up, SamplingParams(max_tokens=4), agent_id="fruit")
    ):
        if isinstance(event, PromptStarted):
            started = event
    assert started is not None
    assert started.num_cached_tokens == len(prompt) + len(tokens)


async def test_drain_waits_for_the_batch_then_fails_what_outlives_its_timeout(engine: Engine) -> None:
    quick = submit(engine, chat(engine, PROMPTS[2]), temperature=0.0, max_tokens=4)
    assert await engine.ask(Drain(60, "a test drain")) == 0  # waits for `quick` rather than failing it
    assert quick.done.done() and isinstance(quick.done.result(), Finished)

    before = await pool_state(engine)

    slow = submit(engine, chat(engine, PROMPTS[3]), temperature=0.0, max_tokens=400)
    waiting = submit(engine, chat(engine, PROMPTS[0]), temperature=0.0, max_tokens=400)
    assert await engine.ask(Drain(0.3, "a test drain")) in (1, 2)
    for stream in (slow, waiting):
        with pytest.raises(Exception, match="cancelled: a test drain, and the drain timeout passed"):
            await collect(stream)
    assert await pool_state(engine) == before


async def test_a_request_tokenized_for_another_model_is_refused(engine: Engine) -> None:
    from semantic.actors.engine_client import ModelChangedError

    request = GenerationRequest(
        "x", chat(engine, "hi"), SamplingParams(max_tokens=2), model_fingerprint="other"
    )
    with pytest.raises(ModelChangedError):
        engine.submit(request)


async def started_order(streams: dict[str, RequestStream]) -> tuple[list[str], dict[str, PromptStarted]]:
    """Names in the order their prompts were admitted, and each one's PromptStarted."""
    order: list[str] = []
    started: dict[str, PromptStarted] = {}

    async def read(name: str, stream: RequestStream) -> None:
        async for event in stream:
            if isinstance(event, PromptStarted):
                order.append(name)
                started[name] = event

    await asyncio.gather(*(read(name, stream) for name, stream in streams.items()))
    return order, started


async def test_waiting_prompts_start_with_the_fewest_tokens_to_prefill(engine: Engine) -> None:
    first = chat(engine, "Name a planet.")
    request = GenerationRequest("p1", first, SamplingParams(max_tokens=6), agent_id="returning")
    _, tokens, _ = await collect(engine.submit(request))
    follow_up = [*first, *tokens, *engine.model.tokenizer.encode("\n<|im_start|>user\nAnother?<|im_end|>\n")]
    prompts = {
        "long cold": chat(engine, "Summarise: " + "alpha beta " * 300),
        "short cold": chat(engine, "Summarise: " + "gamma " * 60),
    }
    # The others queue while the blocker prefills (submitted once it has started: sent with it, the
    # blocker could meet them in one tick and be ordered among them); they were submitted longest first.
    blocker = submit(engine, chat(engine, "Summarise: " + "zeta eta " * 300), max_tokens=2)
    blocker_started = asyncio.Event()

    async def read_blocker() -> None:
        async for event in blocker:
            if isinstance(event, PromptStarted):
                blocker_started.set()

    reading_blocker = asyncio.create_task(read_blocker())
    await blocker_started.wait()
    config = engine.config  # no wait limit: on a loaded machine one prefill step can outlast it
    engine.config = replace(config, shortest_first_max_wait_s=float("inf"))
    try:
        streams = {name: submit(engine, prompt, max_tokens=2) for name, prompt in prompts.items()}
        streams["returning"] = engine.submit(
            GenerationRequest("p2", follow_up, SamplingParams(max_tokens=2), agent_id="returning")
        )
        order, started = await started_order(streams)
        await reading_blocker
    finally:
        engine.config = config
    assert [name for name in order if name != "blocker"] == ["returning", "short cold", "long cold"]
    assert started["returning"].num_cached_tokens == len(first) + len(tokens)


async def test_a_request_waiting_past_the_limit_goes_in_arrival_order(engine: Engine) -> None:
    prompts = {
        "blocker": chat(engine, "Summarise: " + "theta iota " * 300),
        "long": chat(engine, "Summarise: " + "delta " * 300),
        "short": chat(engine, "Hi"),
    }
    config = engine.config
    engine.config = replace(config, shortest_first_max_wait_s=0.0)
    try:
        order, _ = await started_order({name: submit(engine, p, max_tokens=2) for name, p in prompts.items()})
    finally:
        engine.config = config
    assert [name for name in order if name != "blocker"] == ["long", "short"]


async def test_agents_arriving_together_with_one_system_prompt_prefill_it_once(engine: Engine) -> None:
    block_size = engine.model.spec.block_size
    system = "You are agent support. Follow the handbook. " * 70  # ~700 tokens: two full blocks

    def prompt(agent: int) -> list[int]:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"I am agent {agent}."},
        ]
        return list(engine.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    streams = {
        f"agent-{i}": engine.submit(
            GenerationRequest(f"s{i}", prompt(i), SamplingParams(max_tokens=3), agent_id=f"together-{i}")
        )
        for i in range(3)
    }
    order, started = await started_order(streams)
    assert started[order[0]].num_cached_tokens == 0
    for name in order[1:]:
        # The first prompt's blocks were shared when its prefill ended, before its reply did.
        assert started[name].num_cached_tokens >= 2 * block_size
    free, running, batch = await pool_state(engine)
    assert (running, batch) == (0, 0)
    report = await engine.ask(InspectPool())
    # Every referenced block is referenced by exactly the agents that hold it: nothing leaked.
    held: dict[int, int] = {}
    for block_ids in report.agent_id_to_block_ids.values():
        for block_id in block_ids:
            held[block_id] = held.get(block_id, 0) + 1
    assert report.ref_counts == sorted(held.values())
    assert free == report.num_blocks - len(held)


async def test_prefill_on_the_engine_thread_goes_through_the_cpu_attention(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU attention is installed only when models run on the CPU")
    threads: list[str] = []
    attention = cpu_attention.attention

    def counted(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return attention(*args)

    monkeypatch.setattr(cpu_attention, "attention", counted)
    await collect(submit(engine, chat(engine, f"Name a color. {uuid.uuid4().hex}"), max_tokens=2))
    assert threads and set(threads) == {"semantic-engine"}


async def test_requests_without_an_agent_id_get_ids_no_client_can_send(engine: Engine) -> None:
    prompt = chat(engine, f"Say yes. {uuid.uuid4().hex}")
    await collect(submit(engine, prompt, max_tokens=2))
    anonymous = [a.agent_id for a in await engine.ask(ListCaches()) if is_anonymous(a.agent_id)]
    assert anonymous and all(a.startswith("#anon-") for a in anonymous)
    assert not is_anonymous("anon-3")  # a client's id, flushed and persisted like any other


async def test_asks_and_submissions_fail_once_the_engine_stopped(tiny_llama_dir: Path) -> None:
    # An engine of its own, to stop: what is under test is the stopped engine, not its model.
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=64))
    await engine.start()
    assert await engine.ask(ListCaches()) == []
    prompt = chat(engine, "Hi")
    await engine.stop()
    with pytest.raises(EngineError, match="not running"):
        await engine.ask(ListCaches())
    with pytest.raises(EngineError, match="stopped"):
        submit(engine, prompt)


async def test_a_tick_keeps_no_answered_ask_so_a_restored_cache_is_freed_before_its_turn() -> None:
    loop = asyncio.get_running_loop()
    tensors = {"tokens": np.arange(4, dtype=np.int32), "full.0.keys": np.zeros((1, 1, 4, 2), np.float32)}
    held = weakref.ref(tensors["full.0.keys"])
    restore = PendingAsk(RestoreCache(SerializedCache("a", tensors, [], 4), "fp"), loop.create_future(), loop)
    drain = PendingAsk(Drain(1.0, "test"), loop.create_future(), loop)
    submit_ = Submit(GenerationRequest("r", [1, 2], SamplingParams()), events=None)  # type: ignore[arg-type]
    cancel, shutdown = Cancel("r"), Shutdown()
    messages: list[Message] = [restore, submit_, drain, cancel, shutdown]
    # What the tick goes on with once its asks are answered: the drain waits for its answer still.
    assert unanswered(messages) == [submit_, drain, cancel, shutdown]
    messages = unanswered(messages)
    del restore, tensors
    assert held() is None  # the file's arrays are gone before the tick admits the turn
