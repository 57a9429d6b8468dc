"""Per-step overhead on the fast regime: semantic's HTTP decode against mlx-lm's, where a step is cheap.

A random-weight Llama built from mlx-lm's own classes (2 layers, hidden 64, 4 heads, 2 KV heads,
head_dim 16, intermediate 256, float32) with the default model's tokenizer takes a few milliseconds
a step, so what a server does around each step decides its speed (issue 66). In one run, the order
of the measurements reversed every other round, each round measures:

1. mlx-lm's in-process `stream_generate`, one greedy stream of `--tokens` tokens;
2. semantic over HTTP (OpenAI chat, stream, temperature 0), one stream of the same length;
3. mlx_lm.server, the same request;
4. `--streams` concurrent streams (different prompts) through semantic, then through mlx_lm.server.

One stream's decode rate is (tokens - 1) / (last token's time - first token's time): mlx-lm's own
`generation_tps` definition, measured from the client side for the servers (tokens from the reply's
usage, times from the first and last SSE chunks with content). The concurrent figure is the
streams' tokens after each one's first, over the wall from the earliest first token to the latest
last token. A random model seldom emits EOS, but every rate uses the reply's real token count.

Writes bench/results/step_overhead.json (every sample, the medians and the ratios issue 66 asks
for) and bench/results/step_overhead.png. `--profile` (needs py-spy) then samples the semantic
server for 10 s while single streams decode and prints its engine thread's top functions.

    python -m semantic.launch .venv/bin/python -m bench.step_overhead [--rounds 5] [--tokens 256]
        [--streams 8] [--semantic-args "--speculate off"] [--semantic-only] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.generate import stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper

from bench.batching import TOPICS
from bench.common import RESULTS, write_results
from bench.http_profile import _PATH_PREFIX, RATE_HZ, py_spy, record
from bench.servers import MlxLmServer, Semantic, Server
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ROOT
from tests.tiny_models import write_random_model

FAST_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,  # tied, random weights make greedy replies repeat one token
}
PROFILE_S = 10
TOP_FUNCTIONS = 25
ENGINE_THREAD = "semantic-engine"


@dataclass(slots=True)
class Stream:
    """One reply's token count and the times (perf_counter, s) its first and last tokens arrived."""

    num_tokens: int
    first_token_s: float
    last_token_s: float

    @property
    def decode_tok_s(self) -> float:
        return (self.num_tokens - 1) / (self.last_token_s - self.first_token_s)


def prompt_text(i: int) -> str:
    return f"Write a long essay about {TOPICS[i % len(TOPICS)]}."


def aggregate_tok_s(streams: list[Stream]) -> float:
    wall_s = max(s.last_token_s for s in streams) - min(s.first_token_s for s in streams)
    return sum(s.num_tokens - 1 for s in streams) / wall_s


def in_process(model: nn.Module, tokenizer: TokenizerWrapper, max_tokens: int) -> Stream:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(0)}], add_generation_prompt=True
    )
    first_token_s = last_token_s = 0.0
    num_tokens = 0
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        last_token_s = time.perf_counter()
        if num_tokens == 0:
            first_token_s = last_token_s
        num_tokens = response.generation_tokens
    return Stream(num_tokens, first_token_s, last_token_s)


async def http_stream(session: aiohttp.ClientSession, server: Server, i: int, max_tokens: int) -> Stream:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt_text(i)}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
    }
    first_token_s = last_token_s = 0.0
    num_tokens = 0
    async with session.post(f"{server.base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices") or []):
                first_token_s = first_token_s or now
                last_token_s = now
    assert num_tokens > 1 and first_token_s, f"{server.name} sent no usage or no content"
    return Stream(num_tokens, first_token_s, last_token_s)


def http_streams(server: Server, num_streams: int, max_tokens: int) -> list[Stream]:
    async def run() -> list[Stream]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return list(
                await asyncio.gather(
                    *(http_stream(session, server, i, max_tokens) for i in range(num_streams))
                )
            )

    return asyncio.run(run())


