"""What the KV cache costs in memory: bytes per cached token against the model's own KV size per
token, and the pool for 64 agents that share a ~4,000-token system prompt.

Runs the agent system in-process on the default model. Each agent sends one turn (the shared
system prompt and a short message of its own, 4 reply tokens). Reports, after each agent, the
pool's accounted bytes (whole 256-token blocks) and MLX's active memory, against what 64 separate
caches would take. Writes bench/results/kv_footprint.json and kv_footprint.png.

    python -m semantic.launch .venv/bin/python -m bench.kv_footprint [--agents 64]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.common import RESULTS, write_results
from semantic import AgentId, AgentSystem, SystemConfig, TurnRequest
from semantic.actors.engine_client import EngineConfig
from semantic.engine.cache_store.cache_matching import common_prefix_length
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool
from semantic.engine.model.default_model import ensure_default_model

RULES = [
    "Read the file before you edit it.",
    "Run the tests after every change.",
    "Keep each commit to one purpose.",
    "Never print secrets to the log.",
    "Ask before deleting anything outside the work tree.",
    "Prefer the standard library to a new dependency.",
]


def shared_system_prompt(target_tokens: int, tokenizer: Any) -> str:
    lines = ["You are one of many cooperating coding agents. The team's rules follow."]
    index = 0
    while len(tokenizer.encode("\n".join(lines))) < target_tokens:
        lines.append(f"Rule {index + 1}: {RULES[index % len(RULES)]}")
        index += 1
    return "\n".join(lines)


async def measure(model_dir: Path, cache_dir: Path, num_agents: int, system_tokens: int) -> dict[str, Any]:
    config = EngineConfig(model=str(model_dir), cache_budget_mb=8192)
    system = AgentSystem(SystemConfig(engine=config, cache_dir=cache_dir, persist_caches=False))
    await system.start()
    try:
        spec = system.engine.model.spec
        tokenizer = system.engine.model.tokenizer
        shared = shared_system_prompt(system_tokens, tokenizer)
        baseline_active = mx.get_active_memory()
        rows = []
        prompts: list[list[int]] = []
        for agent in range(num_agents):
            messages = [
                {"role": "system", "content": shared},
                {"role": "user", "content": f"Agent {agent}: say which rule you will follow first."},
            ]
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            prompts.append(prompt)
            turn = TurnRequest(
                f"footprint-{agent}",
                AgentId(f"agent-{agent}"),
                [],
                SamplingParams(max_tokens=4),
                prompt_token_ids=prompt,
            )
            async for _ in (await system.start_turn(turn)).stream:
                pass
            report = await system.engine.ask(InspectPool())
            rows.append(
                {
                    "agents": agent + 1,
                    "pool_bytes": report.used_bytes,
                    "active_bytes": mx.get_active_memory() - baseline_active,
                    "cached_tokens": sum(report.agent_id_to_num_tokens.values()),
                }
            )
        kv_per_token = spec.num_layers * spec.bytes_per_token_per_layer
        first, last = rows[0], rows[-1]
        unshared = first["pool_bytes"] * num_agents
    finally:
        await system.stop(flush=False)
    return {
        "model_kv_bytes_per_token": kv_per_token,
        "block_size": spec.block_size,
        "bytes_per_block": spec.bytes_per_block,
        "one_agent": {
            "cached_tokens": first["cached_tokens"],
            "pool_bytes_per_token": round(first["pool_bytes"] / first["cached_tokens"]),
            "active_bytes_per_token": round(first["active_bytes"] / first["cached_tokens"]),
            "pool_over_model_kv": round(first["pool_bytes"] / first["cached_tokens"] / kv_per_token, 3),
        },
        "shared_prompt_tokens": common_prefix_length(prompts[0], prompts[-1]),
        "agents": num_agents,
        "pool_bytes": last["pool_bytes"],
        "active_bytes": last["active_bytes"],
        "bytes_if_unshared": unshared,
        "unshared_over_shared": round(unshared / last["pool_bytes"], 1),
        "bytes_per_additional_agent": round((last["pool_bytes"] - first["pool_bytes"]) / (num_agents - 1)),
        "after_each_agent": rows,
    }


def plot(figures: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figures["after_each_agent"]
    agents = [row["agents"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(agents, [row["pool_bytes"] / 2**20 for row in rows], label="pool (whole blocks)")
    axis.plot(
        agents, [row["active_bytes"] / 2**20 for row in rows], label="MLX active memory", linestyle="--"
    )
    axis.plot(
        agents,
        [
            figures["one_agent"]["cached_tokens"] * n * figures["model_kv_bytes_per_token"] / 2**20
            for n in agents
        ],
        label="separate caches (model KV x tokens)",
        linestyle=":",
    )
    axis.set_xlabel("agents sharing the system prompt")
    axis.set_ylabel("MiB")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=4096)
    args = parser.parse_args()
    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory(prefix="semantic-footprint-") as cache:
        figures = asyncio.run(measure(model_dir, Path(cache), args.agents, args.system_tokens))
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(figures, RESULTS / "kv_footprint.png")
    write_results("kv_footprint", {**figures, "plot": "bench/results/kv_footprint.png"})


if __name__ == "__main__":
    main()
