"""Running streams while new agents arrive: inter-token latency, semantic against mlx_lm.server.

Two streams decode (each restarted as it ends, so two always run) while 0, 2 or 8 new agents
arrive, half a second apart, each with its own ~2,000-token prompt. Measured at the client: the
time between two content chunks of a running stream (p50, p99, max) from the first arrival until
every arrival has its first token (with no arrivals: a fixed window), and each arrival's time to
first token. semantic runs with its default `--prefill-stall-ratio` (1) unless told otherwise. Both
servers get the same prefill chunk with nothing decoding (512 tokens, our CPU default;
mlx_lm.server's own default is 2,048). Writes bench/results/arrivals.json and
arrivals_itl.png.

    python -m semantic.launch .venv/bin/python -m bench.arrivals [--arrivals 0 2 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import RESULTS, percentile, write_results
from bench.servers import MlxLmServer, Semantic, Server
from semantic.engine.model.default_model import ensure_default_model

RUNNERS = 2
RUNNER_TOKENS = 200
ARRIVAL_GAP_S = 0.5
QUIET_WINDOW_S = 20.0
PREFILL_CHUNK = "512"
WORDS = ["agent", "cache", "block", "pool", "engine", "tick", "prefill", "decode", "stream", "token", "tool"]


def arrival_prompt(seed: int, num_words: int = 1700) -> str:
    """About 2,000 tokens, different from the first word on, so no server can reuse another's cache."""
    rng = random.Random(seed)
    notes = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"Request {uuid.uuid4().hex}. Summarise these notes in one line: {notes}"


async def stream_chat(
    session: aiohttp.ClientSession,
    server: Server,
    text: str,
    max_tokens: int,
    on_chunk: GapRecorder | None = None,
) -> tuple[float, float]:
    """(time to first content chunk, total) for one streamed chat completion; `on_chunk()` per chunk."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    ttft: float | None = None
    async with session.post(f"{server.base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"] if b'"choices"' in line else {}
            if delta.get("content"):
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - start
                if on_chunk is not None:
                    on_chunk(now)
    total = time.perf_counter() - start
    return (ttft if ttft is not None else total), total


class GapRecorder:
    """Appends the time between consecutive chunks of one stream to `gaps` while `measuring` is set."""

    def __init__(self, gaps: list[float], measuring: asyncio.Event) -> None:
        self.gaps, self.measuring = gaps, measuring
        self.last: float | None = None

    def __call__(self, now: float) -> None:
        if self.last is not None and self.measuring.is_set():
            self.gaps.append(now - self.last)
        self.last = now


async def scenario(server: Server, num_arrivals: int) -> dict[str, Any]:
    gaps: list[float] = []
    measuring = asyncio.Event()
    stop = asyncio.Event()

    async def runner(index: int, session: aiohttp.ClientSession) -> None:
        prompt = f"Tell a long story about ship {index}."
        while not stop.is_set():
            await stream_chat(session, server, prompt, RUNNER_TOKENS, GapRecorder(gaps, measuring))

    async def arrival(index: int, session: aiohttp.ClientSession) -> float:
        await asyncio.sleep(index * ARRIVAL_GAP_S)
        ttft, _ = await stream_chat(session, server, arrival_prompt(index), 8)
        return ttft

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        runners = [asyncio.create_task(runner(i, session)) for i in range(RUNNERS)]
        await asyncio.sleep(3.0)  # both runners past their prompts and decoding
        window_start = time.perf_counter()
        measuring.set()
        if num_arrivals:
            ttfts = await asyncio.gather(*(arrival(i, session) for i in range(num_arrivals)))
        else:
            ttfts = []
            await asyncio.sleep(QUIET_WINDOW_S)
        measuring.clear()
        window_s = time.perf_counter() - window_start
        stop.set()
        await asyncio.gather(*runners)
    return {
        "arrivals": num_arrivals,
        "window_s": round(window_s, 2),
        "num_gaps": len(gaps),
        "itl_p50_ms": round(1000 * statistics.median(gaps), 1),
        "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 1),
        "itl_max_ms": round(1000 * max(gaps), 1),
        "running_tokens_per_s": round(len(gaps) / window_s / RUNNERS, 2),
        "arrival_ttft_median_s": round(statistics.median(ttfts), 2) if ttfts else None,
        "arrival_ttft_max_s": round(max(ttfts), 2) if ttfts else None,
    }


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, rows in results.items():
        arrivals = [row["arrivals"] for row in rows]
        axis.plot(arrivals, [row["itl_p99_ms"] for row in rows], marker="o", label=f"{name} p99")
        p50 = [row["itl_p50_ms"] for row in rows]
        axis.plot(arrivals, p50, marker=".", linestyle="--", label=f"{name} p50")
    axis.set_xlabel("agents arriving with ~2K-token prompts")
    axis.set_ylabel("running streams' inter-token latency (ms)")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arrivals", type=int, nargs="+", default=[0, 2, 8])
    parser.add_argument("--servers", nargs="+", default=["semantic", "mlx_lm.server"])
    parser.add_argument("--prefill-stall-ratio", help="semantic's --prefill-stall-ratio (default: its own)")
    parser.add_argument("--output", default="arrivals", help="results file name, without .json")
    args = parser.parse_args()
    ratio = ("--prefill-stall-ratio", args.prefill_stall_ratio) if args.prefill_stall_ratio else ()
    model_dir = ensure_default_model()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="semantic-arrivals-") as tmp:
        chunk = ("--prefill-step-size", PREFILL_CHUNK)
        servers: dict[str, Server] = {
            "semantic": Semantic(model_dir, Path(tmp) / "cache", *chunk, *ratio),
            "mlx_lm.server": MlxLmServer(model_dir, Path(tmp), RUNNER_TOKENS, *chunk),
        }
        for name in args.servers:
            server = servers[name]
            server.start()
            try:
                results[name] = []
                for num_arrivals in args.arrivals:
                    row = asyncio.run(scenario(server, num_arrivals))
                    print(name, row, file=sys.stderr)
                    results[name].append(row)
            finally:
                server.stop()
    comparison: dict[str, Any] = {}
    ours = {row["arrivals"]: row for row in results.get("semantic", [])}
    theirs = {row["arrivals"]: row for row in results.get("mlx_lm.server", [])}
    most = max(args.arrivals)
    if 0 in ours and most in ours:
        comparison["semantic_p99_growth"] = round(ours[most]["itl_p99_ms"] / ours[0]["itl_p99_ms"], 2)
    if most in ours and most in theirs:
        comparison["p99_vs_mlx_lm_server"] = round(ours[most]["itl_p99_ms"] / theirs[most]["itl_p99_ms"], 3)
    plot_path = RESULTS / f"{args.output}_itl.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path)
    write_results(
        args.output,
        {
            "workload": {
                "runners": RUNNERS,
                "arrival_prompt_tokens": "~2,000",
                "arrival_gap_s": ARRIVAL_GAP_S,
                "prefill_step_size": int(PREFILL_CHUNK),
                "semantic_prefill_stall_ratio": args.prefill_stall_ratio or "default",
            },
            "comparison": comparison,
            "servers": results,
            "plot": str(plot_path.relative_to(RESULTS.parent.parent)),
        },
    )


if __name__ == "__main__":
    main()
