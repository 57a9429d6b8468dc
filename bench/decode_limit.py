"""Single-stream decode speed against what this machine's memory bandwidth allows.

Each decoded token reads every weight once and the sequence's KV cache once, so no decoder on
this machine can beat bandwidth / (weight bytes + KV bytes per step). The bandwidth is measured
here, on the same box, as the best of several matrix-vector products over a 1 GiB matrix, before
and after the streams. The decode speed is one greedy stream through the engine (the agent system
in-process, as the server runs it) after a ~1,100-token prompt (a count it carries on), then shorter
streams after longer prompts, each against its own limit (a longer context reads more KV a step),
and mlx-lm's `stream_generate` on the same prompts as the peer. Writes
bench/results/decode_limit.json and decode_limit.png.

    python -m semantic.launch .venv/bin/python -m bench.decode_limit
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load, stream_generate

from bench.common import RESULTS, write_results
from semantic import AgentId, AgentSystem, SystemConfig, TurnRequest
from semantic.actors.engine_client import EngineConfig
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import TokenDelta
from semantic.engine.model.default_model import ensure_default_model

NEW_TOKENS = 256
PROMPT_TOKENS = 500
CONTEXT_TOKENS = (2048, 4096, 6144)  # the longer prompts, within SmolLM2's 8K context
CONTEXT_NEW_TOKENS = 64


def read_bandwidth(side: int = 16384, repeats: int = 7) -> float:
    """Bytes per second of the best matrix-vector product over a `side` x `side` float32 matrix
    (1 GiB): the access pattern of a decode step, through the same BLAS, on every core it uses."""
    matrix = mx.random.uniform(shape=(side, side))
    vector = mx.random.uniform(shape=(side,))
    mx.eval(matrix, vector)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(matrix @ vector)
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best


async def stream_speed(system: AgentSystem, name: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One greedy stream's decode speed after `prompt`."""
    times: list[float] = []
    turn = TurnRequest(
        name, AgentId(name), [], SamplingParams(max_tokens=new_tokens), prompt_token_ids=prompt
    )
    async for event in (await system.start_turn(turn)).stream:
        if isinstance(event, TokenDelta) and event.token_ids:
            times.append(time.perf_counter())
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": len(times),
        "decode_tokens_per_s": steady_rate(times),
        "mean_context_tokens": round(len(prompt) + len(times) / 2),
    }


def mlx_lm_speed(model: Any, tokenizer: Any, prompt: list[int], new_tokens: int) -> float:
    """The peer: mlx-lm's own `stream_generate` on the same model and prompt, measured the same way
    (on this thread, so without the engine thread's CPU kernels)."""
    times = [time.perf_counter() for _ in stream_generate(model, tokenizer, prompt, max_tokens=new_tokens)]
    return steady_rate(times)


def steady_rate(times: list[float]) -> float:
    """Tokens per second from each token's arrival time, past the first eighth (the warm-up)."""
    steady = times[len(times) // 8 :]
    return round((len(steady) - 1) / (steady[-1] - steady[0]), 2)


async def decode_speed(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    config = EngineConfig(model=str(model_dir))
    system = AgentSystem(SystemConfig(engine=config, cache_dir=cache_dir, persist_caches=False))
    await system.start()
    try:
        loaded = system.engine.model
        weight_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
        kv_per_token = loaded.spec.num_layers * loaded.spec.bytes_per_token_per_layer
        # Raw text, no chat template: the model goes on counting without ending its turn.
        count = ", ".join(str(i) for i in range(1, PROMPT_TOKENS // 2)) + ","
        prompts = [list(loaded.tokenizer.encode(count))]
        main = await stream_speed(system, "decoder", prompts[0], NEW_TOKENS)
        # ~5 tokens a number: a count to a quarter of the longest prompt holds it, within the context
        long_count = list(
            loaded.tokenizer.encode(", ".join(str(i) for i in range(1, max(CONTEXT_TOKENS) // 4)))
        )
        assert len(long_count) >= max(CONTEXT_TOKENS), f"the count is {len(long_count)} tokens"
        prompts += [long_count[:n] for n in CONTEXT_TOKENS]
        by_context = [
            await stream_speed(system, f"decoder-{len(prompt)}", prompt, CONTEXT_NEW_TOKENS)
            for prompt in prompts[1:]
        ]
    finally:
        await system.stop(flush=False)
    model, tokenizer = load(str(model_dir))[:2]
    for row, prompt in zip([main, *by_context], prompts, strict=True):
        row["bytes_per_step"] = round(weight_bytes + row.pop("mean_context_tokens") * kv_per_token)
        row["mlx_lm_decode_tokens_per_s"] = mlx_lm_speed(model, tokenizer, prompt, row["generated_tokens"])
    return {
        **main,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "by_context": by_context,
    }


def plot(rows: list[dict[str, Any]], bandwidth: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    xs = [row["prompt_tokens"] for row in rows]
    axis.plot(
        xs, [bandwidth / row["bytes_per_step"] for row in rows], linestyle=":", marker="x", label="limit"
    )
    axis.plot(xs, [row["decode_tokens_per_s"] for row in rows], marker="o", label="semantic, one stream")
    axis.plot(
        xs, [row["mlx_lm_decode_tokens_per_s"] for row in rows], marker="s", label="mlx-lm stream_generate"
    )
    for row in rows:
        percent = 100 * row["decode_tokens_per_s"] * row["bytes_per_step"] / bandwidth
        axis.annotate(f"{percent:.0f}%", (row["prompt_tokens"], row["decode_tokens_per_s"]), fontsize=8)
    axis.set_ylim(bottom=0)
    axis.set_xlabel("prompt (tokens)")
    axis.set_ylabel("decode (tokens/s)")
    axis.set_title(f"Single-stream decode against the bandwidth limit ({bandwidth / 1e9:.1f} GB/s)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    model_dir = ensure_default_model()
    # This VM's bandwidth drifts over minutes: measured before and after the streams, the limit
    # takes the best (a decode once beat a limit measured only before it).
    bandwidths = [read_bandwidth()]
    with tempfile.TemporaryDirectory(prefix="semantic-decode-") as cache:
        decode = asyncio.run(decode_speed(model_dir, Path(cache)))
    bandwidths.append(read_bandwidth())
    bandwidth = max(bandwidths)
    for row in [decode, *decode["by_context"]]:
        limit = bandwidth / row["bytes_per_step"]
        row["bandwidth_limit_tokens_per_s"] = round(limit, 2)
        row["percent_of_limit"] = round(100 * row["decode_tokens_per_s"] / limit, 1)
    plot([decode, *decode["by_context"]], bandwidth, RESULTS / "decode_limit.png")
    write_results(
        "decode_limit",
        {
            "read_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
            "read_bandwidth_before_after_gb_per_s": [round(b / 1e9, 2) for b in bandwidths],
            **decode,
        },
    )


if __name__ == "__main__":
    main()
