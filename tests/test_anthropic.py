"""The Anthropic Messages API with the official SDK against a real server process on loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import anthropic
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
SUNNY = {"type": "text", "text": "Sunny, 22 C"}
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server


def client_for(server) -> anthropic.Anthropic:  # type: ignore[no-untyped-def]
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def raw_events(server, body: dict[str, Any], path: str = "/v1/messages") -> list[tuple[str, Any]]:  # type: ignore[no-untyped-def]
    request = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["content-type"] == "text/event-stream"
        frames = reply.read().decode().strip().split("\n\n")
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_stream_events_follow_the_spec_and_match_the_json_reply(server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "claude-local", "max_tokens": 32, "messages": QUESTION, "stream": True, **GREEDY}
    events = raw_events(server, body)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    deltas = [i for i, n in enumerate(names) if n == "content_block_delta"]
    assert names[deltas[0] - 1] == "content_block_start" and names[deltas[-1] + 1] == "content_block_stop"
    assert set(names[deltas[0] : deltas[-1] + 1]) == {"content_block_delta"}
    assert names[deltas[-1] + 2 :] == ["message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    assert all(data["index"] == 0 for name, data in events if name.startswith("content_block"))
    start = events[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["usage"]["input_tokens"] > 0
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}

    client = client_for(server)
    reply = client.messages.create(model="claude-local", max_tokens=32, messages=QUESTION, extra_body=GREEDY)
    assert (
        reply.content[0].type == "text" and reply.content[0].text == text == "The capital of France is Paris."
    )
    assert (
        reply.stop_reason == "end_turn"
        and reply.usage.output_tokens == message_delta["usage"]["output_tokens"]
    )
    with client.messages.stream(
        model="claude-local-small", max_tokens=32, messages=QUESTION, extra_body=GREEDY
    ) as stream:
        assert stream.get_final_text() == text
    counted = client.messages.count_tokens(model="claude-local", messages=QUESTION)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_the_readmes_first_example_answers_sensibly_with_the_default_settings(server) -> None:  # type: ignore[no-untyped-def]
    """README's curl sets no temperature: the default model's own sampling (greedy) answers."""
    body = {"model": "claude-local", "max_tokens": 64, "stream": True, "messages": QUESTION}
    events = raw_events(server, body)
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert "Paris" in text, text


def test_multi_turn_reads_the_cache_despite_a_changing_billing_header(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    headers = {"x-claude-code-session-id": "cc-session-1", "anthropic-beta": "a-2025,b-2025,c-2025"}
    claude_code_extras = {
        "metadata": {"user_id": "user_abc_account__session_1"},
        "thinking": {"type": "disabled"},
        "context_management": {"edits": []},
        "output_config": {"effort": "low"},
        **GREEDY,
    }

    def system(n: int) -> list[dict[str, Any]]:
        return [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={n:05x};"},
            {"type": "text", "text": "You are a helpful assistant.", "cache_control": {"type": "ephemeral"}},
        ]

    messages: list[dict[str, Any]] = [{"role": "user", "content": "My name is Ada."}]
    first = client.messages.create(
        model="claude-local", max_tokens=24, system=system(1), messages=messages,
        extra_headers=headers, extra_body=claude_code_extras,
    )  # fmt: skip
    assert first.usage.cache_read_input_tokens == 0
    messages += [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "She told me her name.", "signature": "c2lnbmF0dXJl"},
                {"type": "text", "text": first.content[0].text},  # type: ignore[union-attr]
            ],
        },
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is my name?", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    second = client.messages.create(
        model="claude-local", max_tokens=24, system=system(2), messages=messages,
        extra_headers=headers, extra_body=claude_code_extras, extra_query={"beta": "true"},
    )  # fmt: skip
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == client.messages.count_tokens(
        model="claude-local", system=system(3), messages=messages,  # type: ignore[arg-type]
    ).input_tokens  # fmt: skip


def test_tool_round_trip(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    reply = client.messages.create(
        model="claude-local", max_tokens=48, tools=[WEATHER], tool_choice=forced, messages=ask,  # type: ignore[arg-type]
        extra_body=GREEDY,
    )  # fmt: skip
    assert reply.stop_reason == "tool_use"  # the forced call ends the turn once it is closed
    call = reply.content[-1]
    cut_off = client.messages.create(
        model="claude-local", max_tokens=8, tools=[WEATHER], tool_choice=forced, messages=ask,  # type: ignore[arg-type]
        extra_body=GREEDY,
    )  # fmt: skip
    assert cut_off.stop_reason == "max_tokens"  # a call cut off by max_tokens says so, as Anthropic does
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")

    body = {"model": "claude-x", "max_tokens": 48, "tools": [WEATHER], "tool_choice": forced, "messages": ask}
    events = raw_events(server, {**body, "stream": True, **GREEDY})
    (start,) = [
        d for n, d in events if n == "content_block_start" and d["content_block"]["type"] == "tool_use"
    ]
    assert start["content_block"]["name"] == "get_weather" and start["content_block"]["input"] == {}
    partial = "".join(
        d["delta"]["partial_json"]
        for n, d in events
        if n == "content_block_delta" and d["index"] == start["index"]
    )
    assert json.loads(partial) == call.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    # The client runs the tool and sends its result back (a scripted call, so the test is exact).
    answer = client.messages.create(
        model="claude-local", max_tokens=40, tools=[WEATHER], extra_body=GREEDY,  # type: ignore[arg-type]
        messages=[
            *ask,
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [SUNNY]},
            ]},
        ],
    )  # fmt: skip
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text"
    assert "22" in answer.content[0].text or "unny" in answer.content[0].text


def test_errors_come_in_anthropic_shape(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    with pytest.raises(anthropic.NotFoundError, match="is not served here"):
        client.messages.create(model="llama-3", max_tokens=8, messages=QUESTION)  # type: ignore[arg-type]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="reads text only"):
        client.messages.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 8192 maximum"):
        client.messages.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi " * 9000}]
        )
    with pytest.raises(anthropic.BadRequestError, match=r"invalid request body.*messages"):
        client.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[misc, list-item]
    tool = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    with pytest.raises(anthropic.BadRequestError, match="tool_choice: no tool named 'nope'"):
        client.messages.create(
            model="claude-x",
            max_tokens=8,
            messages=QUESTION,
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "nope"},
        )
    with pytest.raises(anthropic.BadRequestError, match="invalid agent id"):
        client.messages.create(
            model="claude-x", max_tokens=8, messages=QUESTION, extra_headers={"x-agent-id": "../../etc"}
        )
    for path, data, status in [
        ("/v1/messages", b"{not json", 400),
        ("/v1/messages", b"x" * (33 * 2**20), 413),
        ("/v1/messages/nope", b"{}", 404),
    ]:
        request = urllib.request.Request(
            server.base_url + path, data=data, headers={"content-type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == status
        error = json.loads(caught.value.read())
        assert error["type"] == "error" and error["error"]["message"], error


def test_reasoning_comes_back_as_a_signed_thinking_block(server) -> None:  # type: ignore[no-untyped-def]
    # Prefilling the reply with `<think>` puts it inside a reasoning block, as a reasoning model's
    # template does; the default model never writes `</think>`, so the reply's end closes the block.
    messages = [*QUESTION, {"role": "assistant", "content": "<think>"}]
    body = {"model": "claude-local", "max_tokens": 12, "messages": messages, "stream": True, **GREEDY}
    events = raw_events(server, body)
    names = [name for name, _ in events if name != "ping"]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[2:] == ["content_block_delta"] * len(deltas) + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[[n for n, _ in events].index("content_block_start")][1]["content_block"] == {
        "type": "thinking",
        "thinking": "",
        "signature": "",
    }
    assert {d["type"] for d in deltas[:-1]} == {"thinking_delta"} and deltas[-1]["type"] == "signature_delta"
    thinking = "".join(d["thinking"] for d in deltas[:-1])
    assert thinking.strip() and "<think>" not in thinking
    assert events[-2][1]["delta"]["stop_reason"] in {"end_turn", "max_tokens"}

    reply = client_for(server).messages.create(
        model="claude-local",
        max_tokens=12,
        messages=messages,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    block = reply.content[0]
    assert block.type == "thinking" and block.thinking == thinking
    assert block.signature == deltas[-1]["signature"]


def test_a_prefilled_reply_continues_the_text_with_its_space(server) -> None:  # type: ignore[no-untyped-def]
    prefill = "The capital of France is"
    reply = client_for(server).messages.create(
        model="claude-x",
        max_tokens=8,
        messages=[  # no temperature: the default model's own sampling is greedy
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": prefill},
        ],
    )
    text = reply.content[0].text  # type: ignore[union-attr]
    assert text.startswith(" Paris"), text  # the reply alone, which the client appends to its prefill