def http_measure(server: Server, num_streams: int, max_tokens: int) -> Callable[[], list[Stream]]:
    return lambda: http_streams(server, num_streams, max_tokens)


def profile_engine(server: Semantic, max_tokens: int, scratch: Path) -> dict[str, Any]:
    """py-spy on the semantic server while single streams decode back to back: each thread's share
    of the samples, and the engine thread's top functions by self (leaf) and inclusive samples."""
    spy = py_spy()
    if spy is None or server.process.proc is None:
        return {"error": "py-spy not found"}
    stacks = scratch / "step_overhead_profile.txt"
    proc = record(spy, server.process.proc.pid, stacks, PROFILE_S, "--threads")
    rates, stop = [], time.monotonic() + PROFILE_S + 1
    while time.monotonic() < stop:
        rates.append(round(http_streams(server, 1, max_tokens)[0].decode_tok_s, 1))
    _, errors = proc.communicate(timeout=60)
    if proc.returncode or not stacks.exists():
        return {"error": errors.decode(errors="replace")[-500:], "tok_s_while_profiled": rates}
    return {"tok_s_while_profiled": rates, **summarise(stacks)}


def summarise(stacks: Path) -> dict[str, Any]:
    # "step (engine/x.py:12)" -> "step (engine/x.py)": one entry per function, not per line
    def function(frame: str) -> str:
        frame = _PATH_PREFIX.sub("(", frame).replace(f"({ROOT}/", "(")
        head, _, _ = frame.rpartition(":")
        return f"{head})" if head else frame

    thread_samples: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        thread = thread.split(": ", 1)[-1]
        thread_samples[thread] += int(count)
        if thread != ENGINE_THREAD or not frames:
            continue
        functions = [function(f) for f in frames]
        leaf[functions[-1]] += int(count)
        for name in set(functions):  # once per stack: recursion counts a sample once
            inclusive[name] += int(count)
    engine_samples = thread_samples[ENGINE_THREAD] or 1

    def top(counter: collections.Counter[str]) -> dict[str, float]:
        return {name: round(n / engine_samples, 3) for name, n in counter.most_common(TOP_FUNCTIONS)}

    return {
        "samples_per_thread": dict(thread_samples.most_common()),
        "engine_busy_share": round(thread_samples[ENGINE_THREAD] / (RATE_HZ * PROFILE_S), 3),
        "engine_top_leaf": top(leaf),
        "engine_top_inclusive": top(inclusive),
    }


