"""Aggregate decode tokens/s at 1, 2, 4, 8 concurrent requests: our HTTP path vs raw BatchGenerator.

Both prefill up to 8 prompts together in 512-token chunks (BatchGenerator's default batch; our CPU
default prefills one prompt at a time, a scheduling choice measured by bench/arrivals.py).

Raw and HTTP runs alternate in pairs (the order flipped each pair), so the machine's drift over
minutes falls on both sides; each figure is the median of its runs, and each pair's ratio is kept.

Also samples /health/live latency while 8 requests decode. Writes bench/results/batching.json.

`--model DIR` runs another model directory: a tiny random-weight one (`tests/tiny_models.py`) takes
a few milliseconds a step on the CPU (3 layers: ~4 ms; SmolLM2's 30 layers at tiny widths: 10-15
ms), as a small model's step does on a GPU, so the model no longer hides the HTTP path's cost per
token; on the CPU the ratio also carries our CPU kernels' cost per op, which a GPU does not pay.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from bench.common import write_results
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess

CONCURRENCY = [1, 2, 4, 8]
MAX_TOKENS = 96
RUNS = 5  # raw/HTTP pairs per concurrency; each figure is a median: one ~9 s run varies by ~8% on this VM
TOPICS = [
    "the ocean",
    "mountains",
    "a city at night",
    "a forest",
    "the desert",
    "rivers",
    "the sky",
    "winter",
]


def prompts(tokenizer, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a long essay about {TOPICS[i]}."}],
            add_generation_prompt=True,
        )
        for i in range(n)
    ]


def raw_tokens_per_s(model, tokenizer, n: int, max_tokens: int = MAX_TOKENS) -> float:  # type: ignore[no-untyped-def]
    generator = BatchGenerator(model, completion_batch_size=16, prefill_step_size=512)
    start = time.perf_counter()
    generator.insert(prompts(tokenizer, n), max_tokens=[max_tokens] * n)
    generated, done = 0, 0
    while done < n:
        _, responses = generator.next()
        for response in responses:
            generated += 1
            done += response.finish_reason is not None
    return generated / (time.perf_counter() - start)


async def http_tokens_per_s(  # type: ignore[no-untyped-def]
    url: str, tokenizer, n: int, health: list[float] | None = None, max_tokens: int = MAX_TOKENS
) -> float:
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            body = {
                "messages": [{"role": "user", "content": f"Write a long essay about {TOPICS[i]}."}],
                "stream": True,
                "temperature": 0,
                "max_tokens": max_tokens,
                "stream_options": {"include_usage": True},
            }
            tokens = 0
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if b'"usage"' in line:
                        import json

                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens

        async def probe(stop: asyncio.Event) -> None:
            while not stop.is_set():
                start = time.perf_counter()
                async with session.get(f"{url}/health/live") as response:
                    await response.read()
                assert health is not None
                health.append((time.perf_counter() - start) * 1000)
                await asyncio.sleep(0.05)

        stop = asyncio.Event()
        prober = asyncio.create_task(probe(stop)) if health is not None else None
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - start
        stop.set()
        if prober:
            await prober
        return sum(counts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: the default model)")
    parser.add_argument("--output", default="batching", help="the results file's name")
    parser.add_argument("--runs", type=int, default=RUNS, help="raw/HTTP pairs per concurrency")
    args = parser.parse_args()
    model_dir = args.model or ensure_default_model()
    model, tokenizer = load(str(model_dir))
    raw: dict[int, list[float]] = {n: [] for n in CONCURRENCY}
    http: dict[int, list[float]] = {n: [] for n in CONCURRENCY}
    health: list[float] = []
    with tempfile.TemporaryDirectory() as cache:
        # The same schedule as the raw generator (its default: up to 8 prompts prefilled together),
        # so the ratio is the HTTP path's cost, not our CPU default of one prompt at a time. The
        # server idles (no CPU) while the raw generator runs in this process, and the other way round.
        server = ServerProcess(
            Path(cache),
            "--model",
            str(model_dir),
            "--prefill-batch-size",
            "8",
            "--prefill-step-size",
            "512",
            port=8791,
        ).start()
        try:
            raw_tokens_per_s(model, tokenizer, 1)  # warm-up
            asyncio.run(http_tokens_per_s(server.base_url, tokenizer, 1))
            for n in CONCURRENCY:
                # Pairs, the order flipped each time: this VM's speed drifts by several percent over
                # minutes, and measuring one side's runs before the other's put that drift in the ratio.
                for run in range(args.runs):
                    sides = ["raw", "http"] if run % 2 == 0 else ["http", "raw"]
                    for side in sides:
                        if side == "raw":
                            raw[n].append(raw_tokens_per_s(model, tokenizer, n))
                        else:
                            probe = health if n == 8 else None
                            run_http = http_tokens_per_s(server.base_url, tokenizer, n, probe)
                            http[n].append(asyncio.run(run_http))
        finally:
            server.stop()
    rows = {
        n: {
            "raw_tok_s": round(statistics.median(raw[n]), 1),
            "http_tok_s": round(statistics.median(http[n]), 1),
            "ratio": round(statistics.median(http[n]) / statistics.median(raw[n]), 3),
            "pair_ratios": [round(h / r, 3) for r, h in zip(raw[n], http[n], strict=True)],
        }
        for n in CONCURRENCY
    }
    write_results(
        args.output,
        {
            "model": model_dir.name,
            "max_tokens": MAX_TOKENS,
            "runs": args.runs,
            "aggregate_decode": rows,
            "health_live_ms_while_8_decode": {
                "p50": round(statistics.median(health), 2),
                "max": round(max(health), 2),
                "samples": len(health),
            },
        },
    )


if __name__ == "__main__":
    main()
