"""When running sequences hold the KV pool, a returning agent whose cache is on disk is served
from its conversation instead: its file is kept (not quarantined as if damaged), its reply is the
cold reply, and no block is left held by nobody. A request whose blocks nothing running can free
fails at once instead of waiting for ever.

The tiny random-weight Llama serves, whose words do not matter here: replies are compared with its own
cold replies, and the pool is sized in its blocks."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool, Submit
from semantic.engine.loop.errors import EngineError
from semantic.engine.loop.messages import EventChannel, GenerationRequest
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.scheduling.scheduler import Scheduler
from semantic.storage.agent_id import AgentId
from tests.batch_driver import chat, drain, load_served, loop, outbox, submit
from tests.test_agents import cold_output, generate, run_turn, user_turn, without_eos

__all__ = ["loop", "outbox"]  # fixtures

# 5 blocks of 256 tokens: the tiny Llama's block is 0.5625 MiB (3 layers, keys and values, 6 heads of
# 16 float32s, 256 tokens).
POOL_MB = 3


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, outbox: Outbox) -> ServedModel:
    """`tests.batch_driver`'s batch stepped by hand, on the tiny Llama."""
    return load_served(tiny_llama_dir, outbox)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[AgentSystem]:
    config = SystemConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=POOL_MB),
        cache_dir=tmp_path_factory.mktemp("cache"),
    )
    system = AgentSystem(config)
    await system.start()
    yield system
    await system.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_cache_with_no_room_to_restore_is_kept_and_the_turn_computed(system: AgentSystem) -> None:
    pool = await system.engine.ask(InspectPool())
    block_size = system.engine.model.spec.block_size
    assert pool.num_blocks >= 3
    returning = AgentId("returning")
    prompt = user_turn(system, "tell me more " * 100, first=True)  # two blocks or more
    assert len(prompt) > block_size
    first, _, _ = await run_turn(await generate(system, returning, prompt, SamplingParams(max_tokens=4)))
    assert await system.evict(returning)
    persistence = system.models.persistence
    assert persistence is not None and persistence.path_for(returning).exists()

    # Another agent's long reply reserves all blocks but one for as long as it decodes.
    eos = system.engine.model.eos_token_ids
    hog_prompt = user_turn(system, "Count to a thousand.", first=True)
    hog_tokens = (pool.num_blocks - 1) * block_size - len(hog_prompt) - 1
    no_end = tuple((token, -100.0) for token in eos)
    hog = await generate(
        system, AgentId("hog"), hog_prompt, SamplingParams(max_tokens=hog_tokens, logit_bias=no_end)
    )
    hog_events = aiter(hog)
    while (await anext(hog_events)).__class__.__name__ != "TokenDelta":
        pass  # the hog is decoding: its blocks are reserved
    follow_up = prompt + first + user_turn(system, "And then?", first=False)
    turn = asyncio.ensure_future(
        run_turn(await generate(system, returning, follow_up, SamplingParams(max_tokens=6)))
    )
    while system.engine.stats.num_waiting == 0:  # the turn, its restore tried, waits for blocks
        await asyncio.sleep(0.05)
    hog.cancel()
    async for _ in hog_events:
        pass
    tokens, started, _ = await turn

    assert started.cache_tier != "disk"
    assert persistence.path_for(returning).exists()
    assert not any(p.name.startswith("returning") for p in persistence.quarantine_dir.glob("*"))
    assert without_eos(system, tokens) == await cold_output(system, follow_up, 6)
    report = await system.engine.ask(InspectPool())
    held = Counter(block for blocks in report.agent_id_to_block_ids.values() for block in blocks)
    assert report.num_running == 0
    assert sorted(held.values()) == report.ref_counts  # every reference is an agent's


def test_a_request_no_running_sequence_can_make_room_for_fails_instead_of_waiting(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, tiny_llama_dir: Path
) -> None:
    pool = served.pool
    config = EngineConfig(model=str(tiny_llama_dir))
    lost = pool.allocate(pool.num_free_blocks - 1)  # held by nobody, as a leaked block would be
    prompt = chat(served, "Hello")
    sampling = SamplingParams(max_tokens=2 * served.loaded.spec.block_size, temperature=0)
    waiting = Submit(GenerationRequest("too-big", prompt, sampling, None), EventChannel(loop))
    scheduler = Scheduler()
    try:
        running = submit(served, loop, prompt, 1)  # it holds the last block until it ends
        scheduler.add(waiting)
        scheduler.plan_and_apply(served, config, outbox)
        assert len(scheduler) == 1  # the running sequence will free its block: wait

        served.batch.cancel(running.request.request_id)
        scheduler.plan_and_apply(served, config, outbox)
        outbox.flush()
        loop.run_until_complete(asyncio.sleep(0))

        assert len(scheduler) == 0
        (error,) = [e for e in drain(waiting) if isinstance(e, Exception)]
        assert isinstance(error, EngineError) and "nothing running to free more" in str(error)
    finally:
        pool.free(lost)


@pytest.mark.asyncio(loop_scope="module")
async def test_idle_caches_are_evicted_to_restore_a_cache_from_disk(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The pool is full of idle caches when an agent whose cache is on disk returns: the engine
    evicts the least recently used of them (the store never evicts on its own) and the turn
    resumes from disk with the cold reply."""
    config = SystemConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=POOL_MB),
        cache_dir=tmp_path_factory.mktemp("cache"),
    )
    system = AgentSystem(config)
    await system.start()
    try:
        block_size = system.engine.model.spec.block_size
        persistence = system.models.persistence
        assert persistence is not None
        sampling = SamplingParams(max_tokens=4)
        # Two blocks for the returning agent; three and two for the idle ones, which fill the pool of
        # five, so none of the returning agent's freed blocks is left in it.
        sizes = {"returning": ("tell me more", 100, 2), "older": ("red green blue", 200, 3)}
        sizes["newer"] = ("one two three", 100, 2)
        prompts = {
            name: user_turn(system, f"{topic} " * repeats, first=True)
            for name, (topic, repeats, _) in sizes.items()
        }
        for name, (_, _, num_blocks) in sizes.items():
            assert (num_blocks - 1) * block_size < len(prompts[name]) < num_blocks * block_size - 16
        first, _, _ = await run_turn(
            await generate(system, AgentId("returning"), prompts["returning"], sampling)
        )
        assert await system.evict(AgentId("returning"))
        for name in ("older", "newer"):  # the pool is full
            await run_turn(await generate(system, AgentId(name), prompts[name], sampling))
        report = await system.engine.ask(InspectPool())
        assert report.num_blocks == sizes["older"][2] + sizes["newer"][2]
        assert report.num_blocks - len(set().union(*report.agent_id_to_block_ids.values())) < 2

        follow_up = prompts["returning"] + first + user_turn(system, "And then?", first=False)
        tokens, started, _ = await run_turn(
            await generate(system, AgentId("returning"), follow_up, SamplingParams(max_tokens=6))
        )

        assert started.cache_tier == "disk"
        report = await system.engine.ask(InspectPool())
        assert not any("older" in agent for agent in report.agent_id_to_block_ids)
        assert without_eos(system, tokens) == await cold_output(system, follow_up, 6)
    finally:
        await system.stop()
