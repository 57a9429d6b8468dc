"""Every tool-call family comes back as `tool_use` / `tool_calls` on both APIs, streamed and not.

The real aiohttp app (routes, middlewares, handlers, pipeline, parser) serves on loopback, and the
official SDKs call it. Each turn's prompt is prepared for real (`prepare_stateless` through a
ChatFormat whose tokenizer mlx-lm's loader reads as the family). Only the model is replaced: no
offline model writes these formats, so each family's reply is replayed token by token through the
engine's own TextStream (mlx-lm's streaming detokenizer, stop strings, max_tokens). Not an
end-to-end test of the engine; tests/test_anthropic.py and test_http.py run the real one.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web

from semantic.actors.engine_client import EngineConfig
from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.request_stream import RequestStream
from semantic.actors.system import SystemConfig
from semantic.actors.turns import TurnRequest, TurnStarted, prepare_stateless
from semantic.engine.decoding.text_stream import TextStream
from semantic.engine.loop.messages import (
    EventChannel,
    Finished,
    FinishReason,
    GenerationRequest,
    PromptStarted,
    TokenDelta,
)
from semantic.protocols.app import create_app
from semantic.protocols.common import SYSTEM_KEY
from semantic.protocols.settings import Settings
from tests.server_process import free_port
from tests.tool_call_samples import ARGUMENTS, BY_KEY, TOOLS, WEATHER, tokenizer_for

ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
ANTHROPIC_TOOL = {
    "name": WEATHER["name"],
    "description": WEATHER["description"],
    "input_schema": WEATHER["parameters"],
}
FORCED = {"type": "tool", "name": "get_weather"}


class ReplayedReplies:
    """Stands in for the agent system: prepares each turn as it does, then, for the model, replays
    the family (named by the request's `model`) as it would write its reply."""

    async def start_turn(self, turn: TurnRequest) -> TurnStarted:
        family = BY_KEY[str(turn.model)]
        tokenizer = tokenizer_for(family.key)
        prompt = prepare_stateless(ChatFormat(tokenizer), turn)
        if prompt.reply_prefix:  # a forced call: the prompt already opens it
            assert family.call.startswith(prompt.reply_prefix), "forced prefix is not the family's"
            reply = family.call.removeprefix(prompt.reply_prefix)
        else:
            reply = family.text_before + family.call
        stop = turn.sampling.stop + ((prompt.stop_after_call,) if prompt.stop_after_call else ())
        text_stream = TextStream(tokenizer.detokenizer, stop, tokenizer.eos_token_ids)
        loop = asyncio.get_running_loop()
        channel = EventChannel(loop)
        request = GenerationRequest(turn.request_id, prompt.token_ids, turn.sampling)
        channel.put(PromptStarted(len(prompt.token_ids), 0, "none"))
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        num_generated = 0
        for token in reply_ids[: turn.sampling.max_tokens]:
            num_generated += 1
            if text := text_stream.add_token(token):
                channel.put(TokenDelta([token], text))
            if text_stream.stop_hit:
                break
        if tail := text_stream.finish():
            channel.put(TokenDelta([], tail))
        is_cut = text_stream.stop_hit is None and turn.sampling.max_tokens < len(reply_ids)
        reason = FinishReason.LENGTH if is_cut else FinishReason.STOP
        channel.put(Finished(reason, text_stream.stop_hit, len(prompt.token_ids), 0, num_generated))
        return TurnStarted(RequestStream(request, channel, lambda _: None), prompt, family.key, None)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[str]:
    config = SystemConfig(EngineConfig(model=str(default_model_dir)), cache_dir=tmp_path_factory.mktemp("c"))
    app = create_app(config, Settings())
    app[SYSTEM_KEY] = ReplayedReplies()  # type: ignore[assignment]
    app.cleanup_ctx.clear()  # nothing to start: no engine
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    port = free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def tool_uses(content: list[Any]) -> list[tuple[str, object]]:
    return [(block.name, block.input) for block in content if block.type == "tool_use"]


def text_of(content: list[Any]) -> str:
    return "".join(block.text for block in content if block.type == "text")


@pytest.mark.parametrize("key", BY_KEY)
def test_each_family_is_a_tool_use_on_the_anthropic_api(base_url: str, key: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    options: dict[str, Any] = {"model": key, "max_tokens": 256, "tools": [ANTHROPIC_TOOL], "messages": ASK}
    reply = client.messages.create(**options)
    with client.messages.stream(**options) as stream:
        streamed = stream.get_final_message()  # the SDK joins the input_json_delta parts
    for message in (reply, streamed):
        assert message.stop_reason == "tool_use"
        assert tool_uses(message.content) == [("get_weather", ARGUMENTS)]
        assert text_of(message.content).strip() == BY_KEY[key].text_before.strip()
    if key != "llama3_python_tag":  # forcing writes Llama's bare form, tested as "llama3"
        forced = client.messages.create(**options, tool_choice=FORCED)  # type: ignore[arg-type]
        assert forced.stop_reason == "tool_use" and tool_uses(forced.content) == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize("key", BY_KEY)
def test_each_family_is_a_tool_call_on_the_openai_api(base_url: str, key: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    options: dict[str, Any] = {"model": key, "max_tokens": 256, "tools": TOOLS, "messages": ASK}
    choice = client.chat.completions.create(**options).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    assert (choice.message.content or "").strip() == BY_KEY[key].text_before.strip()

    chunks = list(client.chat.completions.create(**options, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert (
        {d.index for d in deltas} == {0} and deltas[0].function and deltas[0].function.name == "get_weather"
    )
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.function)) == ARGUMENTS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_call_cut_off_by_max_tokens_says_max_tokens(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    for key, is_read in (("hermes", True), ("qwen3_coder", False)):
        family = BY_KEY[key]
        cut_in_paris = family.text_before + family.call[: family.call.index("Paris") + 3]
        num_tokens = len(tokenizer_for(key).encode(cut_in_paris, add_special_tokens=False))
        options: dict[str, Any] = {"model": key, "tools": [ANTHROPIC_TOOL], "messages": ASK}
        reply = client.messages.create(max_tokens=num_tokens, **options)
        assert reply.stop_reason == "max_tokens"
        # A cut JSON call is closed and still a call; a cut XML call no parser reads is text.
        assert [name for name, _ in tool_uses(reply.content)] == (["get_weather"] if is_read else [])
        assert ("<function=get_weather>" in text_of(reply.content)) is not is_read
