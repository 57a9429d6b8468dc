"""Time to first token for an agent returning with a ~2,000-token history and a 30-token new turn.

Cold (no cache), warm (cache in memory, three turns) and from disk after a server restart (three
restarts), in one run, the speed-ups from the median of each; then the pool bytes of eight agents
sharing a 1,000-token system prompt. Writes bench/results/agent_resume.json.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import aiohttp

from bench.common import write_results
from semantic import AgentId, AgentSystem, SystemConfig, TurnRequest
from semantic.actors.engine_client import EngineConfig
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess

PORT = 8792
SAMPLES = 3  # warm turns, and turns after a restart
FACTS = [
    "The river Thames flows through London.",
    "Honey never spoils if kept sealed.",
    "Octopuses have three hearts.",
    "Mount Everest grows a few millimetres each year.",
    "Bananas are berries but strawberries are not.",
    "Venus spins in the opposite direction to Earth.",
]


def history_messages(num_turns: int) -> list[dict[str, str]]:
    """A conversation of `num_turns` question/answer pairs and the question the agent answers next:
    it ends with a user turn, as clients send it (a request ending with an assistant message would
    put two assistant turns in a row on the next one, which the chat template merges)."""
    system = "You are a careful research assistant. " + " ".join(FACTS * 8)
    messages = [{"role": "system", "content": system}]
    for turn in range(num_turns):
        messages.append(
            {
                "role": "user",
                "content": f"Question {turn}: summarise fact {turn % 6} in detail. " + FACTS[turn % 6] * 3,
            }
        )
        messages.append(
            {
                "role": "assistant",
                "content": f"Fact {turn % 6}: " + " ".join(FACTS[(turn + i) % 6] for i in range(5)),
            }
        )
    messages.append({"role": "user", "content": f"Question {num_turns}: which fact surprises you most?"})
    return messages


NEW_TURN = {
    "role": "user",
    "content": "Now compare the first and the last fact in one careful sentence, please, and explain why.",
}


def answered(conversation: list[dict[str, str]], reply: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation with the agent's reply to its last turn and the next new question."""
    return [*conversation, {"role": "assistant", "content": reply["text"]}, NEW_TURN]


async def turn(session: aiohttp.ClientSession, agent: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "messages": messages,
        "stream": True,
        "temperature": 0,
        "max_tokens": 8,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    text = []
    usage: dict[str, Any] = {}
    async with session.post(
        f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body, headers={"x-agent-id": agent}
    ) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    return {
        "ttft_s": ttft,
        "text": "".join(text),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


async def warm_up(session: aiohttp.ClientSession) -> None:
    """A short unrelated turn first, so a fresh process's one-time costs (kernels a GPU compiles
    on first use, buffers allocated) land on no measured turn."""
    await turn(session, "warm-up", [{"role": "user", "content": "Hello there."}])


async def cold_ttft(model_dir: Path, cache_dir: Path, messages: list[dict[str, str]]) -> dict[str, Any]:
    """A fresh server with an empty cache: the whole prompt is prefilled."""
    server = ServerProcess(cache_dir, "--model", str(model_dir), port=PORT).start()
    try:
        async with aiohttp.ClientSession() as session:
            await warm_up(session)
            return await turn(session, "cold", messages)
    finally:
        server.stop()


async def resume_figures(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """The agent's first turn, then `SAMPLES` warm turns in a row, then `SAMPLES` turns each after a
    restart (from disk), each turn one new question on top of the last: every sample returns with
    the whole history cached and 30-odd new tokens. The speed-ups take the median sample of each
    (a single turn on this VM can land on a slow moment: 1.45 s once, against 0.5-0.7 s); the
    cold references are the first warm and the first disk turn's prompts, whose replies must
    match."""
    history = history_messages(20)
    server = ServerProcess(cache_dir / "agents", "--model", str(model_dir), port=PORT).start()
    try:
        async with aiohttp.ClientSession() as session:
            first = await turn(session, "returning", history)  # builds the agent's cache
            returning = conversation = answered(history, first)
            warm = []
            for _ in range(SAMPLES):
                warm.append(await turn(session, "returning", conversation))
                conversation = answered(conversation, warm[-1])
    finally:
        server.stop()  # SIGTERM: flushes caches to disk
    second = conversation
    disk = []
    for _ in range(SAMPLES):
        server = ServerProcess(cache_dir / "agents", "--model", str(model_dir), port=PORT).start()
        try:
            async with aiohttp.ClientSession() as session:
                await warm_up(session)
                disk.append(await turn(session, "returning", conversation))
                conversation = answered(conversation, disk[-1])
        finally:
            server.stop()
    cold = await cold_ttft(model_dir, cache_dir / "cold-1", returning)
    cold_second = await cold_ttft(model_dir, cache_dir / "cold-2", second)
    warm_ttft, disk_ttft = median(s["ttft_s"] for s in warm), median(s["ttft_s"] for s in disk)
    return {
        "history_tokens": first["prompt_tokens"],
        "new_turn_tokens": warm[0]["prompt_tokens"] - warm[0]["cached_tokens"],
        "cold": cold,
        "warm": warm[0],
        "disk_after_restart": disk[0],
        "cold_same_prompt_as_disk": cold_second,
        "warm_ttft_samples_s": [round(s["ttft_s"], 3) for s in warm],
        "disk_ttft_samples_s": [round(s["ttft_s"], 3) for s in disk],
        "warm_speedup": round(cold["ttft_s"] / warm_ttft, 1),
        "disk_speedup": round(cold_second["ttft_s"] / disk_ttft, 1),
        "outputs_match_cold": warm[0]["text"] == cold["text"] and disk[0]["text"] == cold_second["text"],
        "all_turns_cached": all(s["cached_tokens"] >= first["prompt_tokens"] for s in warm + disk),
    }


async def sharing_figures(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    system = AgentSystem(
        SystemConfig(engine=EngineConfig(model=str(model_dir)), cache_dir=cache_dir, persist_caches=False)
    )
    await system.start()
    try:
        tokenizer = system.engine.model.tokenizer
        shared = "You are one of eight cooperating agents. " + " ".join(FACTS * 19)
        used = []
        for agent in range(8):
            messages = [
                {"role": "system", "content": shared},
                {"role": "user", "content": f"Agent {agent}, say hello."},
            ]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            turn = TurnRequest(
                f"share-{agent}",
                AgentId(f"agent-{agent}"),
                [],
                SamplingParams(max_tokens=4),
                prompt_token_ids=prompt,
            )
            async for _ in (await system.start_turn(turn)).stream:
                pass
            used.append((await system.engine.ask(InspectPool())).used_bytes)
        prompt_tokens = len(prompt)
        block_bytes = system.engine.model.spec.bytes_per_block
    finally:
        await system.stop(flush=False)
    return {
        "shared_prompt_tokens": prompt_tokens,
        "pool_bytes_after_each_agent": used,
        "bytes_first_agent": used[0],
        "bytes_per_additional_agent": (used[-1] - used[0]) / 7,
        "bytes_if_unshared": used[0] * 8,
        "bytes_per_block": block_bytes,
    }


def main() -> None:
    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory() as cache:
        resume = asyncio.run(resume_figures(model_dir, Path(cache) / "a"))
        sharing = asyncio.run(sharing_figures(model_dir, Path(cache) / "b"))
    write_results("agent_resume", {"resume": resume, "shared_system_prompt": sharing})


if __name__ == "__main__":
    main()
