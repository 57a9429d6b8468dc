"""Idle caches kept quantized (`--idle-kv-bits`): agents per GB, and how often replies stay the same.

The engine runs in-process on the default model, once at full precision and once for each bit
width. Eight agents each take four turns (a ~600-token system prompt of their own, then questions;
32 greedy tokens a turn), one request at a time so the runs differ only in the cache. Every run
sends the prompts of the full-precision run, so turn k of an agent starts from its cache of turn
k - 1, kept quantized in between. Reported: blocks in a 1 GiB budget, pool bytes per agent, and the
share of returning turns whose reply is token-for-token the full-precision one (with the mean
number of leading tokens that agree). Writes bench/results/idle_kv.json.

    python -m semantic.launch .venv/bin/python -m bench.idle_kv
"""

from __future__ import annotations

import asyncio
import random
import statistics
import uuid
from pathlib import Path
from typing import Any

from bench.common import write_results
from semantic.actors.engine_client import Engine, EngineConfig
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool
from semantic.engine.loop.messages import GenerationRequest, TokenDelta
from semantic.engine.model.default_model import ensure_default_model

AGENTS = 8
TURNS = 4
REPLY_TOKENS = 32
BUDGET_MB = 1024
QUESTIONS = [
    "Which file should I read first, and why?",
    "Summarise what you found in two sentences.",
    "What is the riskiest change you would make?",
    "Write the commit message for it.",
]
DUTIES = ["reviews pull requests", "writes tests", "fixes flaky builds", "updates the docs"]


def system_prompt(agent: int) -> str:
    rng = random.Random(agent)
    notes = [
        f"Note {i}: the agent {rng.choice(DUTIES)} and reports to agent {rng.randrange(8)}."
        for i in range(40)
    ]
    return f"You are coding agent {agent}.\n" + "\n".join(notes)


async def generate(engine: Engine, prompt: list[int], agent_id: str) -> list[int]:
    request = GenerationRequest(
        uuid.uuid4().hex, prompt, SamplingParams(max_tokens=REPLY_TOKENS), agent_id=agent_id
    )
    tokens: list[int] = []
    async for event in engine.submit(request):
        if isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
    return tokens


async def run(
    model_dir: Path, bits: int | None, prompts: dict[tuple[int, int], list[int]] | None
) -> dict[str, Any]:
    """One run; with `prompts` None it builds them from its own replies (the full-precision run)."""
    engine = Engine(EngineConfig(model=str(model_dir), cache_budget_mb=BUDGET_MB, idle_kv_bits=bits))
    await engine.start()
    replies: dict[tuple[int, int], list[int]] = {}
    built: dict[tuple[int, int], list[int]] = {}
    try:
        tokenizer = engine.model.tokenizer
        histories = {a: [{"role": "system", "content": system_prompt(a)}] for a in range(AGENTS)}
        for turn in range(TURNS):
            for agent in range(AGENTS):
                key = (agent, turn)
                if prompts is None:
                    histories[agent].append({"role": "user", "content": QUESTIONS[turn]})
                    prompt = list(tokenizer.apply_chat_template(histories[agent], add_generation_prompt=True))
                else:
                    prompt = prompts[key]
                built[key] = prompt
                replies[key] = await generate(engine, prompt, f"agent-{agent}")
                if prompts is None:
                    histories[agent].append({"role": "assistant", "content": tokenizer.decode(replies[key])})
        report = await engine.ask(InspectPool())
    finally:
        await engine.stop()
    return {
        "bits": bits,
        "blocks_in_budget": report.num_blocks,
        "pool_bytes_per_agent": report.used_bytes // AGENTS,
        "prompts": built,
        "replies": replies,
    }


def agreement(reference: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    returning = [key for key in reference["replies"] if key[1] > 0]
    same = [run["replies"][key] == reference["replies"][key] for key in returning]

    def leading(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    first_turns = [key for key in reference["replies"] if key[1] == 0]
    return {
        "returning_turns": len(returning),
        "identical_replies": sum(same),
        "identical_share": round(sum(same) / len(returning), 3),
        "mean_leading_tokens_equal": round(
            statistics.mean(leading(run["replies"][k], reference["replies"][k]) for k in returning), 1
        ),
        "first_turns_identical": all(run["replies"][k] == reference["replies"][k] for k in first_turns),
    }


def main() -> None:
    model_dir = ensure_default_model()
    reference = asyncio.run(run(model_dir, None, None))
    results: dict[str, Any] = {
        "workload": {"agents": AGENTS, "turns": TURNS, "reply_tokens": REPLY_TOKENS, "budget_mb": BUDGET_MB},
        "full_precision": {k: reference[k] for k in ("blocks_in_budget", "pool_bytes_per_agent")},
    }
    for bits in (8, 4):
        quantized = asyncio.run(run(model_dir, bits, reference["prompts"]))
        results[f"{bits}_bits"] = {
            "blocks_in_budget": quantized["blocks_in_budget"],
            "pool_bytes_per_agent": quantized["pool_bytes_per_agent"],
            "agents_per_budget_vs_full": round(
                quantized["blocks_in_budget"] / reference["blocks_in_budget"], 2
            ),
            **agreement(reference, quantized),
        }
    write_results("idle_kv", results)


if __name__ == "__main__":
    main()
