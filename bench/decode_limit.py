"""Single-stream decode speed against what this machine's memory bandwidth allows.

Each decoded token reads every weight once and the sequence's KV cache once, so no decoder on
this machine can beat bandwidth / (weight bytes + KV bytes per step). The bandwidth is measured
here, on the same box, as the best of several matrix-vector products over a 1 GiB matrix; the decode speed is
one greedy stream through the engine (the agent system in-process, as the server runs it) after a
~500-token prompt (a count it carries on). Writes bench/results/decode_limit.json.

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

from bench.common import write_results
from semantic import AgentId, AgentSystem, SystemConfig, TurnRequest
from semantic.engine.default_model import ensure_default_model
from semantic.engine.engine import EngineConfig
from semantic.engine.messages import TokenDelta
from semantic.engine.sampling import SamplingParams

NEW_TOKENS = 256
PROMPT_TOKENS = 500


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
        prompt = list(loaded.tokenizer.encode(count))
        times: list[float] = []
        sampling = SamplingParams(max_tokens=NEW_TOKENS)
        turn = TurnRequest("decode", AgentId("decoder"), [], sampling, prompt_token_ids=prompt)
        async for event in (await system.start_turn(turn)).stream:
            if isinstance(event, TokenDelta) and event.token_ids:
                times.append(time.perf_counter())
    finally:
        await system.stop(flush=False)
    steady = times[len(times) // 8 :]  # past the first tokens' warm-up
    tokens_per_s = (len(steady) - 1) / (steady[-1] - steady[0])
    mean_context = len(prompt) + len(times) / 2
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": len(times),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "bytes_per_step": round(weight_bytes + mean_context * kv_per_token),
        "decode_tokens_per_s": round(tokens_per_s, 2),
    }


def main() -> None:
    model_dir = ensure_default_model()
    bandwidth = read_bandwidth()
    with tempfile.TemporaryDirectory(prefix="semantic-decode-") as cache:
        decode = asyncio.run(decode_speed(model_dir, Path(cache)))
    limit = bandwidth / decode["bytes_per_step"]
    write_results(
        "decode_limit",
        {
            "read_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
            **decode,
            "bandwidth_limit_tokens_per_s": round(limit, 2),
            "percent_of_limit": round(100 * decode["decode_tokens_per_s"] / limit, 1),
        },
    )


if __name__ == "__main__":
    main()
