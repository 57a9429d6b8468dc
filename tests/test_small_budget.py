"""With a KV budget of a few blocks, an agent's cache restored from disk is used by the turn that
restored it, not evicted again to make room for that same turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.engine.loop.commands import InspectPool, ListCaches

# SmolLM2-135M in float32: 45 KiB of KV a token, so 16-token blocks in 4 MiB make a pool of 5.
TINY_BUDGET = EngineConfig(block_size=16, cache_budget_mb=4)
LONG_FIRST_TURN = "Hi! My name is Ada Lovelace and I wrote the first program for the Analytical Engine."


@pytest.mark.asyncio
async def test_a_restored_cache_is_used_not_thrashed(default_model_dir: Path, tmp_path: Path) -> None:
    config = SystemConfig(
        engine=EngineConfig(
            model=str(default_model_dir),
            block_size=TINY_BUDGET.block_size,
            cache_budget_mb=TINY_BUDGET.cache_budget_mb,
        ),
        cache_dir=tmp_path,
    )
    async with AgentSystem(config) as system:
        assert (await system.engine.ask(InspectPool())).num_blocks == 5
        agent = await system.open("ada", system_prompt="You are terse.")
        await agent.reply(LONG_FIRST_TURN, max_tokens=4)
        assert agent.last_turn is not None
        history = agent.last_turn.num_prompt_tokens + agent.last_turn.num_generated_tokens
        assert history > 2 * 16  # two full blocks and a partial one: the turn below needs 4 more
        assert await agent.evict()
        assert not await system.engine.ask(ListCaches("ada"))

        await agent.reply("What is my name?", max_tokens=4)
        turn = agent.last_turn
        assert turn.cache_tier == "disk" and turn.num_cached_tokens >= history - 1, turn
        assert system.engine.stats.num_evictions == 0
        assert [cached.agent_id for cached in await system.engine.ask(ListCaches())] == ["ada"]
