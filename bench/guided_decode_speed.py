"""Decode speed of a batch of 8 with guided tool calls on and off (`--tool-calls guided|free`).

The same 8 turns (bench/tool_calls.py's: a recorded Claude Code sub-agent turn, each with its own
file path, four tools) go at once, greedy, to a server started with `--tool-calls guided` and to
one started with `--tool-calls free`. Both are started and warmed (one unmeasured turn caches the
shared prompt and compiles the grammar), then driven one at a time, a batch each in turn, the order
swapped every other repetition: on a shared machine whose speed drifts by tens of percent over
minutes, the two modes' batches then run minutes apart at most. The rates come from the server's
own JSON log: each request's first token (its start plus `ttft_s`) and end; the batch's rate is the
tokens after each reply's first over the span from the earliest first token to the last end, and
each reply's own rate is its tokens after the first over its own span. A ratio is guided over free,
of the medians and of each repetition's pair. Beside the wall-clock rates, each batch's tokens per
second of the server's own CPU time (all its threads, from /proc): on a machine others share, the
wall clock measures them as much as us, while the CPU time a batch takes moves far less.

Two models:
- the tool test model, whose greedy replies are Read calls, so a guided row spends most of its
  steps inside a call (its grammar masks every step), with the CPU's default n-gram drafting and
  with `--speculate off`;
- a random-weight 2-layer, 64-wide Llama (bench/step_overhead.py's) whose steps take milliseconds,
  to expose what guidance costs a step: its text never opens a call, so a guided row only watches
  for the call's opening (the lazy grammar's trigger), as a guided turn does while it writes text.

`--profile` then samples each mode's server with py-spy while batches decode (both models, drafting
off): the engine thread's share of samples inside the grammar is where guidance spends a step.
Writes bench/results/guided_decode_speed.json.

    python -m semantic.launch .venv/bin/python -m bench.guided_decode_speed [--reps 5] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic

from bench.common import write_results
from bench.http_profile import py_spy, record
from bench.step_overhead import ENGINE_THREAD, FAST_LLAMA, PROFILE_S, summarise
from bench.tool_calls import tool_model_dir, turn_requests
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess
from tests.tiny_models import write_random_model

BATCH = 8
MODES = ("guided", "free")


def send(server: ServerProcess, requests: list[dict[str, Any]], max_tokens: int, tag: str) -> list[Any]:
    """The requests at once, greedy, each with a request id `tag-i` to find its log line by."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=1800)

    def one(indexed: tuple[int, dict[str, Any]]) -> Any:
        index, request = indexed
        return client.messages.create(
            model="default",
            max_tokens=max_tokens,
            extra_body={"temperature": 0},
            extra_headers={"X-Request-Id": f"{tag}-{index}"},
            **request,
        )

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, enumerate(requests)))


def logged(server: ServerProcess, tag: str) -> list[dict[str, Any]]:
    """The summary log lines (JSON) of the requests tagged `tag`."""
    lines = []
    for line in server.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        is_tagged = isinstance(entry, dict) and str(entry.get("request_id", "")).startswith(f"{tag}-")
        if is_tagged and "generated_tokens" in entry:
            lines.append(entry)
    return lines


def rates(entries: list[dict[str, Any]]) -> dict[str, Any]:
    spans = []
    for entry in entries:
        end = datetime.fromisoformat(entry["time"]).timestamp()
        first = end - entry["duration_s"] + entry["ttft_s"]
        spans.append((first, end, entry["generated_tokens"]))
    after_first = sum(tokens - 1 for _, _, tokens in spans)
    wall_s = max(end for _, end, _ in spans) - min(first for first, _, _ in spans)
    return {
        "batch_tok_s": round(after_first / wall_s, 2),
        "row_tok_s_median": round(statistics.median((t - 1) / (e - f) for f, e, t in spans), 2),
        "decode_span_s": round(wall_s, 2),
        "tokens": [tokens for _, _, tokens in spans],
        "drafts_kept": sum(entry.get("accepted_tokens") or 0 for entry in entries),
        "drafts_proposed": sum(entry.get("drafted_tokens") or 0 for entry in entries),
    }


def cpu_seconds(server: ServerProcess) -> float:
    """The server process's CPU time so far, all threads (Linux): what a batch cost it, however many
    other processes took the cores meanwhile."""
    assert server.proc is not None
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start(model_dir: Path, mode: str, extra: list[str], scratch: Path, *more: str) -> ServerProcess:
    args = ("--model", str(model_dir), "--tool-calls", mode, *more, *extra)
    return ServerProcess(scratch / f"{model_dir.name}-{mode}-{'_'.join(extra)}", *args).start()


