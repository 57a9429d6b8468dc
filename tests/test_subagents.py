"""Claude Code's sub-agents and side requests, sent with the official SDK and Claude Code's headers.

Claude Code (2.1.x, read from its bundle and its requests) sends `X-Claude-Code-Session-Id` on
every request of a session; a Task sub-agent's requests add `x-claude-code-agent-id` (`a` and 16
hex digits), and side requests such as the session title come with the session id alone and a
system prompt of their own.

The server serves the tiny random-weight Llama: what is tested is which agent each request is and
what its cache holds, not what the model says.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from semantic.actors.history_marks import HistoryMark, HistoryMarks
from semantic.storage.agent_id import AgentId
from tests.server_process import ServerProcess
from tests.waiting import wait_until

SUB_AGENT = "a2c5592091ed9f872"  # the shape of Claude Code's sub-agent ids
SYSTEM = "You are an interactive agent that helps users with software engineering tasks.\n" + "\n".join(
    f"Rule {i}: keep answers short and name files like src/module_{i}.py when you cite them."
    for i in range(24)
)
TITLE_SYSTEM = (
    "Generate a concise, sentence-case title (3-7 words) that captures the main topic of this conversation."
)


def claude_headers(session: str, sub_agent: str | None = None) -> dict[str, str]:
    headers = {
        "X-Claude-Code-Session-Id": session,
        "x-app": "cli",
        "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    if sub_agent is not None:
        headers["x-claude-code-agent-id"] = sub_agent
    return headers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("cache"), "--model", str(tiny_llama_dir), "--temperature", "0"
    ).start()
    yield process
    process.stop()


def get_json(server: ServerProcess, path: str, method: str = "GET") -> Any:
    request = urllib.request.Request(server.base_url + path, method=method)
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def prompt_length(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_sub_agents_and_side_requests_leave_the_main_conversations_cache(server: ServerProcess) -> None:
    session = str(uuid.uuid4())
    client = anthropic.Anthropic(
        base_url=server.base_url, api_key="local", default_headers=claude_headers(session)
    )
    ask = {"model": "claude-opus-4-8", "max_tokens": 16, "system": SYSTEM}
    question = {"role": "user", "content": "What is 2+2?"}
    first = client.messages.create(messages=[question], **ask)  # type: ignore[arg-type]
    first_prompt = prompt_length(first.usage)
    assert first_prompt > 2 * 256  # long enough to fill full blocks

    # A Task sub-agent: its own agent, whose first request shares the main agent's prefix blocks.
    sub = client.messages.create(
        messages=[{"role": "user", "content": "List three colours."}],
        extra_headers={"x-claude-code-agent-id": SUB_AGENT},
        **ask,  # type: ignore[arg-type]
    )
    assert sub.usage.cache_read_input_tokens is not None and sub.usage.cache_read_input_tokens >= 2 * 256

    # A side request of the session (its title): another system prompt, the session id alone.
    title = client.messages.create(
        model="claude-haiku-4-5",
        max_tokens=12,
        system=TITLE_SYSTEM,
        messages=[{"role": "user", "content": "<session>\nWhat is 2+2?\n</session>"}],
    )
    assert title.usage.output_tokens > 0

    answer = "".join(block.text for block in first.content if block.type == "text")
    second = client.messages.create(
        messages=[
            question,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And 3+3?"},
        ],
        **ask,  # type: ignore[arg-type]
    )
    reused = second.usage.cache_read_input_tokens or 0
    assert first_prompt <= reused <= first_prompt + first.usage.output_tokens + 1, (first.usage, second.usage)

    agents = {agent["id"]: agent for agent in get_json(server, "/v1/agents")["data"]}
    assert {session, f"{session}.{SUB_AGENT}"} <= set(agents)
    assert not any(agent_id.startswith("#") for agent_id in agents)
    assert agents[session]["cached_tokens"] >= prompt_length(second.usage)
    assert "runs as a fork" in server.log()

    # An agent written to disk is listed with the tokens its file holds (issue 17, point 6).
    in_memory = agents[f"{session}.{SUB_AGENT}"]["cached_tokens"]
    assert get_json(server, f"/v1/agents/{session}.{SUB_AGENT}/evict", method="POST")["evicted"] is True
    on_disk = get_json(server, f"/v1/agents/{session}.{SUB_AGENT}")
    assert (on_disk["tier"], on_disk["cached_tokens"]) == ("disk", in_memory)


async def read_events(stream: Any, name: str, arrivals: list[tuple[str, str]]) -> Any:
    """Note each event as it arrives; returns the final message."""
    async with stream as events:
        async for event in events:
            arrivals.append((name, event.type))
        return await events.get_final_message()


def test_two_agents_of_one_session_decode_together(server: ServerProcess) -> None:
    session = str(uuid.uuid4())

    async def run() -> tuple[list[tuple[str, str]], Any]:
        client = anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="local", default_headers=claude_headers(session)
        )
        story = [{"role": "user", "content": "Write a long story about a dragon who learns to code."}]
        arrivals: list[tuple[str, str]] = []
        # Long enough, at the tiny model's steps of milliseconds, to be decoding all through the
        # sub-agent's short turn.
        main_stream = client.messages.stream(model="claude-opus-4-8", messages=story, max_tokens=400)  # type: ignore[arg-type]
        main = asyncio.create_task(read_events(main_stream, "main", arrivals))
        while ("main", "content_block_delta") not in arrivals:  # the main agent is decoding
            await asyncio.sleep(0.02)
        sub_stream = client.messages.stream(
            model="claude-opus-4-8",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=4,
            extra_headers={"x-claude-code-agent-id": SUB_AGENT},
        )
        await read_events(sub_stream, "sub", arrivals)
        return arrivals, await main

    arrivals, main_final = asyncio.run(run())
    assert main_final.stop_reason == "max_tokens"  # greedy: the story runs past the sub-agent's turn
    main_stop = arrivals.index(("main", "message_stop"))
    assert arrivals.index(("sub", "message_stop")) < main_stop  # not queued behind the main agent
    first_sub_delta = arrivals.index(("sub", "content_block_delta"))
    assert ("main", "content_block_delta") in arrivals[first_sub_delta:main_stop]  # decoded together


def test_a_client_that_leaves_is_logged_with_what_was_generated(server: ServerProcess) -> None:
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 2000,  # still decoding, at the tiny model's steps, when the client leaves
        "stream": True,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    }

    async def leave_after_three_deltas() -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{server.base_url}/v1/messages", json=body, headers={"x-agent-id": "leaver"}
            ) as response,
        ):
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"event: content_block_delta")
                if seen == 3:
                    return

    asyncio.run(leave_after_three_deltas())
    wait_until(lambda: _summary_line(server, "leaver") is not None, "the leaver's summary is logged", 0.1)
    line = _summary_line(server, "leaver")
    assert line is not None and "outcome=client disconnected" in line, line
    generated = int(line.split(" generated=")[1].split()[0])
    assert generated >= 3


def _summary_line(server: ServerProcess, agent_id: str) -> str | None:
    return next((line for line in server.log().splitlines() if f"agent={agent_id} " in line), None)


def test_a_history_mark_tells_continuations_from_side_requests() -> None:
    marks = HistoryMarks(max_marks=2)
    main, prompt = AgentId("main"), list(range(1000, 1400))
    marks.record(main, HistoryMark.of_turn("model-a", prompt, num_generated=50))
    reply = list(range(5000, 5050))
    assert not marks.is_side_request(main, "model-a", [*prompt, *reply, 7, 8])  # the next turn
    # A template may render the generation prompt differently once the reply is history.
    assert not marks.is_side_request(main, "model-a", [*prompt[:-4], 9, 9, *reply])
    assert marks.is_side_request(main, "model-a", [1000, 1001, 3, 4, 5])  # a title request
    assert marks.is_side_request(main, "model-a", prompt[:200])  # an earlier point of the history
    assert not marks.is_side_request(main, "model-a", [1, *prompt, *reply])  # outgrows it: takes over
    assert not marks.is_side_request(main, "model-b", [1000, 3])  # another model's tokens
    assert not marks.is_side_request(AgentId("unknown"), "model-a", [1000, 3])
    marks.record(AgentId("b"), HistoryMark.of_turn("model-a", [1], 1))
    marks.record(AgentId("c"), HistoryMark.of_turn("model-a", [1], 1))
    assert len(marks) == 2 and not marks.is_side_request(main, "model-a", [1000, 3])  # main was dropped
