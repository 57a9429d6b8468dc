"""The HTTP path with the official OpenAI SDK against a real server process on loopback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import SystemConfig
from semantic.engine.loop.commands import InspectPool
from semantic.protocols.app import create_app
from semantic.protocols.common import GATE_KEY, SYSTEM_KEY
from tests.waiting import wait_until_async

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server


def client_for(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_stream_and_non_stream_through_the_openai_sdk(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=QUESTION,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 5  # streamed token by token
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    reply = client.chat.completions.create(model="default", messages=QUESTION, temperature=0)
    assert reply.choices[0].message.content == text
    assert reply.usage is not None and reply.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert [m.id for m in client.models.list()] == [default_model_dir.name]


def test_bad_requests_get_openai_errors(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.chat.completions.create(model="default", messages=QUESTION, n=2)
    with pytest.raises(openai.BadRequestError, match="invalid agent id"):
        client.chat.completions.create(
            model="default", messages=QUESTION, extra_headers={"x-agent-id": "../x"}
        )
    with pytest.raises(openai.BadRequestError, match="tokens; the model's context holds 8192"):
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hello " * 9000}]
        )
    with pytest.raises(openai.BadRequestError, match="invalid request body"):
        client.chat.completions.create(model="default", messages=[{"role": 3}])  # type: ignore[list-item]


@pytest.mark.parametrize("model", ["default"])
def test_session_resumes_across_a_restart(server_factory, default_model_dir, tiny_model_dirs, model) -> None:  # type: ignore[no-untyped-def]
    model_dir = default_model_dir if model == "default" else tiny_model_dirs[model]
    # A random-weight model's replies need not re-tokenise to the same ids once sent back as text;
    # the sliding-window model's restart oracle runs through the kept-conversation API instead
    # (tests/test_agents_api.py).
    max_tokens = 16 if model == "default" else 1
    server = server_factory("--model", str(model_dir), "--cache-budget-mb", "512").start()
    client = client_for(server)
    messages = [{"role": "user", "content": "My name is Ada. Remember it."}]
    options = {"model": "default", "temperature": 0, "max_tokens": max_tokens}
    first = client.chat.completions.create(messages=messages, extra_body={"session_id": "ada"}, **options)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What is my name?"},
    ]
    assert server.stop() == 0  # SIGTERM flushes the cache
    assert "flushed 1 agent caches" in server.log()
    restarted = server_factory(*server.args, cache_dir=server.cache_dir).start()
    client = client_for(restarted)
    warm = client.chat.completions.create(messages=messages, extra_body={"session_id": "ada"}, **options)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens  # type: ignore[union-attr]
    cold = client.chat.completions.create(messages=messages, extra_body={"session_id": "cold"}, **options)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert warm.choices[0].message.content == cold.choices[0].message.content


async def test_client_disconnects_free_batch_slots_and_blocks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # The tiny random-weight model: what is checked is the slots and blocks, not the words.
    engine_config = EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=512)
    config = SystemConfig(engine=engine_config, cache_dir=tmp_path)
    app = create_app(config)
    async with TestServer(app, host="127.0.0.1") as test_server:
        engine = app[SYSTEM_KEY].engine

        async def state() -> tuple[int, int, int]:
            report = await engine.ask(InspectPool())
            return report.num_free_blocks, report.num_running, report.num_in_batch

        before = await state()
        body = {
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "stream": True,
            "max_tokens": 500,
            "temperature": 0,  # greedy: no reply ends (and keeps its cache) before the disconnect
        }

        async def disconnect_mid_stream(session: aiohttp.ClientSession) -> None:
            async with session.post(test_server.make_url("/v1/chat/completions"), json=body) as response:
                seen = 0
                async for line in response.content:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                        "content"
                    ):
                        seen += 1
                        if seen == 2:
                            return  # closes the connection mid-stream

        async with aiohttp.ClientSession() as session:
            for _ in range(2):  # 20 disconnects, 10 at a time: more than the batch's 16 slots
                await asyncio.gather(*(disconnect_mid_stream(session) for _ in range(10)))

        async def all_freed() -> bool:
            return await state() == before

        await wait_until_async(all_freed, "every disconnected stream gave back its slot and blocks")
        assert app[GATE_KEY].num_in_flight == 0  # every admission slot was given back


PARIS = '{"city": "Paris"}'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tool_calls_through_the_openai_sdk(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"model": "gpt-4o", "temperature": 0, "max_tokens": 48, "tools": [WEATHER_TOOL]}
    reply = client.chat.completions.create(messages=ask, tool_choice="required", **options)  # type: ignore[call-overload]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)

    chunks = list(
        client.chat.completions.create(messages=ask, tool_choice="required", stream=True, **options)
    )  # type: ignore[call-overload]
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    answer = client.chat.completions.create(  # type: ignore[call-overload]
        messages=[
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 C"},
        ],
        **options,
    )  # fmt: skip
    assert answer.choices[0].finish_reason in {"stop", "length"} and answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.chat.completions.create(model="llama-3", messages=ask)


def test_reasoning_comes_back_as_reasoning_content(server) -> None:  # type: ignore[no-untyped-def]
    # Continuing an assistant message that opens `<think>` puts the reply inside a reasoning block,
    # as a reasoning model's template does; the default model never closes it.
    client = client_for(server)
    messages = [*QUESTION, {"role": "assistant", "content": "<think>"}]
    options = {"model": "default", "temperature": 0, "max_tokens": 12}
    extra = {"continue_final_message": True}
    chunks = list(client.chat.completions.create(messages=messages, stream=True, extra_body=extra, **options))  # type: ignore[call-overload]
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert reasoning.strip() and "<think>" not in reasoning
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(messages=messages, extra_body=extra, **options)  # type: ignore[call-overload]
    assert reply.choices[0].message.reasoning_content == reasoning  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError, match="continue_final_message needs a final assistant"):
        client.chat.completions.create(messages=QUESTION, extra_body=extra, **options)  # type: ignore[call-overload]
    prefilled = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    continued = client.chat.completions.create(messages=prefilled, extra_body=extra, **options)  # type: ignore[call-overload]
    assert str(continued.choices[0].message.content).startswith(" Paris")  # its first space kept
