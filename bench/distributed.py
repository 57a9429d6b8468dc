"""One model over 1, 2 (and 3) ranks on loopback: what splitting costs per tick, and what each rank holds.

A random-weight Llama with SmolLM2-135M's shape (30 layers, 576 wide) but 8 attention and 4 KV
heads, so 2 ranks split it (tensor parallel, MLX's ring backend over loopback TCP), served by a
single process and by groups started the way `mlx.launch` starts them. Per layout: single-stream
decode tokens/s (64 greedy tokens), a returning agent's time to first token (a short turn after a
~1,000-token first turn, cache reused), and each rank's bytes for that agent's cache (its file
on disk after an evict, and the per-token figure from the file's cache spec). On one CPU box the
ranks share the cores and every layer's collectives cross loopback, so a group is slower here: the
point is the overhead per tick, and that each rank holds 1/N of the cache. Writes
bench/results/distributed.json.

    python -m semantic.launch .venv/bin/python -m bench.distributed
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from safetensors import safe_open

from bench.common import write_results
from semantic.engine.model.default_model import ensure_default_model
from tests.agent_api_client import call
from tests.group_process import GroupProcesses
from tests.server_process import ServerProcess
from tests.tiny_models import TINY_CONFIGS, build_tiny_model
from tests.waiting import wait_until

LLAMA_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": False,
}
DECODE_TOKENS = 64
HISTORY_WORDS = 700  # about 1,000 tokens with the chat template


def stream_turn(server: Any, agent_id: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One streamed direct-API turn: time to first token, decode rate after it, usage."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1800)
    body = json.dumps({"content": content, "stream": True, "max_tokens": max_tokens, "temperature": 0})
    started = time.perf_counter()
    connection.request("POST", f"/v1/agents/{agent_id}/messages", body, {"content-type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200, reply.read()
    delta_times: list[float] = []
    done: dict[str, Any] = {}
    event = ""
    for raw in reply:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            if event == "delta":
                delta_times.append(time.perf_counter())
            elif event == "done":
                done = json.loads(line.removeprefix("data: "))
            elif event == "error":
                raise RuntimeError(line)
    connection.close()
    generated = done["usage"]["completion_tokens"]
    decode_s = delta_times[-1] - delta_times[0] if len(delta_times) > 1 else float("nan")
    return {
        "ttft_s": delta_times[0] - started,
        "decode_tok_s": (generated - 1) / decode_s if decode_s > 0 else float("nan"),
        "usage": done["usage"],
    }


def history(seed: int) -> str:
    words = ["agent", "cache", "block", "pool", "engine", "tick", "rank", "ring", "shard", "token"]
    notes = " ".join(words[(seed * 7 + i * i) % len(words)] for i in range(HISTORY_WORDS))
    return f"Agent {seed}. Keep these notes in mind: {notes}"


def cache_bytes(cache_dir: Path, agent_id: str, size: int) -> list[dict[str, Any]]:
    """Each rank's file for the agent: its size, tokens, and KV bytes per token from its spec."""
    patterns = [f"agents/*/{agent_id}.safetensors"]
    patterns += [f"rank-{rank}-of-{size}/agents/*/{agent_id}.safetensors" for rank in range(1, size)]
    ranks = []
    for rank, pattern in enumerate(patterns):
        (path,) = cache_dir.glob(pattern)
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
        spec = json.loads(metadata["cache_spec"])
        per_token = 2 * spec["num_kv_heads"] * spec["head_dim"] * 4 * spec["num_layers"]  # float32
        ranks.append(
            {
                "rank": rank,
                "file_bytes": path.stat().st_size,
                "num_tokens": int(metadata["num_tokens"]),
                "kv_heads": spec["num_kv_heads"],
                "kv_bytes_per_token": per_token,
            }
        )
    return ranks


def run_layout(model_dir: Path, size: int, work: Path, num_agents: int) -> dict[str, Any]:
    cache_dir = work / f"ranks-{size}"
    args = ("--model", str(model_dir), "--cache-budget-mb", "1024", "--rank-timeout-s", "600")
    server: Any = GroupProcesses(cache_dir, size, *args) if size > 1 else ServerProcess(cache_dir, *args)
    started = time.perf_counter()
    server.start(timeout=1200)
    start_s = time.perf_counter() - started
    try:
        decode = [
            stream_turn(server, f"decode-{i}", "Count to one hundred.", DECODE_TOKENS) for i in range(2)
        ]
        cold, returning = [], []
        for i in range(num_agents):
            first = stream_turn(server, f"agent-{i}", history(i), 8)
            cold.append(first)
            returning.append(stream_turn(server, f"agent-{i}", "What did I ask you to keep in mind?", 8))
        status, evicted = call(server, "POST", "/v1/agents/agent-0/evict")
        assert status == 200 and evicted["evicted"], evicted
        # The other ranks write their shards from their own worker threads, after rank 0 answered.
        wait_until(
            lambda: len(list(cache_dir.glob("**/agent-0.safetensors"))) == size, "every shard is on disk"
        )
        files = cache_bytes(cache_dir, "agent-0", size)
        status, health = call(server, "GET", "/health/ready")
    finally:
        server.stop()
    return {
        "ranks": size,
        "start_s": round(start_s, 2),
        "decode_tok_s": round(statistics.median(d["decode_tok_s"] for d in decode), 2),
        "cold_ttft_s": round(statistics.median(c["ttft_s"] for c in cold), 3),
        "cold_prompt_tokens": cold[0]["usage"]["prompt_tokens"],
        "returning_ttft_s": round(statistics.median(r["ttft_s"] for r in returning), 3),
        "returning_cached_tokens": [r["usage"]["cached_tokens"] for r in returning],
        "returning_prompt_tokens": [r["usage"]["prompt_tokens"] for r in returning],
        "agent_cache_per_rank": files,
        "rank_active_memory_bytes": health.get("group", {}).get("rank_active_memory_bytes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--agents", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="semantic-distributed-") as tmp:
        work = Path(tmp)
        TINY_CONFIGS["llama-135m"] = LLAMA_135M
        model_dir = build_tiny_model("llama-135m", work / "llama-135m", ensure_default_model("float32"))
        runs = [run_layout(model_dir, size, work, args.agents) for size in args.ranks]
    base = runs[0]
    for run in runs:
        run["decode_vs_one_rank"] = round(run["decode_tok_s"] / base["decode_tok_s"], 3)
        run["returning_ttft_vs_one_rank"] = round(run["returning_ttft_s"] / base["returning_ttft_s"], 3)
        per_rank = run["agent_cache_per_rank"][0]["kv_bytes_per_token"]
        run["cache_bytes_per_rank_vs_one_rank"] = round(
            per_rank / base["agent_cache_per_rank"][0]["kv_bytes_per_token"], 3
        )
        # The time a token spends outside one rank's own compute, per decode step.
        run["step_ms"] = round(1000 / run["decode_tok_s"], 2)
    write_results("distributed", {"model": LLAMA_135M, "backend": "ring over loopback TCP", "runs": runs})


if __name__ == "__main__":
    main()
