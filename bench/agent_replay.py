"""Multi-agent replay: semantic against mlx_lm.server on the same model, machine and workload.

N agents (1, 4, 8 by default) each replay a scripted agent session through the OpenAI chat API:
a ~1,000-token system prompt (half the agents share one, the others have their own), then turns
that grow the history to ~3,000 tokens. Every turn sends the whole history, as agent clients do;
the model's real replies are appended, and scripted tool-call / tool-result turns are mixed in (a
135M model writes no tool calls of its own). Agents run concurrently with a short "tool time"
between turns, so their turns interleave. Half-way through, once every agent has finished that
turn, the server is restarted (SIGTERM, then started again on the same cache directory) and the
agents carry on. After every start as many other agents take one turn, unmeasured (`warm_up`): on
a GPU the first process to need a kernel compiles it.

Per turn: time to first token, latency, prompt, reused and generated tokens, and for semantic the
server's own account of the turn from its JSON log (its time to first token, the time its handler
took before the engine got the turn, the engine's wait before the turn joined the batch), and the
time between its reply's streamed chunks. Per run: wall time (restart excluded, reported apart),
aggregate decode tokens/s, cache hit rate, and the replies' time between chunks (p50, p99, max:
what an agent's stream pays while the others' turns are prefilled). Writes
bench/results/agent_replay.json and the plots agent_replay_ttft.png and agent_replay_throughput.png
(`--output` renames all three).

    python -m semantic.launch .venv/bin/python -m bench.agent_replay [--agents 1 4 8] [--turns 6] [--logs DIR]
        [--prefill-stall-ratio R] [--short-turn-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import RESULTS, percentile, write_results
from bench.servers import MlxLmServer, Semantic, Server
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ROOT

REPLY_TOKENS = 32
TOOL_TIME_S = (0.05, 0.4)  # what an agent spends running a tool between two requests
WARM_UP_AGENT = 10_000  # the warm-up's agents are numbered from here (their own prompts and ids)

TOPICS = [
    "the block pool hands out 256-token blocks and takes them back when an agent is evicted",
    "the persistence actor writes each evicted cache to a checksummed safetensors file",
    "the engine thread admits new requests between decode steps of the running batch",
    "the protocol handlers translate HTTP requests into messages for the agent actors",
    "a returning agent only prefills the part of its prompt that its cache does not hold",
    "the model registry resolves requested names and aliases to the configured models",
    "every metric is exported in the Prometheus text format on the metrics endpoint",
    "graceful shutdown stops accepting requests and flushes every hot cache to disk",
]


def system_prompt(seed: int) -> str:
    """About 1,000 tokens of instructions and project notes, different for every seed."""
    rng = random.Random(seed)
    lines = [f"You are coding agent number {seed} working in a large repository. Follow these notes."]
    for index in range(31):
        topic = TOPICS[rng.randrange(len(TOPICS))]
        lines.append(f"Note {index + 1}: remember that {topic}; check it before you change any code.")
    return "\n".join(lines)


def file_excerpt(agent: int, turn: int, lines: int) -> str:
    rng = random.Random(agent * 1000 + turn)
    body = [f"# module_{agent}_{turn}.py"]
    for line in range(lines):
        name = f"value_{rng.randrange(1000)}"
        body.append(f"def step_{line}({name}: int) -> int:\n    return {name} * {rng.randrange(2, 9)}")
    return "\n".join(body)


@dataclass
class TurnRecord:
    server: str
    agents: int
    agent: int
    turn: int
    after_restart: bool
    kind: str  # "user" or "tool_result"
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    request_id: str = ""
    server_ttft_s: float | None = None  # semantic's own log: where the client's TTFT went
    server_handled_s: float | None = None
    server_engine_wait_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between the reply's streamed chunks


@dataclass
class AgentSession:
    """One agent's history; `turn_messages` adds the next scripted turn's messages."""

    index: int
    shared_prompt: bool
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        seed = 0 if self.shared_prompt else 100 + self.index
        self.messages.append({"role": "system", "content": system_prompt(seed)})

    def next_turn(self, turn: int) -> str:
        """Append the next turn's input; returns its kind. Tool turns follow a scripted call."""
        if turn in (1, 4):
            call_id = f"call_{self.index}_{turn}"
            path = f"src/module_{self.index}_{turn}.py"
            self.messages.append(
                {
                    "role": "assistant",
                    "content": f"I will read {path}.",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "read_file", "arguments": json.dumps({"path": path})},
                        }
                    ],
                }
            )
            self.messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": file_excerpt(self.index, turn, 16)}
            )
            return "tool_result"
        question = (
            f"Turn {turn}: here is the next part of the task. Read this code and tell me in one short "
            f"paragraph what it does and what you would change.\n{file_excerpt(self.index, turn, 5)}"
        )
        self.messages.append({"role": "user", "content": question})
        return "user"


