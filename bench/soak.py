"""A long mixed workload against one server: does anything leak, fail or lose a turn?

Starts `semantic serve` on the default model with small memory and disk budgets (so agents'
caches are evicted to disk and cache files are deleted for the disk budget all through), then
for `--minutes` runs `--workers` clients that each pick, turn after turn, one of: a direct-API
turn of one of 24 named agents (streamed or not), an eviction or (rarely) a deletion of one, a
streamed Anthropic conversation turn with a tool, an OpenAI chat stream the client drops after
three chunks, a text completion with log-probabilities, or a malformed request. A conversation
refused for outgrowing the cache budget starts afresh (its agent deleted, its Anthropic session
emptied), as a client that compacts its context would, so the churn lasts the whole run. Every 10 s it
samples the server's RSS, open file descriptors, threads and its /metrics (pool bytes in use, MLX
memory, requests in flight, agents in memory, cache bytes on disk), and once more after a minute
idle (when the server gives its free heap pages back).

Then it restarts the server (SIGTERM) and sends each surviving direct-API agent one more turn:
its prompt must hold every acknowledged turn before it (prompt tokens at least the last turn's
prompt plus reply).

Writes bench/results/soak.json: counts by scenario and status, what the 4xx said, failures (5xx,
dropped connections, lost history), quarantined files, heap trims, each figure's range in either
half of the run, and every sample.

    python -m semantic.launch .venv/bin/python -m bench.soak --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import write_results
from semantic.actors.heap import HEAP_TRIM_IDLE_S
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess

NUM_AGENTS = 24
NUM_SESSIONS = 8
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "seven",
    "agents",
    "wrote",
    "tests",
    "for",
    "a",
    "daemon",
    "that",
    "never",
    "sleeps",
]
TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
BAD_BODIES = [b"{not json", b'{"model":"default","messages":[],"max_tokens":1000000000}', b"[]"]


def proc_status(pid: int) -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "Threads"):
                fields[name] = float(value.split()[0])
    return {
        "rss_mib": fields.get("VmRSS", 0.0) / 1024,
        "threads": fields.get("Threads", 0.0),
        "fds": float(len(os.listdir(f"/proc/{pid}/fd"))),
    }


def metric(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Soak:
    def __init__(self, base_url: str, seed: int) -> None:
        self.base_url = base_url
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()  # what a 4xx said, for the scenarios that expect 200
        self.failures: list[str] = []
        self.agent_totals: dict[str, int] = {}  # agent -> prompt + reply tokens of its last turn
        self.sessions: dict[str, list[dict[str, Any]]] = {}

    def sentence(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 40)))

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print("FAILURE:", what, flush=True)

    def count(self, scenario: str, status: int) -> None:
        self.counts[f"{scenario} {status}"] += 1
        if status >= 500:
            self.fail(f"{scenario}: {status}")

    async def refused(self, scenario: str, reply: aiohttp.ClientResponse) -> bool:
        """Count a reply that is not a 200, with what it said (digits dropped, to group alike ones);
        whether it said the conversation has outgrown the cache budget (then the client starts a
        new one, as one that compacts its context would)."""
        text = (await reply.text())[:300]
        self.refusals[f"{scenario} {reply.status}: " + "".join("#" if c.isdigit() else c for c in text)] += 1
        return reply.status == 400 and "larger --cache-budget-mb" in text

    async def agent_turn(self, http: aiohttp.ClientSession, agent: str) -> None:
        if agent not in self.agent_totals:
            async with http.post(
                f"{self.base_url}/v1/agents", json={"id": agent, "system": "Be brief."}
            ) as r:
                self.count("agent_create", r.status)
                if r.status not in (201, 409):
                    return
            self.agent_totals[agent] = 0
        stream = self.rng.random() < 0.5
        body = {"content": self.sentence(), "max_tokens": self.rng.randint(8, 40), "stream": stream}
        async with http.post(f"{self.base_url}/v1/agents/{agent}/messages", json=body) as r:
            self.count("agent_turn", r.status)
            if r.status != 200:
                if await self.refused("agent_turn", r):
                    await self.delete_agent(http, agent, "agent_reset")
                return
            if stream:
                usage = None
                async for line in r.content:
                    if line.startswith(b"data: ") and b'"usage"' in line:
                        usage = json.loads(line[6:])["usage"]
            else:
                usage = (await r.json())["usage"]
        if usage is None:
            self.fail(f"agent_turn {agent}: no usage")
            return
        self.check_history(agent, usage)

    def check_history(self, agent: str, usage: dict[str, Any]) -> None:
        before = self.agent_totals.get(agent, 0)
        if usage["prompt_tokens"] < before:
            self.fail(f"agent {agent} lost history: prompt {usage['prompt_tokens']} < {before}")
        self.agent_totals[agent] = usage["prompt_tokens"] + usage["completion_tokens"]

    async def delete_agent(self, http: aiohttp.ClientSession, agent: str, scenario: str) -> None:
        async with http.delete(f"{self.base_url}/v1/agents/{agent}") as r:
            self.count(scenario, r.status)
            if r.status in (200, 204):
                self.agent_totals.pop(agent, None)  # another worker may have deleted it too

    async def agent_admin(self, http: aiohttp.ClientSession, agent: str) -> None:
        if agent not in self.agent_totals:
            return
        if self.rng.random() < 0.15:
            await self.delete_agent(http, agent, "agent_delete")
        else:
            async with http.post(f"{self.base_url}/v1/agents/{agent}/evict") as r:
                self.count("agent_evict", r.status)

    async def anthropic_turn(self, http: aiohttp.ClientSession) -> None:
        session = f"session-{self.rng.randrange(NUM_SESSIONS)}"
        messages = self.sessions.setdefault(session, [])
        messages.append({"role": "user", "content": self.sentence()})
        body = {"model": "default", "max_tokens": 32, "stream": True, "messages": messages, "tools": [TOOL]}
        text = []
        async with http.post(f"{self.base_url}/v1/messages", json=body, headers={"x-agent-id": session}) as r:
            self.count("anthropic_stream", r.status)
            if r.status != 200:
                if await self.refused("anthropic_stream", r):
                    self.sessions[session] = []  # a client compacting its context starts anew
                else:
                    messages.pop()
                return
            async for line in r.content:
                if line.startswith(b"data: ") and b"text_delta" in line:
                    text.append(json.loads(line[6:])["delta"]["text"])
        messages.append({"role": "assistant", "content": "".join(text) or "ok"})
        if len(messages) > 30:
            self.sessions[session] = []

    async def openai_dropped(self, http: aiohttp.ClientSession) -> None:
        body = {
            "model": "default",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": self.sentence()}],
        }
        async with http.post(f"{self.base_url}/v1/chat/completions", json=body) as r:
            self.count("openai_dropped", r.status)
            chunks = 0
            async for _line in r.content:
                chunks += 1
                if chunks >= 3:
                    break
            r.close()  # the client goes away mid-stream

    async def completion(self, http: aiohttp.ClientSession) -> None:
        body = {"model": "default", "prompt": self.sentence(), "max_tokens": 16, "logprobs": 3}
        async with http.post(f"{self.base_url}/v1/completions", json=body) as r:
            self.count("completion", r.status)
            if r.status != 200:
                await self.refused("completion", r)
            await r.read()

    async def bad_request(self, http: aiohttp.ClientSession) -> None:
        path = self.rng.choice(["/v1/messages", "/v1/chat/completions", "/v1/agents/../x/messages"])
        data = self.rng.choice(BAD_BODIES)
        async with http.post(
            self.base_url + path, data=data, headers={"content-type": "application/json"}
        ) as r:
            await r.read()
            self.count("bad_request", r.status)
            if r.status < 400:
                self.fail(f"bad request to {path} answered {r.status}")

    async def worker(self, http: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            roll = self.rng.random()
            agent = f"agent-{self.rng.randrange(NUM_AGENTS)}"
            try:
                if roll < 0.4:
                    await self.agent_turn(http, agent)
                elif roll < 0.5:
                    await self.agent_admin(http, agent)
                elif roll < 0.7:
                    await self.anthropic_turn(http)
                elif roll < 0.8:
                    await self.openai_dropped(http)
                elif roll < 0.9:
                    await self.completion(http)
                else:
                    await self.bad_request(http)
            except (TimeoutError, aiohttp.ClientError) as error:
                self.fail(f"connection: {error!r}")


async def sample(server: ServerProcess, http: aiohttp.ClientSession, started: float) -> dict[str, float]:
    assert server.proc is not None
    async with http.get(server.base_url + "/metrics") as r:
        text = await r.text()
    return {
        "t_s": round(time.monotonic() - started, 1),
        **proc_status(server.proc.pid),
        "pool_used_mib": metric(text, "semantic_pool_bytes", 'kind="used"') / 2**20,
        "mlx_active_mib": metric(text, "semantic_mlx_memory_bytes", 'kind="active"') / 2**20,
        "mlx_cache_mib": metric(text, "semantic_mlx_memory_bytes", 'kind="cache"') / 2**20,
        "in_flight": metric(text, "semantic_requests_in_flight"),
        "active_agents": metric(text, "semantic_active_agents"),
        "disk_cache_mib": metric(text, "semantic_disk_cache_bytes") / 2**20,
        "disk_evictions": metric(text, "semantic_disk_evictions_total"),
        "evictions": metric(text, "semantic_evictions_total"),
        "evicted_caches_dropped": metric(text, "semantic_evicted_caches_dropped_total"),
    }


async def soak(server: ServerProcess, soak: Soak, minutes: float, workers: int) -> list[dict[str, float]]:
    started = time.monotonic()
    deadline = started + minutes * 60
    samples: list[dict[str, float]] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        tasks = [asyncio.create_task(soak.worker(http, deadline)) for _ in range(workers)]
        while not all(task.done() for task in tasks):
            samples.append(await sample(server, http, started))
            print(json.dumps(samples[-1]), flush=True)
            await asyncio.wait(tasks, timeout=10)
        await asyncio.gather(*tasks)
        await asyncio.sleep(3)  # let dropped streams and evictions settle
        samples.append(await sample(server, http, started))
        await asyncio.sleep(HEAP_TRIM_IDLE_S + 20)  # idle: the server gives free heap back
        samples.append(await sample(server, http, started))
    return samples


async def after_restart(server: ServerProcess, soak: Soak) -> dict[str, int]:
    """One more turn for each direct-API agent; how many it tried and how many were served (each
    checked to hold every acknowledged turn: a shorter prompt is a failure)."""
    served_before = soak.counts["agent_turn 200"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for agent in sorted(soak.agent_totals):
            await soak.agent_turn(http, agent)
    return {"agents": len(soak.agent_totals), "served": soak.counts["agent_turn 200"] - served_before}


def ranges(samples: list[dict[str, float]], key: str) -> dict[str, list[float]]:
    """`key`'s lowest and highest value in each half of the run: growth shows as a second half above
    the first, where a heap trimmed once a minute swings within one range."""
    half = len(samples) // 2
    return {
        name: [round(min(s[key] for s in part), 1), round(max(s[key] for s in part), 1)]
        for name, part in (("first_half", samples[:half]), ("second_half", samples[half:]))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", help="keep the server's folder (and its log) here")
    args = parser.parse_args()
    model = ensure_default_model()
    budgets = (
        "--cache-budget-mb",
        "48",
        "--disk-budget-mb",
        "40",
        "--model",
        str(model),
        "--log-level",
        "debug",
    )
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.cache_dir or scratch
        server = ServerProcess(Path(tmp), *budgets).start()
        runner = Soak(server.base_url, args.seed)
        try:
            samples = asyncio.run(soak(server, runner, args.minutes, args.workers))
        finally:
            exit_code = server.stop()
        turns_before = runner.counts["agent_turn 200"]
        server = ServerProcess(Path(tmp), *budgets, port=server.port).start()
        try:
            resumed = asyncio.run(after_restart(server, runner))
        finally:
            server.stop()
        quarantined = list((Path(tmp)).rglob("quarantine/*"))
        trims_ms = [float(m) for m in re.findall(r"gave free heap pages back in ([0-9.]+) ms", server.log())]
    write_results(
        "soak",
        {
            "minutes": args.minutes,
            "workers": args.workers,
            "requests": dict(sorted(runner.counts.items())),
            "failures": runner.failures,
            "refusals": dict(runner.refusals.most_common()),
            "first_exit_code": exit_code,
            "agent_turns_served_before_restart": turns_before,
            "after_restart": resumed,
            "quarantined_files": [p.name for p in quarantined],
            "heap_trims": {
                "count": len(trims_ms),
                "median_ms": statistics.median(trims_ms) if trims_ms else None,
                "max_ms": max(trims_ms, default=None),
            },
            "ranges": {
                key: ranges(samples, key)
                for key in ("rss_mib", "mlx_active_mib", "mlx_cache_mib", "fds", "threads", "pool_used_mib")
            },
            "end_busy": samples[-2],
            "end_after_idle_minute": samples[-1],
            "samples": samples,
        },
    )


if __name__ == "__main__":
    main()
