"""Speculative decoding on code editing and free-form chat: semantic `--speculate off` against
`--speculate ngram`, with mlx_lm.server as the peer, on the same model, machine and requests.

Two workloads, N agents at once (3 by default), one streamed OpenAI chat request each, temperature 0:
- edit: a generated ~300-line Python module (distinct per agent) and a request to return the whole
  file with three small changes (rename a function, change a constant, fix a misspelt comment);
  max_tokens is the file's length in tokens plus 10%.
- chat: an open question without a file, `--chat-tokens` (256) at most.
The three servers run side by side (each with its own cache directory; an idle one takes no CPU)
and take turns: each workload is run `--rounds` times (chat 5, edit 1 by default), every server once
per round, in reverse order every other round, so that the machine's drift (this 2-core VM's speed
moves 10-20% over minutes) falls on all three alike. Per round: wall time, decode tokens/s (tokens
after the first, over first token to last, across agents and per agent), TTFT, and for semantic
the speculative counters' deltas on /metrics (acceptance, drafted per generated token). A run's
figures are its median round's; the ratios are the medians of the rounds' own ratios. The `off`
and `ngram` replies must be byte-identical, agent by agent and round by round (any difference
exits 1).

Prompt shape, measured first on the default model (SmolLM2-135M-Instruct, greedy): "copied" is the
share of the reply's lines found in the file, "covered" the share of the file's lines in the reply.
On a 65-line file (600 tokens), with a system prompt asking for the whole file in one code block:
the file fenced in the user turn, request after it: 0.00 copied (prose); request before it: 0.00;
no system prompt: 0.00; the file unfenced: 0.29 copied, 0.18 covered; the file in the system prompt:
0.90 / 0.18 (only `main` comes back, 10 lines); a one-shot edit example first: 0.15 / 0.18; the
request naming the first line to start from: 0.02 (it makes code up); a plain "copy it exactly":
0.82 / 0.18 on one seed, 0.01 on another. Best: the file as the agent's own earlier reply, the
request in the next user turn (used here): 0.89 copied, 0.33 covered, 92% of the reply's token
4-grams in the file. The model copies the module header (imports, constants) and then `main` or
one function, then stops or repeats itself; it copies no whole file at any size tried. With that
shape, copied / covered per seed (0, 1, 2): 100 lines 0.42/0.15, 0.57/0.17, 0.78/0.30; 150 lines
0.10/0.18, 0.69/0.20, 0.04/0.18; 200 lines 0.11/0.16, 0.72/0.20, 0.00/0.01; 300 lines (2,900
tokens) 0.44/0.13, 0.61/0.17, 0.54/0.17, replies of 3,218 (to max_tokens: a function repeated with
new suffixes), 471 and 132 tokens (the header and a function, or the renamed function alone). No
shorter file copies better, so the default stays at the issue's 300 lines, and the edit workload's
long reply is the model repeating its own lines more than copying the file: its speed-up says what
n-gram drafts do for repetitive output, not yet for a model that copies the whole file.

    python -m semantic.launch .venv/bin/python -m bench.speculative_edit [--agents 3] [--lines 300]
        [--chat-tokens 256] [--chat-rounds 5] [--edit-rounds 1] [--output speculative_edit]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import RESULTS, write_results
from bench.servers import MlxLmServer, Semantic, Server
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ROOT

SYSTEM_PROMPT = (
    "You are a careful coding assistant. When asked to edit a file, reply with the whole edited file "
    "in one ```python code block, every line included, and nothing else."
)
QUESTIONS = [
    "Why do some programming languages use garbage collection and others do not?",
    "What makes a good code review, and what should a reviewer look for first?",
    "How would you explain the difference between a process and a thread to a new developer?",
    "What are the trade-offs between a monorepo and many small repositories?",
    "Why is naming hard in software, and how do good teams get better at it?",
    "What should a team measure before deciding to rewrite an old service?",
    "How do caches go wrong in web applications, and how do you notice?",
    "When is it worth writing a test before the code it tests?",
]
DRAFTED = "semantic_speculative_drafted_tokens_total"
ACCEPTED = "semantic_speculative_accepted_tokens_total"
RUNS = ("off", "ngram", "mlx_lm.server")


NOUNS = ["order", "invoice", "ticket", "sensor", "packet", "account", "report", "session", "upload", "route"]
VERBS = ["load", "parse", "validate", "merge", "render", "score", "flush", "resolve", "encode", "prune"]
FIELDS = ["name", "size", "owner", "created_at", "status", "weight", "region", "priority", "tags", "limit"]


HEADER = '''"""Helpers for {noun} records: loading, checking and summarising them (module {seed})."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAX_{NOUN}S = {max_count}
RETRY_LIMIT = {retries}
DEFAULT_REGION = {region!r}
TIMEOUT_S = {timeout}.0
'''
MAIN = '''

