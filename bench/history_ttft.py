"""A returning agent's time to first token against the length of its history, 1K to 32K tokens.

One agent per history length sends its first turn (a user message of about L tokens), gets an
8-token reply, then returns with the whole history plus one short question: the returning turn's
time to first token is what an agent pays each turn. Its cost should grow with the new tokens
only, not with the history. semantic and mlx_lm.server serve the same tiny random-weight Llama with
a 40K context (4 layers, 256 wide, built from mlx-lm's class) in one run, through the OpenAI
chat API, streamed; for semantic each returning turn also carries the server's own account from its
log (its time to first token; `handled_s`, the handler's time before the engine got the turn, which
renders and tokenises the whole history; `engine_wait_s`). Writes bench/results/history_ttft.json
and history_ttft.png.

    python -m semantic.launch .venv/bin/python -m bench.history_ttft [--lengths 1024 4096 32768]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import RESULTS, write_results
from bench.servers import MlxLmServer, Semantic, Server
from semantic.engine.model.default_model import ensure_default_model
from tests.tiny_models import TINY_CONFIGS, build_tiny_model

LONG_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
WORDS = ["agent", "cache", "block", "pool", "engine", "tick", "prefill", "decode", "history", "token"]
REPLY_TOKENS = 8


def history_text(num_tokens: int, seed: int) -> str:
    """About `num_tokens` tokens of words (one token each, with its space, in this tokenizer)."""
    rng = random.Random(seed)
    return f"Session {seed}: " + " ".join(rng.choice(WORDS) for _ in range(num_tokens))


async def turn(
    http: aiohttp.ClientSession, server: Server, messages: list[dict[str, str]], agent: str, request_id: str
) -> dict[str, Any]:
    body = {
        "model": server.model,
        "messages": messages,
        "stream": True,
        "temperature": 0,
        "max_tokens": REPLY_TOKENS,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    headers = {"x-session-id": agent, "x-request-id": request_id}
    async with http.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{server.name} answered {reply.status}: {await reply.text()}")
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - start,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0) or 0,
    }


async def measure(server: Server, lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    timeout = aiohttp.ClientTimeout(total=7200)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await turn(http, server, [{"role": "user", "content": "Warm up."}], "warm-up", "warm-up")
        for length in lengths:
            agent = f"history-{length}"
            messages = [{"role": "user", "content": history_text(length, length)}]
            first = await turn(http, server, messages, agent, f"{agent}-first")
            messages += [
                {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And what comes next?"},
            ]
            returning = await turn(http, server, messages, agent, f"{agent}-returning")
            rows.append(
                {
                    "history_tokens": first["prompt_tokens"],
                    "cold_ttft_s": round(first["ttft_s"], 3),
                    "returning_ttft_s": round(returning["ttft_s"], 3),
                    "returning_prompt_tokens": returning["prompt_tokens"],
                    "returning_cached_tokens": returning["cached_tokens"],
                }
            )
            print(server.name, rows[-1], flush=True)
    return rows


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, rows in results.items():
        xs = [row["history_tokens"] for row in rows]
        axis.plot(xs, [row["returning_ttft_s"] for row in rows], marker="o", label=f"{name}, returning turn")
        axis.plot(xs, [row["cold_ttft_s"] for row in rows], linestyle=":", label=f"{name}, first turn (cold)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("history (tokens)")
    axis.set_ylabel("time to first token (s)")
    axis.set_title("A returning agent's TTFT against its history")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="semantic-history-") as tmp:
        work = Path(tmp)
        TINY_CONFIGS["long-llama"] = LONG_LLAMA
        model_dir = build_tiny_model("long-llama", work / "long-llama", ensure_default_model("float32"))
        kv_bytes_per_token = 2 * 2 * 64 * 4 * 4  # keys and values, 2 KV heads of 64, float32, 4 layers
        budget = str(2 * sum(args.lengths) * kv_bytes_per_token // 2**20 + 256)  # every history fits
        servers: list[Server] = [
            Semantic(model_dir, work / "semantic", "--cache-budget-mb", budget),
            MlxLmServer(model_dir, work, REPLY_TOKENS),
        ]
        for server in servers:
            server.start()
            try:
                results[server.name] = asyncio.run(measure(server, args.lengths))
            finally:
                server.stop()
            timings = server.request_timings()
            for row, length in zip(results[server.name], args.lengths, strict=True):
                if view := timings.get(f"history-{length}-returning"):
                    row["returning_server_view"] = {k: round(v, 4) for k, v in view.items()}
    summary = {}
    for name, rows in results.items():
        shortest, longest = rows[0], rows[-1]
        summary[name] = {
            "returning_ttft_longest_over_shortest": round(
                longest["returning_ttft_s"] / shortest["returning_ttft_s"], 2
            ),
            "cold_ttft_longest_over_shortest": round(longest["cold_ttft_s"] / shortest["cold_ttft_s"], 2),
        }
    write_results(
        "history_ttft",
        {"model": LONG_LLAMA, "reply_tokens": REPLY_TOKENS, "runs": results, "summary": summary},
    )
    plot(results, RESULTS / "history_ttft.png")


if __name__ == "__main__":
    main()