async def chat_turn(
    http: aiohttp.ClientSession, server: Server, session: AgentSession, n_agents: int, request_id: str
) -> dict[str, Any]:
    body = {
        "model": server.model,
        "messages": session.messages,
        "stream": True,
        "temperature": 0,
        "max_tokens": REPLY_TOKENS,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": f"replay-{n_agents}-{session.index}", "x-request-id": request_id}
    start = time.perf_counter()
    ttft: float | None = None
    chunk_times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with http.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{server.name} answered {reply.status}: {await reply.text()}")
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    chunk_times.append(time.perf_counter())
                    ttft = ttft or chunk_times[-1] - start
                    text.append(choice["delta"]["content"])
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return {
        "text": "".join(text),
        "ttft_s": ttft if ttft is not None else latency,
        "latency_s": latency,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "reused_tokens": details.get("cached_tokens", 0) or 0,
        "generated_tokens": usage.get("completion_tokens", 0),
        "request_id": request_id,
        "gaps_s": [round(b - a, 4) for a, b in itertools.pairwise(chunk_times)],
    }


async def run_agent_turns(
    server: Server, sessions: list[AgentSession], turns: range, after_restart: bool, n_agents: int
) -> list[TurnRecord]:
    records: list[TurnRecord] = []

    async def agent(session: AgentSession) -> None:
        rng = random.Random(session.index)
        await asyncio.sleep(rng.uniform(*TOOL_TIME_S))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
            for turn in turns:
                kind = session.next_turn(turn)
                request_id = f"replay-{n_agents}-{session.index}-{turn}"  # n_agents 0: the warm-up
                result = await chat_turn(http, server, session, n_agents, request_id)
                session.messages.append({"role": "assistant", "content": result.pop("text")})
                records.append(
                    TurnRecord(server.name, n_agents, session.index, turn, after_restart, kind, **result)
                )
                await asyncio.sleep(rng.uniform(*TOOL_TIME_S))

    await asyncio.gather(*(agent(session) for session in sessions))
    return records


async def warm_up(server: Server, n_agents: int) -> None:
    """As many agents of another workload take one turn together, unmeasured. On a GPU, MLX
    compiles a kernel the first time a shape needs it (seconds for a batch of a new size) and keeps
    it in a cache on disk that every later process reads: without this, whichever server runs
    first pays for both. Their system prompts share nothing with the replay's: no cache is reused."""
    sessions = [AgentSession(WARM_UP_AGENT + index, shared_prompt=False) for index in range(n_agents)]
    await run_agent_turns(server, sessions, range(1), False, 0)


def replay(server: Server, n_agents: int, turns: int) -> dict[str, Any]:
    """One server, `n_agents` agents: turns before the restart, restart, the rest. Each start is
    followed by an unmeasured warm-up."""
    sessions = [AgentSession(index, shared_prompt=index % 2 == 0) for index in range(n_agents)]
    half = turns // 2
    server.start()
    try:
        asyncio.run(warm_up(server, n_agents))
        start = time.perf_counter()
        records = asyncio.run(run_agent_turns(server, sessions, range(half), False, n_agents))
        before_restart = time.perf_counter() - start
        restart_start = time.perf_counter()
        server.stop()
        server.start()
        restart_s = time.perf_counter() - restart_start
        asyncio.run(warm_up(server, n_agents))
        start = time.perf_counter()
        records += asyncio.run(run_agent_turns(server, sessions, range(half, turns), True, n_agents))
        after_restart = time.perf_counter() - start
    finally:
        server.stop()
    timings = server.request_timings()
    for record in records:
        timing = timings.get(record.request_id, {})
        record.server_ttft_s = timing.get("ttft_s")
        record.server_handled_s = timing.get("handled_s")
        record.server_engine_wait_s = timing.get("engine_wait_s")
    return summarise(records, before_restart + after_restart, restart_s)


def summarise(records: list[TurnRecord], wall_s: float, restart_s: float) -> dict[str, Any]:
    returning = [
        r for r in records if r.turn > 0 and not (r.after_restart and r.turn == first_after(records))
    ]
    after = [r for r in records if r.after_restart and r.turn == first_after(records)]
    prompt = sum(r.prompt_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)
    generated = sum(r.generated_tokens for r in records)
    gaps = [g for r in records for g in r.gaps_s]
    return {
        "wall_s": round(wall_s, 2),
        "restart_s": round(restart_s, 2),
        "turns": len(records),
        "max_prompt_tokens": max(r.prompt_tokens for r in records),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "generated_tokens": generated,
        "cache_hit_rate": round(reused / prompt, 3) if prompt else 0.0,
        "decode_tokens_per_s": round(generated / wall_s, 2),
        "itl_p50_s": median(gaps),
        "itl_p99_s": round(percentile(gaps, 0.99), 3) if gaps else None,
        "itl_max_s": round(max(gaps), 3) if gaps else None,
        "median_ttft_first_turn_s": median([r.ttft_s for r in records if r.turn == 0]),
        "median_ttft_returning_s": median([r.ttft_s for r in returning]),
        "median_ttft_first_after_restart_s": median([r.ttft_s for r in after]),
        "server_view_of_returning_turns": {
            name: median([v for r in returning if (v := getattr(r, f"server_{name}")) is not None])
            for name in ("ttft_s", "handled_s", "engine_wait_s")
        },
        "records": [asdict(r) for r in records],
    }


def first_after(records: list[TurnRecord]) -> int:
    return min((r.turn for r in records if r.after_restart), default=-1)


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def compare(results: dict[str, dict[str, Any]], agents: list[int]) -> dict[str, Any]:
    """Our figures over mlx_lm.server's, against the targets."""
    comparison: dict[str, Any] = {}
    for n in agents:
        ours, peer = results["semantic"][str(n)], results["mlx_lm.server"][str(n)]
        comparison[str(n)] = {
            "wall_time_ratio": round(ours["wall_s"] / peer["wall_s"], 3),
            "returning_ttft_ratio": round(
                ours["median_ttft_returning_s"] / peer["median_ttft_returning_s"], 3
            ),
            # mlx_lm.server forgets its prompt cache on restart: its first turn after is a cold prefill.
            "after_restart_ttft_over_cold": round(
                ours["median_ttft_first_after_restart_s"] / peer["median_ttft_first_after_restart_s"], 3
            ),
        }
    top = comparison[str(max(agents))]
    comparison["targets"] = {
        "agents": max(agents),
        "wall_time_at_most_0.45": top["wall_time_ratio"] <= 0.45,
        "returning_ttft_at_most_0.2": top["returning_ttft_ratio"] <= 0.2,
        "after_restart_ttft_at_most_eighth_of_cold": top["after_restart_ttft_over_cold"] <= 0.125,
    }
    return comparison


def plot(results: dict[str, dict[str, Any]], agents: list[int], name: str) -> list[Path]:
    """The TTFT-per-turn and throughput plots, named after the results file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(agents)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for server, style in (("semantic", "o-"), ("mlx_lm.server", "s--")):
        records = results[server][str(n)]["records"]
        turns = sorted({r["turn"] for r in records})
        ttft = [statistics.median(r["ttft_s"] for r in records if r["turn"] == t) for t in turns]
        ax.plot([t + 1 for t in turns], ttft, style, label=server)
    restart_turn = results["semantic"][str(n)]["records"]
    first = min(r["turn"] for r in restart_turn if r["after_restart"]) + 1
    ax.axvline(first - 0.5, color="grey", linestyle=":", label="server restart")
    ax.set(xlabel="turn", ylabel="median time to first token (s)", yscale="log")
    ax.set_title(f"{n} agents replaying ~3,000-token sessions (SmolLM2-135M, same machine)")
    ax.legend()
    ttft_path = RESULTS / f"{name}_ttft.png"
    fig.tight_layout()
    fig.savefig(ttft_path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for server, style in (("semantic", "o-"), ("mlx_lm.server", "s--")):
        throughput = [results[server][str(a)]["decode_tokens_per_s"] for a in agents]
        ax.plot(agents, throughput, style, label=server)
    ax.set(xlabel="concurrent agents", ylabel="generated tokens / wall second", xticks=agents)
    ax.set_title("Replay throughput")
    ax.legend()
    throughput_path = RESULTS / f"{name}_throughput.png"
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=120)
    plt.close(fig)
    return [ttft_path, throughput_path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prefill-stall-ratio", help="semantic's --prefill-stall-ratio (default: its own)")
    parser.add_argument("--short-turn-tokens", help="semantic's --short-turn-tokens (default: its own)")
    parser.add_argument("--output", default="agent_replay", help="results file name, without .json")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs in this folder")
    parser.add_argument(
        "--semantic-only", action="store_true", help="skip mlx_lm.server (a check against an earlier run)"
    )
    args = parser.parse_args()
    semantic_args = ("--prefill-stall-ratio", args.prefill_stall_ratio) if args.prefill_stall_ratio else ()
    if args.short_turn_tokens:
        semantic_args += ("--short-turn-tokens", args.short_turn_tokens)
    model_dir = ensure_default_model()
    results: dict[str, dict[str, Any]] = {"semantic": {}, "mlx_lm.server": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for n in args.agents:
            servers: list[Server] = [
                Semantic(model_dir, Path(scratch) / f"semantic-{n}", *semantic_args),
                MlxLmServer(model_dir, Path(scratch) / "logs", REPLY_TOKENS),
            ][: 1 if args.semantic_only else 2]
            for server in servers:
                print(f"{server.name}: {n} agents ...", file=sys.stderr, flush=True)
                results[server.name][str(n)] = replay(server, n, args.turns)
                figures = {k: v for k, v in results[server.name][str(n)].items() if k != "records"}
                print(json.dumps(figures), file=sys.stderr, flush=True)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in Path(scratch).rglob("*.log"):
                shutil.copy(log, args.logs / f"{log.parent.name}-{log.name}")
    if args.semantic_only:
        write_results(args.output, {"model": model_dir.name, "servers": results})
        return
    plots = plot(results, args.agents, args.output)
    write_results(
        args.output,
        {
            "model": model_dir.name,
            "workload": {
                "agents": args.agents,
                "turns": args.turns,
                "reply_tokens": REPLY_TOKENS,
                "semantic_prefill_stall_ratio": args.prefill_stall_ratio or "default",
                "semantic_short_turn_tokens": args.short_turn_tokens or "default",
            },
            "comparison": compare(results, args.agents),
            "plots": [str(p.relative_to(ROOT)) for p in plots],
            "servers": results,
        },
    )


if __name__ == "__main__":
    main()
