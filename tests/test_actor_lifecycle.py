"""Agent actors live while they have work: ids clients invent do not pile up as idle actors."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from semantic import AgentSystem, EngineConfig, SamplingParams, SystemConfig, TurnRequest
from semantic.engine.loop.errors import LibraryPanic
from semantic.storage.agent_id import AgentId
from tests.waiting import wait_until_async

NUM_ONE_OFF_IDS = 20_000


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def touch_many(system: AgentSystem, prefix: str, count: int) -> None:
    """Each id gets its own actor (an eviction ask: nothing in memory, so nothing written)."""
    for start in range(0, count, 500):
        ids = [AgentId(f"{prefix}-{i}") for i in range(start, min(start + 500, count))]
        assert not any(await asyncio.gather(*(system.evict(agent_id) for agent_id in ids)))


async def wait_for_reaping(system: AgentSystem) -> None:
    async def reaped() -> bool:
        return system.num_live_actors == 0

    await wait_until_async(reaped, "every idle actor has stopped")


@pytest.mark.slow  # a soak of 22,000 actors; the anonymous request below is reaped in the default suite
async def test_20000_one_off_agent_ids_leave_no_actors_and_no_memory_behind(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    config = SystemConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=256),
        cache_dir=tmp_path,
        actor_idle_s=0.2,
    )
    async with AgentSystem(config) as system:
        await touch_many(system, "warm-up", 2_000)  # allocator and caches reach their working size
        await wait_for_reaping(system)
        gc.collect()
        baseline = rss_bytes()

        peak = 0

        async def watch_peak() -> None:
            nonlocal peak
            while True:
                peak = max(peak, system.num_live_actors)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch_peak())
        await touch_many(system, "one-off", NUM_ONE_OFF_IDS)
        watcher.cancel()
        await wait_for_reaping(system)
        gc.collect()
        after = rss_bytes()

        print(f"live actors: peak {peak}, after {system.num_live_actors}")
        print(f"RSS {baseline / 2**20:.1f} -> {after / 2**20:.1f} MiB")
        assert peak > 0  # the actors existed while they had work
        assert system.num_live_actors == 0
        growth = after - baseline
        assert growth < 32 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 20,000 one-off ids"


async def test_an_anonymous_request_gets_an_actor_that_ends_with_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    config = SystemConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=256), cache_dir=tmp_path
    )
    async with AgentSystem(config) as system:
        turn = TurnRequest(
            "anonymous", None, [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4)
        )
        started = await system.start_turn(turn)
        assert system.num_live_actors == 1
        async for _ in started.stream:  # its Finished comes once the turn is committed
            pass
        await wait_for_reaping(system)
        assert system.num_live_actors == 0


class PanicException(BaseException):
    """What pyo3 raises when a Rust library (tokenizers, llguidance) panics: not an Exception."""


async def test_a_library_panic_fails_its_turn_and_the_system_serves_on(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = SystemConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=256), cache_dir=tmp_path
    )
    async with AgentSystem(config) as system:
        in_worker = system.models.in_tokenizer_worker
        panics = [PanicException("called `Option::unwrap()` on a `None` value")]

        async def panics_once(*args: object) -> object:
            if panics:
                raise panics.pop()
            return await in_worker(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(system.models, "in_tokenizer_worker", panics_once)

        def turn() -> TurnRequest:
            return TurnRequest(
                "t", AgentId("steady"), [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4)
            )

        with pytest.raises(LibraryPanic, match="PanicException: called `Option::unwrap"):
            await system.start_turn(turn())
        started = await system.start_turn(turn())  # the same agent, the same system
        async for _ in started.stream:  # its Finished comes once the turn is committed
            pass
