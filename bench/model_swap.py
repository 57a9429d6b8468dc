"""Model swap latency and memory: default model <-> a tiny second model, phase by phase.

Each swap drains the running batch (here one request is still decoding when it is asked for),
flushes every hot agent cache to disk (each round gives every agent a new turn, so each swap has
five caches to write), unloads (MLX memory back), loads the other model and is ready. Memory is
MLX's active memory before the first load, loaded, and after unloading.
Writes bench/results/model_swap.json.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.common import write_results
from semantic import AgentId, AgentSystem, SystemConfig, TurnRequest
from semantic.actors.engine_client import EngineConfig
from semantic.actors.model_registry import ModelEntry
from semantic.actors.model_session import SwapReport
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.model.default_model import ensure_default_model
from tests.tiny_models import build_tiny_model

ROUNDS = 3
AGENTS = 4
SYSTEM_PROMPT = "You are a careful assistant who answers in full sentences. " * 40  # ~500 tokens


async def warm_agents(system: AgentSystem, round_: int) -> None:
    """A new turn for each agent, so every swap has caches to write: a flush skips an agent whose
    file already holds its cache's tokens (a round that repeated the last one's turns would write
    nothing)."""
    for index in range(AGENTS):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Hello {index}, this is round {round_}."},
        ]
        turn = TurnRequest(
            f"warm-{index}", AgentId(f"agent-{index}"), messages, SamplingParams(temperature=0, max_tokens=8)
        )
        await _consume((await system.start_turn(turn)).stream)


async def swap_while_decoding(system: AgentSystem, target: str, round_: int) -> SwapReport:
    """Ask for the swap while a 48-token reply is still decoding: the drain waits for it."""
    messages = [{"role": "user", "content": f"Tell me story number {round_}."}]
    turn = TurnRequest("busy", AgentId("agent-busy"), messages, SamplingParams(max_tokens=48))
    consumer = asyncio.create_task(_consume((await system.start_turn(turn)).stream))
    await asyncio.sleep(0.5)
    report = await system.models.swap(target)
    await consumer
    assert report is not None and report.error is None, report
    return report


async def _consume(stream: Any) -> None:
    async for _ in stream:
        pass


def phases(reports: list[SwapReport]) -> dict[str, float]:
    keys = ("drain_s", "flush_s", "unload_s", "load_s", "total_s")
    return {key: round(statistics.median(getattr(r, key) for r in reports), 3) for key in keys}


async def main() -> None:
    default_dir = ensure_default_model("float32")
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = build_tiny_model("qwen2", Path(tmp) / "tiny-qwen2", default_dir)
        config = SystemConfig(
            engine=EngineConfig(model=str(default_dir), cache_budget_mb=1024),
            cache_dir=Path(tmp) / "cache",
            extra_models=(ModelEntry("tiny", str(tiny_dir)),),
        )
        system = AgentSystem(config)
        started = time.perf_counter()
        await system.start()
        first_load_s = time.perf_counter() - started
        memory_loaded = mx.get_active_memory()
        default_name = system.models.registry.initial.name
        to_tiny: list[SwapReport] = []
        to_default: list[SwapReport] = []
        for round_ in range(ROUNDS):
            await warm_agents(system, round_)
            to_tiny.append(await swap_while_decoding(system, "tiny", round_))
            to_default.append(await swap_while_decoding(system, default_name, round_))
        await warm_agents(system, ROUNDS)
        unloaded = await system.models.unload()
        assert unloaded is not None
        await system.stop()

    before = system.models.active_memory_before_load
    footprint = unloaded.active_memory_before_unload - before
    results = {
        "model": default_name,
        "first_load_s": round(first_load_s, 3),
        "rounds": ROUNDS,
        "agents_flushed_per_swap": [r.num_flushed for r in to_tiny],
        "default_to_tiny": phases(to_tiny),
        "tiny_to_default": phases(to_default),
        "memory_bytes": {
            "before_first_load": before,
            "default_loaded_idle": memory_loaded,
            "default_loaded_with_agent_caches": unloaded.active_memory_before_unload,
            "after_unload": unloaded.active_memory_after_unload,
            "left_after_unload_pct_of_footprint": round(
                100 * (unloaded.active_memory_after_unload - before) / footprint, 3
            ),
        },
    }
    write_results("model_swap", results)


if __name__ == "__main__":
    asyncio.run(main())