def main(path: str) -> None:
    """Load the {noun}s in `path` and log a summary of them."""
    # the records are recieved as one JSON list per file
    records = json.loads(Path(path).read_text())
    log.info('%d {noun}s, limit %d', len(records), MAX_{NOUN}S)
    for record in records[:RETRY_LIMIT]:
        print(record.get('name', DEFAULT_REGION))


if __name__ == "__main__":
    main("data.json")
'''
CLASS = '''

@dataclass
class {name}:
    """A {noun} {kind} kept in memory."""

{fields}
    items: list[dict[str, int]] = field(default_factory=list)
'''
METHOD = '''
    def {verb}_{noun}(self, item: dict[str, int]) -> int:
        """{Verb} one {noun} and return its new {key}."""
        value = item.get({key!r}, self.{key}) + {step}
        if value > MAX_{NOUN}S:
            log.warning('{verb} %s: %d over the limit', {name!r}, value)
            value = MAX_{NOUN}S
        self.items.append(item)
        return value
'''
FUNCTION = '''

def {verb}_{noun}_{key}_{index}(records: list[dict[str, int]], factor: int = {factor}) -> int:
    """{Verb} the {key} of every {noun} and return the total, scaled by `factor`."""
    total = 0
    for record in records:
        # a record without {key} counts as its {other}
        total += record.get({key!r}, record.get({other!r}, 0)) * factor
        if total > MAX_{NOUN}S * TIMEOUT_S:
            break
    return total
