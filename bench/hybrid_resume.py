"""A returning agent's time to first token against a cold prompt, for a hybrid model and a dense one.

The hybrid is a random-weight Qwen3-Next (Gated DeltaNet linear attention in three layers of four,
full attention in the fourth) built from mlx-lm's class at SmolLM2-135M's size; the dense model is
SmolLM2-135M itself (the default model, float32). A hybrid's recurrent state cannot be cut at an
arbitrary token, so a server that reuses only what it can trim gives its returning agents nothing.

For each model, semantic and mlx_lm.server serve it in turn in one run, through the OpenAI chat API,
streamed. For each history length one agent sends its first turn (a user message of about L
tokens: cold, the whole prompt prefilled), gets an 8-token reply, then returns `--samples` times,
each time with the whole conversation so far plus one short question; the figure is the median
returning turn's time to first token, beside the cold one and the prompt tokens the server reports
as cached. For semantic each turn also carries the server's own account from its log. Replies are
compared between the two servers (greedy, same weights: they should be the same text). A server
that refuses a model at load is recorded with its reason. Writes bench/results/hybrid_resume.json
and hybrid_resume.png.

    python -m semantic.launch .venv/bin/python -m bench.hybrid_resume [--models dense hybrid]
        [--lengths 500 2000] [--samples 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

import aiohttp

from bench.common import RESULTS, write_results
from bench.history_ttft import REPLY_TOKENS, history_text, turn
from bench.servers import MlxLmServer, Semantic, Server
from semantic.engine.model.default_model import ensure_default_model
from tests.tiny_models import write_random_model

# SmolLM2-135M's width, depth, MLP, vocabulary and tied embeddings; Qwen3-Next's attention (gated
# output, partial RoPE) and Gated DeltaNet layers with dense MLPs: 143M parameters to SmolLM2's 135M.
HYBRID = {
    "model_type": "qwen3_next",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "num_experts": 0,
    "num_experts_per_tok": 0,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 0,
    "moe_intermediate_size": 0,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "vocab_size": 49152,
    "rope_theta": 1000000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
QUESTIONS = ["And what comes next?", "Say it again, shorter.", "Which word was first?", "Why that one?"]
CACHE_BUDGET_MB = "1024"  # every agent's history fits in either model's pool


async def measure(server: Server, lengths: list[int], num_samples: int) -> list[dict[str, Any]]:
    """Per history length: the cold first turn, then `num_samples` returning turns."""
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        await turn(http, server, [{"role": "user", "content": "Warm up."}], "warm-up", "warm-up")
        for length in lengths:
            agent = f"hybrid-resume-{length}"
            messages = [{"role": "user", "content": history_text(length, length)}]
            cold = await turn(http, server, messages, agent, f"{agent}-cold")
            reply, returning = cold, []
            for sample in range(num_samples):
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply["text"]},
                    {"role": "user", "content": QUESTIONS[sample % len(QUESTIONS)]},
                ]
                reply = await turn(http, server, messages, agent, f"{agent}-returning-{sample}")
                returning.append(reply)
            rows.append(
                {
                    "history_tokens": cold["prompt_tokens"],
                    "cold_ttft_s": round(cold["ttft_s"], 3),
                    "returning_ttft_s": round(median(r["ttft_s"] for r in returning), 3),
                    "returning_ttft_samples_s": [round(r["ttft_s"], 3) for r in returning],
                    "returning_prompt_tokens": [r["prompt_tokens"] for r in returning],
                    "returning_cached_tokens": [r["cached_tokens"] for r in returning],
                    "replies": [cold["text"], *(r["text"] for r in returning)],
                }
            )
            print(server.name, {k: v for k, v in rows[-1].items() if k != "replies"}, flush=True)
    return rows


def run_server(server: Server, lengths: list[int], num_samples: int) -> dict[str, Any]:
    """The server's rows, with semantic's own account of each turn; or why it would not start."""
    try:
        server.start()
    except (RuntimeError, TimeoutError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        print(f"{server.name} did not start: {reason}", flush=True)
        return {"error": reason}
    try:
        rows = asyncio.run(measure(server, lengths, num_samples))
    finally:
        server.stop()
    timings = server.request_timings()
    for row, length in zip(rows, lengths, strict=True):
        agent = f"hybrid-resume-{length}"
        views = [timings.get(f"{agent}-cold")] + [
            timings.get(f"{agent}-returning-{i}") for i in range(num_samples)
        ]
        if any(views):
            row["server_view"] = [{k: round(v, 4) for k, v in (view or {}).items()} for view in views]
    return {"rows": rows}


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per server and history length: cold over returning TTFT, and whether the servers' replies agree."""
    summary: dict[str, Any] = {}
    for name, run in runs.items():
        if "rows" in run:
            summary[name] = {
                str(row["history_tokens"]): {
                    "returning_speedup": round(row["cold_ttft_s"] / row["returning_ttft_s"], 2),
                    "returning_cached_fraction": min(
                        round(cached / prompt, 3)
                        for cached, prompt in zip(
                            row["returning_cached_tokens"], row["returning_prompt_tokens"], strict=True
                        )
                    ),
                }
                for row in run["rows"]
            }
        else:
            summary[name] = {"error": run["error"]}
    replies = [[row["replies"] for row in run["rows"]] for run in runs.values() if "rows" in run]
    summary["replies_match_across_servers"] = len(replies) > 1 and all(r == replies[0] for r in replies)
    return summary


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True, squeeze=False)
    for axis, (model, runs) in zip(axes[0], results.items(), strict=True):
        for (name, run), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
            if "rows" not in run:
                axis.plot([], [], color=color, label=f"{name}: {run['error'][:60]}")
                continue
            xs = [row["history_tokens"] for row in run["rows"]]
            returning = [row["returning_ttft_s"] for row in run["rows"]]
            axis.plot(xs, returning, marker="o", color=color, label=f"{name}, returning turn (median)")
            samples = [
                (x, s)
                for x, row in zip(xs, run["rows"], strict=True)
                for s in row["returning_ttft_samples_s"]
            ]
            axis.scatter(*zip(*samples, strict=True), color=color, alpha=0.3, s=12)
            cold = [row["cold_ttft_s"] for row in run["rows"]]
            axis.plot(xs, cold, marker="x", linestyle=":", color=color, label=f"{name}, cold")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("history (tokens)")
        axis.set_title(model)
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("time to first token (s)")
    figure.suptitle("Returning-turn TTFT against cold: hybrid and dense models")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def model_dirs(models: list[str], work: Path) -> dict[str, Path]:
    dense = ensure_default_model("float32")
    dirs = {"dense": dense}
    if "hybrid" in models:
        dirs["hybrid"] = write_random_model(dict(HYBRID), work / "hybrid", dense)
    return {name: dirs[name] for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=["dense", "hybrid"], default=["dense", "hybrid"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--samples", type=int, default=3, help="returning turns per history length")
    args = parser.parse_args()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    weights_bytes = {}
    load_before = os.getloadavg()[0]  # on a shared machine, other work skews every figure
    with tempfile.TemporaryDirectory(prefix="semantic-hybrid-") as tmp:
        work = Path(tmp)
        for model, model_dir in model_dirs(args.models, work).items():
            weights_bytes[model] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
            servers: list[Server] = [
                Semantic(model_dir, work / model / "semantic", "--cache-budget-mb", CACHE_BUDGET_MB),
                MlxLmServer(model_dir, work / model, REPLY_TOKENS),
            ]
            results[model] = {
                server.name: run_server(server, args.lengths, args.samples) for server in servers
            }
    # A run of one model is kept apart from the two-model figures it would otherwise replace.
    name = "hybrid_resume" if set(args.models) == {"dense", "hybrid"} else f"hybrid_resume_{args.models[0]}"
    write_results(
        name,
        {
            "models": {
                "dense": "SmolLM2-135M (the default model, float32)",
                "hybrid": {"random weights": HYBRID},
                "weights_bytes": weights_bytes,
            },
            "load_average_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
            "reply_tokens": REPLY_TOKENS,
            "returning_samples": args.samples,
            "runs": results,
            "summary": {model: summarise(runs) for model, runs in results.items()},
        },
    )
    plot(results, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