def compare(model_dir: Path, extra: list[str], max_tokens: int, reps: int, scratch: Path) -> dict[str, Any]:
    """Both modes' servers started and warmed, then driven one at a time, a batch each in turn (the
    order swapped every other repetition), so a busy machine's drift falls on both alike."""
    requests = turn_requests(BATCH + 1)
    servers: dict[str, ServerProcess] = {}
    samples = []
    try:
        for mode in MODES:
            servers[mode] = start(model_dir, mode, extra, scratch, "--log-format", "json")
            send(servers[mode], requests[BATCH:], max_tokens, "warm")  # the shared prompt, the grammar
        for rep in range(reps):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                cpu_before = cpu_seconds(servers[mode])
                replies = send(servers[mode], requests[:BATCH], max_tokens, f"m{rep}")
                cpu_s = cpu_seconds(servers[mode]) - cpu_before
                entries = logged(servers[mode], f"m{rep}")
                assert len(entries) == BATCH, f"{len(entries)} of {BATCH} log lines found"
                calls = sum(block.type == "tool_use" for reply in replies for block in reply.content)
                sample = {"mode": mode, "rep": rep, "tool_calls": calls, **rates(entries)}
                sample |= {
                    "cpu_s": round(cpu_s, 2),
                    "tokens_per_cpu_s": round(sum(sample["tokens"]) / cpu_s, 2),
                }
                print(f"{model_dir.name} {extra} rep {rep} {mode}: {sample['batch_tok_s']} tok/s", flush=True)
                samples.append(sample)
    finally:
        for server in servers.values():
            server.stop()

    def median(mode: str, key: str) -> float:
        return round(statistics.median(s[key] for s in samples if s["mode"] == mode), 2)

    def per_rep(key: str) -> list[float]:
        by_rep = {(s["rep"], s["mode"]): s[key] for s in samples}
        return [round(by_rep[rep, "guided"] / by_rep[rep, "free"], 3) for rep in range(reps)]

    return {
        "model": model_dir.name,
        "server_args": extra,
        "max_tokens": max_tokens,
        "batch_tok_s_median": {mode: median(mode, "batch_tok_s") for mode in MODES},
        "row_tok_s_median": {mode: median(mode, "row_tok_s_median") for mode in MODES},
        "tokens_per_cpu_s_median": {mode: median(mode, "tokens_per_cpu_s") for mode in MODES},
        "guided_over_free": round(median("guided", "batch_tok_s") / median("free", "batch_tok_s"), 3),
        "guided_over_free_per_rep": per_rep("batch_tok_s"),
        "guided_over_free_median_of_reps": round(statistics.median(per_rep("batch_tok_s")), 3),
        "cpu_guided_over_free": round(
            median("guided", "tokens_per_cpu_s") / median("free", "tokens_per_cpu_s"), 3
        ),
        "cpu_guided_over_free_per_rep": per_rep("tokens_per_cpu_s"),
        "samples": samples,
    }


def profile(
    model_dir: Path, mode: str, extra: list[str], max_tokens: int, scratch: Path, seconds: int
) -> dict[str, Any]:
    """py-spy on one mode's server for `seconds` while batches of 8 decode back to back: the engine
    thread's top functions, and the share of its samples inside the grammar matcher
    (engine/decoding/grammar_matcher.py)."""
    spy = py_spy()
    if spy is None:
        return {"error": "py-spy not found"}
    requests = turn_requests(BATCH)
    server = start(model_dir, mode, extra, scratch / "profile")
    try:
        send(server, requests, max_tokens, "warm")
        assert server.proc is not None
        stacks = scratch / f"profile-{model_dir.name}-{mode}.txt"
        spying = record(spy, server.proc.pid, stacks, seconds, "--threads")
        stop = time.monotonic() + seconds + 1
        while time.monotonic() < stop:
            send(server, requests, max_tokens, "profiled")
        _, errors = spying.communicate(timeout=60)
    finally:
        server.stop()
    if spying.returncode or not stacks.exists():
        return {"error": errors.decode(errors="replace")[-500:]}
    engine = grammar = 0
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack.split(";", 1)[0].endswith(ENGINE_THREAD):
            engine += int(count)
            grammar += int(count) * ("grammar_matcher.py:" in stack)
    found = summarise(stacks)
    return {
        "model": model_dir.name,
        "seconds": seconds,
        "engine_samples": engine,
        "engine_share_in_grammar": round(grammar / max(engine, 1), 4),
        "engine_top_leaf": found["engine_top_leaf"],
        "engine_top_inclusive": found["engine_top_inclusive"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="tool model: batches of each mode, alternating")
    parser.add_argument("--small-reps", type=int, default=10, help="small model: batches of each mode")
    parser.add_argument("--tool-max-tokens", type=int, default=64, help="the tool model's calls take ~50")
    parser.add_argument("--small-max-tokens", type=int, default=512)
    parser.add_argument("--profile", action="store_true", help="py-spy each mode's server, each model")
    args = parser.parse_args()
    results: dict[str, Any] = {"batch": BATCH, "cases": []}
    with tempfile.TemporaryDirectory(prefix="semantic-guided-") as tmp:
        scratch = Path(tmp)
        small = write_random_model(dict(FAST_LLAMA), scratch / "fast-llama", ensure_default_model("float32"))
        tool_model = tool_model_dir()
        cases = [
            (small, ["--speculate", "off"], args.small_max_tokens, args.small_reps),
            (tool_model, [], args.tool_max_tokens, args.reps),
            (tool_model, ["--speculate", "off"], args.tool_max_tokens, args.reps),
        ]
        for model_dir, extra, max_tokens, reps in cases:
            results["cases"].append(compare(model_dir, extra, max_tokens, reps, scratch))
            write_results("guided_decode_speed", results)
        if args.profile:
            results["profile"] = [
                profile(model_dir, mode, extra, max_tokens, scratch, seconds)
                for model_dir, extra, max_tokens, seconds in (
                    (small, ["--speculate", "off"], args.small_max_tokens, PROFILE_S),
                    (tool_model, ["--speculate", "off"], args.tool_max_tokens, 3 * PROFILE_S),
                )
                for mode in MODES
            ]
    write_results("guided_decode_speed", results)


if __name__ == "__main__":
    main()