'''


def source_file(seed: int, num_lines: int) -> str:
    """A deterministic Python module of about `num_lines` lines, distinct per seed: constants,
    dataclasses with methods, helper functions, docstrings and comments, and one misspelt comment
    ("recieved") for the edit to fix."""
    rng = random.Random(seed)
    noun = NOUNS[seed % len(NOUNS)]
    words = {"noun": noun, "NOUN": noun.upper()}
    region = ["eu-west", "us-east", "ap-south"]
    text = HEADER.format(
        seed=seed, max_count=rng.randrange(50, 500), retries=rng.randrange(2, 9),
        region=rng.choice(region), timeout=rng.randrange(5, 60), **words,
    )  # fmt: skip
    for index in itertools.count():
        block = _class_block(rng, index, words) if index % 3 == 0 else _function_block(rng, index, words)
        if index > 0 and (text + block).count("\n") > num_lines - 12:
            break
        text += block
    return text + MAIN.format(**words)


def _class_block(rng: random.Random, index: int, words: dict[str, str]) -> str:
    kind = rng.choice(["Store", "Index", "Batch", "Queue", "Cache"])
    name = f"{words['noun'].title()}{kind}{index}"
    keys = rng.sample(FIELDS, 3)
    fields = "\n".join(f"    {key}: int = {rng.randrange(0, 100)}" for key in keys)
    text = CLASS.format(name=name, kind=f"{kind.lower()}{index}", fields=fields, **words)
    for verb in rng.sample(VERBS, 3):
        key = rng.choice(keys)
        text += METHOD.format(
            verb=verb, Verb=verb.title(), key=key, step=rng.randrange(1, 20), name=name, **words
        )
    return text


def _function_block(rng: random.Random, index: int, words: dict[str, str]) -> str:
    verb = rng.choice(VERBS)
    key, other = rng.sample(FIELDS, 2)
    factor = rng.randrange(2, 9)
    return FUNCTION.format(
        verb=verb, Verb=verb.title(), key=key, other=other, index=index, factor=factor, **words
    )


def edit_messages(source: str) -> list[dict[str, Any]]:
    """The file as the agent's own earlier reply, then the edit request: of the shapes tried, the
    one the default model copies furthest (see the module docstring)."""
    names = [line[4:].split("(")[0] for line in source.splitlines() if line.startswith("def ")]
    renamed = next((n for n in names if n != "main"), "main")
    request = (
        f"Return the whole file with three small changes: rename the function `{renamed}` to "
        f"`{renamed}_v2`, change RETRY_LIMIT to 12, and fix the spelling of 'recieved' in a comment. "
        "Keep every other line exactly as it is."
    )
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Write app.py, a module of helpers for these records."},
        {"role": "assistant", "content": f"```python\n{source}```"},
        {"role": "user", "content": request},
    ]


def workloads(
    n_agents: int, num_lines: int, chat_tokens: int, model_dir: Path
) -> dict[str, list[dict[str, Any]]]:
    """Each workload's requests, one per agent: messages, max_tokens and (edit) the source file."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    edits = []
    for agent in range(n_agents):
        source = source_file(agent, num_lines)
        file_tokens = len(tokenizer(source)["input_ids"])
        edits.append(
            {"messages": edit_messages(source), "max_tokens": int(file_tokens * 1.1), "source": source}
        )
    chats = [
        {
            "messages": [{"role": "user", "content": QUESTIONS[agent % len(QUESTIONS)]}],
            "max_tokens": chat_tokens,
        }
        for agent in range(n_agents)
    ]
    return {"edit": edits, "chat": chats}


async def ask(
    http: aiohttp.ClientSession, server: Server, request: dict[str, Any], session_id: str
) -> dict[str, Any]:
    """One streamed request: its text, token count and the times of its first and last token."""
    body = {
        "model": server.model,
        "messages": request["messages"],
        "stream": True,
        "temperature": 0,
        "max_tokens": request["max_tokens"],
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    headers = {"x-session-id": session_id}
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
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["delta"]["content"])
    end = time.perf_counter()
    first, last = first or end, last or end
    return {
        "text": "".join(text),
        "start": start,
        "first": first,
        "last": last,
        "end": end,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "generated_tokens": usage.get("completion_tokens", 0),
    }


def speculative_counters(server: Server) -> dict[str, float] | None:
    """The drafted and accepted totals on semantic's /metrics; None where it has none."""
    if not isinstance(server, Semantic):
        return None
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (DRAFTED, ACCEPTED):
            counters[name] = float(value)
    return counters if len(counters) == 2 else None


def run_workload(server: Server, name: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """All agents' requests at once; the run's figures and each agent's."""

    async def all_agents() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
            asks = [ask(http, server, r, f"spec-{name}-{i}") for i, r in enumerate(requests)]
            return list(await asyncio.gather(*asks))

    before = speculative_counters(server)
    start = time.perf_counter()
    replies = asyncio.run(all_agents())
    wall_s = time.perf_counter() - start
    after = speculative_counters(server)
    agents = []
    for request, reply in zip(requests, replies, strict=True):
        decode_s = reply["last"] - reply["first"]
        decode_tokens = max(0, reply["generated_tokens"] - 1)  # the first token comes from the prefill
        agent = {
            "prompt_tokens": reply["prompt_tokens"],
            "generated_tokens": reply["generated_tokens"],
            "ttft_s": round(reply["first"] - reply["start"], 3),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
            "text": reply["text"],
        }
        if "source" in request:
            agent |= copy_fidelity(request["source"], reply["text"])
        agents.append(agent)
    decode_window_s = max(r["last"] for r in replies) - min(r["first"] for r in replies)
    decode_tokens = sum(max(0, r["generated_tokens"] - 1) for r in replies)
    figures: dict[str, Any] = {
        "wall_s": round(wall_s, 2),
        "generated_tokens": sum(r["generated_tokens"] for r in replies),
        "decode_tokens_per_s": round(decode_tokens / decode_window_s, 2) if decode_window_s > 0 else None,
        "median_ttft_s": round(statistics.median(a["ttft_s"] for a in agents), 3),
    }
    if before is not None and after is not None:
        drafted = after[DRAFTED] - before[DRAFTED]
        accepted = after[ACCEPTED] - before[ACCEPTED]
        figures["drafted_tokens"] = int(drafted)
        figures["accepted_tokens"] = int(accepted)
        figures["acceptance_rate"] = round(accepted / drafted, 3) if drafted else None
        figures["drafted_per_generated_token"] = round(drafted / max(1, figures["generated_tokens"]), 3)
    return {**figures, "agents": agents}


def copy_fidelity(source: str, reply: str) -> dict[str, float]:
    """How much of the file the reply copies: its lines found in the file, the file's lines it holds."""
    file_lines = [line.rstrip() for line in source.splitlines() if line.strip()]
    reply_lines = [
        line.rstrip() for line in reply.splitlines() if line.strip() and not line.startswith("```")
    ]
    in_file, in_reply = set(file_lines), set(reply_lines)
    return {
        "reply_lines_in_file": round(
            sum(line in in_file for line in reply_lines) / max(1, len(reply_lines)), 3
        ),
        "file_lines_in_reply": round(sum(line in in_reply for line in file_lines) / len(file_lines), 3),
    }


def run_servers(
    servers: dict[str, Server], work: dict[str, list[dict[str, Any]]], rounds: dict[str, int]
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every server started and warmed up (an unmeasured request), then each workload's rounds, each
    server once per round, in reverse order every other round; each run's rounds by workload."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {run: {} for run in servers}
    try:
        for run, server in servers.items():
            print(f"starting {run} ...", file=sys.stderr, flush=True)
            server.start()
            warm_up = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
            run_workload(server, "warm-up", [warm_up])
        for name, requests in work.items():
            for round_index in range(rounds[name]):
                order = list(servers.items())  # reversed every other round: a drift falls on both sides
                for run, server in order if round_index % 2 == 0 else order[::-1]:
                    figures = run_workload(server, f"{name}-{round_index}", requests)
                    results[run].setdefault(name, []).append(figures)
                    shown = {k: v for k, v in figures.items() if k != "agents"}
                    print(run, name, round_index, json.dumps(shown), file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return results


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median decode tokens/s (the lower middle of an even count), with every
    round's decode tokens/s."""
    ordered = sorted(rounds, key=lambda r: r["decode_tokens_per_s"] or 0)
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, "rounds_decode_tokens_per_s": [r["decode_tokens_per_s"] for r in rounds]}


def compare(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """ngram over off (and over the peer) per workload, the median of the rounds' own ratios; the
    byte-identical check and the targets."""
    comparison: dict[str, Any] = {}
    for workload in ("edit", "chat"):
        off, ngram, peer = (results[run][workload] for run in RUNS)
        identical = [
            a["text"] == b["text"]
            for off_round, ngram_round in zip(off, ngram, strict=True)
            for a, b in zip(off_round["agents"], ngram_round["agents"], strict=True)
        ]
        over_off = [round_ratio(b, a) for a, b in zip(off, ngram, strict=True)]
        over_peer = [round_ratio(b, a) for a, b in zip(peer, ngram, strict=True)]
        comparison[workload] = {
            "ngram_over_off_decode": statistics.median(r or 0 for r in over_off),
            "ngram_over_mlx_lm_server_decode": statistics.median(r or 0 for r in over_peer),
            "rounds_ngram_over_off_decode": over_off,
            "identical": identical,
        }
    comparison["targets"] = {
        "edit_decode_at_least_2x": (comparison["edit"]["ngram_over_off_decode"] or 0) >= 2.0,
        "chat_decode_at_least_0.97x": (comparison["chat"]["ngram_over_off_decode"] or 0) >= 0.97,
        "greedy_replies_identical": all(all(comparison[w]["identical"]) for w in ("edit", "chat")),
    }
    return comparison


def round_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    return ratio(a["decode_tokens_per_s"], b["decode_tokens_per_s"])


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def plot(results: dict[str, dict[str, Any]], name: str) -> Path:
    """Decode tokens/s per workload (each run's median round), one bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_shown = ("edit", "chat")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.26
    for offset, run in enumerate(RUNS):
        values = [results[run][w]["decode_tokens_per_s"] or 0 for w in workloads_shown]
        label = run if run == "mlx_lm.server" else f"semantic --speculate {run}"
        bars = ax.bar([i + (offset - 1) * width for i in range(2)], values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(2), ["code edit (return the file)", "free-form chat"])
    ax.set(ylabel="decode tokens/s, all agents")
    ax.set_title("N-gram speculative decoding (SmolLM2-135M, same machine, same requests)")
    ax.legend()
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--lines", type=int, default=300, help="lines of each agent's source file")
    parser.add_argument("--chat-tokens", type=int, default=256, help="max_tokens of the chat replies")
    parser.add_argument("--chat-rounds", type=int, default=5, help="rounds of the chat workload")
    parser.add_argument("--edit-rounds", type=int, default=1, help="rounds of the edit workload")
    parser.add_argument("--output", default="speculative_edit", help="results file name, without .json")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    work = workloads(args.agents, args.lines, args.chat_tokens, model_dir)
    rounds = {"edit": args.edit_rounds, "chat": args.chat_rounds}
    bench_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        most_tokens = max(r["max_tokens"] for requests in work.values() for r in requests)
        servers: dict[str, Server] = {
            run: Semantic(model_dir, Path(scratch) / run, "--speculate", run) for run in ("off", "ngram")
        }
        servers["mlx_lm.server"] = MlxLmServer(model_dir, Path(scratch) / "logs", most_tokens)
        rounds_by_run = run_servers(servers, work, rounds)
    comparison = compare(rounds_by_run)
    results = {run: {name: median_round(r) for name, r in by.items()} for run, by in rounds_by_run.items()}
    write_results(
        args.output,
        {
            "model": model_dir.name,
            "workload": {
                "agents": args.agents,
                "lines": args.lines,
                "chat_tokens": args.chat_tokens,
                "rounds": rounds,
                "edit_max_tokens": [r["max_tokens"] for r in work["edit"]],
            },
            "bench_s": round(time.perf_counter() - bench_start, 1),
            "comparison": comparison,
            "plot": str(plot(results, args.output).relative_to(ROOT)),
            "runs": results,
        },
    )
    if not comparison["targets"]["greedy_replies_identical"]:
        sys.exit(f"greedy replies differ between --speculate off and ngram: {json.dumps(comparison)}")


if __name__ == "__main__":
    main()
