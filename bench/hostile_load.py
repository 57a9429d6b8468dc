"""A 30 MB request while 8 agents decode: how fast `/health/live` answers and what memory does.

Starts `semantic serve` on the default model, starts 8 concurrent agent turns (64 tokens each),
sends one ~30 MB Anthropic request (a single huge user message, refused by the prompt bound after
it is tokenized in the tokenizer workers), and polls `/health/live` every 20 ms throughout.
Writes bench/results/hostile_load.json: health latency p50/p99/max, the huge request's status and
duration, the decodes' statuses, and the server's RSS before, at its peak and after.

    python -m semantic.launch .venv/bin/python -m bench.hostile_load
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import write_results
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess

HUGE_BYTES = 30 * 2**20
NUM_DECODES = 8


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(server: ServerProcess) -> dict[str, Any]:
    assert server.proc is not None
    pid = server.proc.pid
    health_s: list[float] = []
    rss: list[float] = [rss_mib(pid)]
    done = asyncio.Event()

    async def watch(http: aiohttp.ClientSession) -> None:
        while not done.is_set():
            started = time.perf_counter()
            async with http.get(server.base_url + "/health/live") as reply:
                await reply.read()
            health_s.append(time.perf_counter() - started)
            rss.append(rss_mib(pid))
            await asyncio.sleep(0.02)

    async def decode(http: aiohttp.ClientSession, index: int) -> int:
        body = {"content": f"Tell me a story about dragon {index}.", "max_tokens": 64, "temperature": 0}
        async with http.post(f"{server.base_url}/v1/agents/decoder-{index}/messages", json=body) as reply:
            await reply.read()
            return reply.status

    async def huge(http: aiohttp.ClientSession) -> tuple[int, float, str]:
        body = {
            "model": "claude-local",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "lorem ipsum dolor sit amet " * (HUGE_BYTES // 27)}],
        }
        started = time.perf_counter()
        async with http.post(server.base_url + "/v1/messages", json=body) as reply:
            text = await reply.text()
            return reply.status, time.perf_counter() - started, text[:300]

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        watcher = asyncio.create_task(watch(http))
        await asyncio.sleep(1.0)
        baseline_rss = statistics.median(rss)
        decodes = [asyncio.create_task(decode(http, i)) for i in range(NUM_DECODES)]
        await asyncio.sleep(0.5)
        huge_status, huge_s, huge_reply = await huge(http)
        statuses = await asyncio.gather(*decodes)
        await asyncio.sleep(5.0)  # let the allocator settle
        done.set()
        await watcher
    return {
        "health_live_ms": {
            "samples": len(health_s),
            "p50": round(1000 * percentile(health_s, 0.5), 1),
            "p99": round(1000 * percentile(health_s, 0.99), 1),
            "max": round(1000 * max(health_s), 1),
        },
        "huge_request": {
            "bytes": HUGE_BYTES,
            "status": huge_status,
            "seconds": round(huge_s, 2),
            "reply": huge_reply,
        },
        "decode_statuses": statuses,
        "server_rss_mib": {
            "before": round(baseline_rss, 1),
            "peak": round(max(rss), 1),
            "after": round(rss[-1], 1),
        },
    }


def main() -> None:
    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory() as scratch:
        server = ServerProcess(Path(scratch), "--model", str(model_dir), "--max-body-mb", "32").start()
        try:
            results = asyncio.run(run(server))
        finally:
            server.stop()
    write_results("hostile_load", {"model": model_dir.name, **results})


if __name__ == "__main__":
    main()