def measure_rounds(
    measures: dict[str, Callable[[], list[Stream]]], rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """Every measurement once to warm up, then `rounds` times, the order reversed every other round
    so the machine's drift over minutes falls on every side alike."""
    for measure in measures.values():  # first use compiles kernels and fills caches on every side
        measure()
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in measures}
    for round_ in range(rounds):
        for name in list(measures) if round_ % 2 == 0 else list(reversed(measures)):
            streams = measures[name]()
            rate = streams[0].decode_tok_s if len(streams) == 1 else aggregate_tok_s(streams)
            tokens = [s.num_tokens for s in streams]
            samples[name].append({"round": round_, "tok_s": round(rate, 1), "tokens": tokens})
            print(f"round {round_} {name}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    return samples


def median_of(samples: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(s[key] for s in samples), 1)


def plot(medians: dict[str, float | None], num_streams: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {name: value for name, value in medians.items() if value is not None}
    figure, axis = plt.subplots(figsize=(7, 4))
    colours = [
        "#888888" if "stream_generate" in n else "#1f77b4" if "semantic" in n else "#ff7f0e" for n in bars
    ]
    axis.bar(range(len(bars)), list(bars.values()), color=colours)
    labels = [f"{n.rsplit(' ', 1)[0]}\n{n.rsplit(' ', 1)[1]} stream(s)" for n in bars]
    axis.set_xticks(range(len(bars)), labels, fontsize=8)
    for x, value in enumerate(bars.values()):
        axis.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom", fontsize=8)
    axis.set_ylabel("decode tokens/s (median)")
    axis.set_title(f"Fast regime (2-layer, hidden-64 random Llama): 1 stream and {num_streams} streams")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every measurement")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams in the aggregate")
    parser.add_argument(
        "--semantic-args",
        # Drafts off: this measures a step's overhead, and a random model's loops are all drafts.
        default="--speculate off",
        help='semantic serve\'s extra args: "--prefill-step-size 512"; one flag: --semantic-args=--flag',
    )
    parser.add_argument("--semantic-only", action="store_true", help="skip mlx_lm.server")
    parser.add_argument("--profile", action="store_true", help="py-spy the semantic server after the rounds")
    parser.add_argument("--output", default="step_overhead", help="results file name, without .json")
    args = parser.parse_args()
    extra = shlex.split(args.semantic_args)
    with tempfile.TemporaryDirectory(prefix="semantic-step-") as tmp:
        scratch = Path(tmp)
        tokenizer_dir = ensure_default_model("float32")
        model_dir = write_random_model(dict(FAST_LLAMA), scratch / "fast-llama", tokenizer_dir)
        model, tokenizer = load(str(model_dir))[:2]
        servers: dict[str, Server] = {"semantic": Semantic(model_dir, scratch / "semantic", *extra)}
        if not args.semantic_only:
            servers["mlx_lm.server"] = MlxLmServer(model_dir, scratch / "logs", args.tokens)
        measures: dict[str, Callable[[], list[Stream]]] = {
            "stream_generate 1": lambda: [in_process(model, tokenizer, args.tokens)]
        }
        for name, server in servers.items():
            for num_streams in (1, args.streams):
                measures[f"{name} {num_streams}"] = http_measure(server, num_streams, args.tokens)
        profile: dict[str, Any] | None = None
        with contextlib.ExitStack() as running:
            for server in servers.values():
                # start() holds the process before it waits for it, so a failed start is stopped too
                running.callback(server.stop)
                server.start()
            samples = measure_rounds(measures, args.rounds)
            if args.profile:
                semantic = servers["semantic"]
                assert isinstance(semantic, Semantic)
                profile = profile_engine(semantic, args.tokens, scratch)
    medians: dict[str, float | None] = {name: median_of(rows, "tok_s") for name, rows in samples.items()}
    n = args.streams

    def ratio(ours: str, theirs: str) -> float | None:
        a, b = medians.get(ours), medians.get(theirs)
        return round(a / b, 3) if a and b else None

    ratios = {
        "semantic_1_over_stream_generate": ratio("semantic 1", "stream_generate 1"),
        "semantic_1_over_mlx_lm_server_1": ratio("semantic 1", "mlx_lm.server 1"),
        f"semantic_{n}_over_mlx_lm_server_{n}": ratio(f"semantic {n}", f"mlx_lm.server {n}"),
    }
    plot_path = RESULTS / f"{args.output}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(medians, n, plot_path)
    results: dict[str, Any] = {
        "model": {**FAST_LLAMA, "dtype": "float32", "weights": "random", "tokenizer": tokenizer_dir.name},
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "output"},
            "order": "reversed every other round",
        },
        "medians_tok_s": medians,
        "ratios": ratios,
        "samples": samples,
        "plot": str(plot_path.relative_to(ROOT)),
    }
    if profile is not None:
        results["profile"] = profile
    write_results(args.output, results)
    if profile is not None and "engine_top_leaf" in profile:
        for title in ("engine_top_leaf", "engine_top_inclusive"):
            print(f"\n{title} (share of the engine thread's samples):")
            for name, share in profile[title].items():
                print(f"  {share:6.1%}  {name}")


if __name__ == "__main__":
    main()
