"""What a grammar costs: decode speed of plain and JSON-schema-constrained replies, alone and mixed.

Four concurrent streams of the default model per scenario (greedy, 128 tokens): plain only, constrained
only, and two of each in one batch. A stream's decode rate is its tokens after the first over the
time from its first to its last token. Writes bench/results/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from bench.common import write_results
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess

ITEM = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
    "required": ["n", "text"],
}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": ITEM},
    },
    "required": ["title", "items"],
}  # fmt: skip
PROMPT = "List many facts about the sea, one per item, as JSON with a title and numbered items."
MAX_TOKENS = 128
NUM_STREAMS = 4


def one_stream(client: openai.OpenAI, constrained: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if constrained:
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}
    stamps: list[float] = []
    num_tokens = 0
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    return {"constrained": constrained, "num_tokens": num_tokens, "decode_tok_s": (num_tokens - 1) / span}


def scenario(client: openai.OpenAI, kinds: list[bool]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(kinds)) as pool:
        return list(pool.map(lambda constrained: one_stream(client, constrained), kinds))


def summary(streams: list[dict[str, Any]], constrained: bool) -> float | None:
    rates = [s["decode_tok_s"] for s in streams if s["constrained"] is constrained]
    return round(statistics.median(rates), 1) if rates else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a model directory (default: the default model)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scenarios = {
        "plain": [False] * NUM_STREAMS,
        "constrained": [True] * NUM_STREAMS,
        "mixed": [False, True] * (NUM_STREAMS // 2),
    }
    model = args.model or str(ensure_default_model())
    results: dict[str, Any] = {
        "model": Path(model).name,
        "max_tokens": MAX_TOKENS,
        "num_streams": NUM_STREAMS,
    }
    with tempfile.TemporaryDirectory() as cache_dir:
        server = ServerProcess(Path(cache_dir), "--model", model).start()
        try:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
            scenario(client, [False, True])  # warm-up: model, grammar compile
            for name, kinds in scenarios.items():
                runs = [scenario(client, kinds) for _ in range(args.repeats)]
                streams = [s for run in runs for s in run]
                results[name] = {
                    "plain_decode_tok_s": summary(streams, False),
                    "constrained_decode_tok_s": summary(streams, True),
                    "streams": streams,
                }
        finally:
            server.stop()
    write_results("structured_output", results)
    print(
        json.dumps(
            {
                k: {kk: vv for kk, vv in v.items() if kk != "streams"}
                for k, v in results.items()
                if isinstance(v, dict)
            }
        )
    )


if __name__ == "__main__":
    main()
