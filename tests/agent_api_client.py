"""A small client for the direct agent API over urllib, and the token-exact oracle tests share."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from mlx_lm import load, stream_generate

from tests.waiting import wait_until


def call(
    server, method: str, path: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, Any]:  # type: ignore[no-untyped-def]
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"} | ({"x-api-key": key} if key else {})
    request = urllib.request.Request(server.base_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            raw = reply.read()
            status = reply.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    if raw.startswith(b"event:"):
        return status, raw.decode()
    return status, json.loads(raw)


def conversation_tokens(cache_dir: Path, agent_id: str, num_turns: int) -> list[int]:
    """The kept conversation once its record shows `num_turns` (written just after each reply)."""
    found: list[int] = []

    def reached() -> bool:
        for path in cache_dir.glob(f"agents/*/{agent_id}.conversation.json"):
            record = json.loads(path.read_text())
            if record["num_turns"] == num_turns:
                found[:] = record["token_ids"]
                return True
        return False

    wait_until(reached, f"the conversation of {agent_id} has {num_turns} turns")
    return found


def cold_continuation(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """What a model loaded in this process (no server's cache) generates greedily for `prompt`,
    end-of-turn tokens dropped."""
    cold_model, tokenizer = _loaded(model_dir)
    eos = set(tokenizer.eos_token_ids)
    steps = stream_generate(cold_model, tokenizer, prompt, max_tokens=max_tokens)
    return [step.token for step in steps if step.token not in eos]


def _loaded(model_dir: Path) -> tuple[Any, Any]:
    """mlx-lm's load of `model_dir`, kept while its files are unchanged: tests ask for the same few
    models many times, and a model holds no state between generations."""
    stats = {path.name: path.stat() for path in model_dir.iterdir()}
    stamp = tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in sorted(stats.items()))
    return _load(str(model_dir.resolve()), stamp)


@functools.lru_cache(maxsize=2)  # the two models used last stay loaded
def _load(path: str, stamp: tuple[tuple[str, int, int], ...]) -> tuple[Any, Any]:
    """`stamp` is only part of the key: a model whose files changed is loaded again."""
    model, tokenizer = load(path)[:2]
    return model, tokenizer
