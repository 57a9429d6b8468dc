"""Sliding-window models resume where the next turn's prompt parts from the cache, from memory and
after a restart (the cache read back from the agent's file), token-exactly against mlx-lm.

Chat templates of the sliding-window families (gpt-oss's harmony, Gemma's) rewrite the reply that
goes back into the next prompt, so the next prompt parts at (or near) the end of the last one: the
agent keeps the sliding windows there (a window point, beside its blocks) in memory and in its file.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import PromptStarted, TokenDelta
from semantic.storage.agent_id import AgentId
from tests.agent_api_client import _loaded, cold_continuation
from tests.arch_configs import ARCHITECTURES
from tests.conformance_models import build_model, save_model_dir
from tests.server_process import ServerProcess
from tests.waiting import wait_until

BLOCK = 16
NUM_TOKENS = 40  # past the 32-token window: the window at a reply's end no longer reaches its prompt
SYSTEM_PROMPT = "You are a careful assistant who answers questions about rivers, boats and bridges. " * 8


# The design's two sliding-window targets run by default; Gemma 4's layout with the slow tests.
@pytest.fixture(
    scope="module",
    params=["gemma3_text", "gpt_oss", pytest.param("gemma4_text", marks=pytest.mark.slow)],
)
def model_dir(
    request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    model, config = build_model(ARCHITECTURES[request.param])
    return save_model_dir(model, config, tmp_path_factory.mktemp(request.param), default_model_dir)


def system_config(model_dir: Path, cache_dir: Path) -> SystemConfig:
    engine = EngineConfig(model=str(model_dir), cache_budget_mb=64, block_size=BLOCK)
    return SystemConfig(engine=engine, cache_dir=cache_dir)


async def exact_turn(
    system: AgentSystem, model_dir: Path, agent: str, prompt: list[int]
) -> tuple[list[int], PromptStarted]:
    """One turn of `prompt`, checked token for token against mlx-lm: its reply and how much of the
    prompt was cached."""
    sampling = SamplingParams(max_tokens=NUM_TOKENS)
    request = TurnRequest(uuid.uuid4().hex, AgentId(agent), [], sampling, prompt_token_ids=prompt)
    started = await system.start_turn(request)
    reply: list[int] = []
    prompt_started = None
    async for event in started.stream:
        if isinstance(event, PromptStarted):
            prompt_started = event
        elif isinstance(event, TokenDelta):
            reply.extend(event.token_ids)
    assert prompt_started is not None
    tokenizer = _loaded(model_dir)[1]
    expected = cold_continuation(model_dir, prompt, NUM_TOKENS)
    assert [t for t in reply if t not in tokenizer.eos_token_ids] == expected
    assert len(set(expected)) > 2, "the random model's reply collapsed: the oracle would be vacuous"
    return reply, prompt_started


def user_turn(tokenizer: Any, text: str) -> list[int]:
    """A user message and the generation prompt after a rewritten (here: dropped) reply."""
    return list(
        tokenizer.encode(
            f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
    )


@pytest.mark.asyncio
async def test_a_turn_parting_where_the_last_prompt_ended_resumes_there_from_memory_and_disk(
    model_dir: Path, tmp_path: Path
) -> None:
    """The template drops each reply (the harshest rewrite): every prompt parts from the cache at
    the end of the previous prompt, and resumes there but for its last token, which a re-rendered
    reply may tokenize with what follows."""
    cache_dir = tmp_path / "cache"
    async with AgentSystem(system_config(model_dir, cache_dir)) as system:
        tokenizer = _loaded(model_dir)[1]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Where does the Nile begin?"},
        ]
        first = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert len(first) > 3 * 32, "the prompt must run past the sliding window"
        _, started = await exact_turn(system, model_dir, "agent", first)
        assert started.num_cached_tokens == 0
        second = first + user_turn(tokenizer, "And the Amazon?")
        _, started = await exact_turn(system, model_dir, "agent", second)
        assert started.cache_tier == "memory"
        assert started.num_cached_tokens >= len(first) - 1
    async with AgentSystem(system_config(model_dir, cache_dir)) as system:
        third = second + user_turn(tokenizer, "Which is longer?")
        _, started = await exact_turn(system, model_dir, "agent", third)
        assert started.cache_tier == "disk"
        assert started.num_cached_tokens >= len(second) - 1
        fourth = third + user_turn(tokenizer, "Name a bridge over one.")
        _, started = await exact_turn(system, model_dir, "agent", fourth)
        assert started.cache_tier == "memory"
        assert started.num_cached_tokens >= len(third) - 1


def chat(server: ServerProcess, agent: str, messages: list[dict[str, str]], stream: bool) -> tuple[str, str]:
    """One chat-API turn: its `x-semantic-cache` header and its reply's text."""
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": NUM_TOKENS}
    headers = {"content-type": "application/json", "x-agent-id": agent}
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions", json.dumps({**body, "stream": stream}).encode(), headers
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        header, raw = reply.headers["x-semantic-cache"], reply.read().decode()
    if not stream:
        return header, json.loads(raw)["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return header, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def logged_reuse(server: ServerProcess, agent: str) -> list[tuple[int, str]]:
    """Each of the agent's request log lines: the tokens it says were reused, and its cache field."""
    rows = re.findall(rf"agent={agent} prompt=\d+ reused=(\d+) .* cache=(\S+) ", server.log())
    return [(int(reused), cache) for reused, cache in rows]


def test_the_cache_header_states_the_reuse_the_log_line_states_after_a_restart_too(
    model_dir: Path, tmp_path: Path
) -> None:
    """A chat-API client sends the history back with each reply trimmed (as Gemma's template does):
    every turn's header says how many tokens the turn reused, as its log line does, from memory and
    from the agent's file after a restart."""
    agent, cache_dir = "trimmed", tmp_path / "cache"
    args = ("--model", str(model_dir), "--block-size", str(BLOCK), "--cache-budget-mb", "64")
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Where is the Nile?"},
    ]
    headers: list[str] = []
    server = ServerProcess(cache_dir, *args).start()
    try:
        for index, stream in enumerate((False, True)):
            header, reply = chat(server, agent, messages, stream)
            headers.append(header)
            trimmed = reply.rstrip()[: max(1, len(reply.rstrip()) // 2)]
            messages += [
                {"role": "assistant", "content": trimmed},
                {"role": "user", "content": f"Part {index}?"},
            ]
    finally:
        server.stop()
    restarted = ServerProcess(cache_dir, *args, port=server.port).start()
    try:
        header, _ = chat(restarted, agent, messages, True)
        headers.append(header)
    finally:
        restarted.stop()
    wait_until(lambda: len(logged_reuse(restarted, agent)) == 3, "the three turns' log lines")
    logged = logged_reuse(restarted, agent)
    reused = [int(dict(f.split("=", 1) for f in h.split("; "))["reused"].split("/")[0]) for h in headers]
    assert reused == [n for n, _ in logged], (headers, logged)
    assert [h.replace("; ", ",") for h in headers] == [cache for _, cache in logged]
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > 0, headers
    assert "first-turn" not in headers[2], "the restarted server explains the turn from the agent's file"
