"""Bad input refused at the edge, never answered with a wrong 200 (issue 63, items 7 and 9): sampling
too small for float32 is greedy, a schema with no finite instance is a 400 (and a reply its grammar
cuts short is an error, not a "stop"), OpenAI's unknown roles and content parts, Anthropic's tool
results and tool choices that name nothing, and count_tokens refusing what a turn would refuse.

One real server (the default model) for the HTTP round trips; the grammar tests use its real tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher
from mlx_lm.utils import load_tokenizer

from semantic.actors.prompting.output_grammars import json_schema_grammar
from semantic.actors.prompting.schema_finiteness import has_finite_instance
from semantic.engine.decoding.grammar_matcher import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    IncompleteOutputError,
)
from semantic.engine.decoding.sampling import MIN_TEMPERATURE, MIN_TOP_P, GenerationDefaults, SamplingParams
from tests.agent_api_client import call
from tests.server_process import ServerProcess

HI = [{"role": "user", "content": "List the days of the week."}]
RECURSIVE = {"$ref": "#"}
NESTED_FOREVER = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
NO_FINITE_VALUE = "no finite JSON value satisfies the schema"


def chat(server: ServerProcess, **fields: Any) -> tuple[int, Any]:
    return call(server, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 8, **fields})


def messages(server: ServerProcess, path: str = "/v1/messages", **fields: Any) -> tuple[int, Any]:
    return call(server, "POST", path, {"model": "claude-x", "messages": HI, "max_tokens": 8, **fields})


def test_sampling_too_small_for_float32_is_greedy_and_nan_is_refused() -> None:
    assert SamplingParams(temperature=1e-39).is_greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2, top_p=0.5) == SamplingParams(temperature=0.0)
    assert SamplingParams(temperature=0.7, top_p=1e-300).is_greedy
    tiny_top_p = SamplingParams(temperature=None, top_p=1e-300)  # also when the model's default fills in
    assert tiny_top_p.with_defaults(GenerationDefaults(0.7, 0.9, 0)).is_greedy
    assert SamplingParams(temperature=None).with_defaults(GenerationDefaults(1e-39)).is_greedy
    kept = SamplingParams(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P)
    assert (kept.temperature, kept.top_p) == (MIN_TEMPERATURE, MIN_TOP_P)
    for bad in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=bad):
                SamplingParams(**{bad: value})  # type: ignore[arg-type]


def test_a_tiny_temperature_or_top_p_gives_the_greedy_reply(shared_server: ServerProcess) -> None:
    status, greedy = chat(shared_server, temperature=0)
    assert status == 200, greedy
    for options in (
        {"temperature": 1e-39, "seed": 1},
        {"temperature": 1e-39, "seed": 2},
        {"temperature": 1.0, "top_p": 1e-300, "seed": 3},
    ):
        status, reply = chat(shared_server, **options)
        assert status == 200, reply
        assert reply["choices"][0]["message"] == greedy["choices"][0]["message"], options


def test_which_schemas_have_a_finite_instance() -> None:
    node = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    maybe_next = {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}
    linked = {
        "$defs": {"n": {"type": "object", "properties": {"next": maybe_next}, "required": ["next"]}},
        "$ref": "#/$defs/n",
    }
    mutual = {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        "$ref": "#/$defs/a",
    }
    pair = {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2}
    finite: list[Any] = [node, {**node, "required": ["kids"]}, linked, {"$ref": "#/$defs/x"}, {"$ref": "#a"}]
    infinite: list[Any] = [
        RECURSIVE,
        NESTED_FOREVER,
        mutual,
        pair,
        {"type": "array", "items": RECURSIVE, "minItems": 1},
    ]
    assert [has_finite_instance(schema) for schema in finite + infinite] == [True] * 5 + [False] * 5
    with pytest.raises(GrammarError, match=NO_FINITE_VALUE):
        json_schema_grammar(NESTED_FOREVER, "schema")


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE}}},
        ),
        ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": NESTED_FOREVER}}}),
        ("/v1/messages", {"tools": [{"name": "loop", "input_schema": RECURSIVE, "strict": True}]}),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "loop", "parameters": NESTED_FOREVER}}],
                "tool_choice": {"type": "function", "function": {"name": "loop"}},
            },
        ),
    ],
    ids=["openai-response-format", "anthropic-output-config", "anthropic-strict-tool", "openai-forced-call"],
)
def test_a_schema_with_no_finite_instance_is_a_400(
    shared_server: ServerProcess, path: str, fields: dict[str, Any]
) -> None:
    body = {"messages": HI, "max_tokens": 8, **fields}
    is_anthropic = path.startswith("/v1/messages")
    status, reply = call(shared_server, "POST", path, {"model": "claude-x", **body} if is_anthropic else body)
    assert status == 400, reply
    assert NO_FINITE_VALUE in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


def test_a_reply_its_grammar_cuts_short_is_an_error_not_a_stop(tokenizer: Any) -> None:
    eos = list(tokenizer.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, eos)
    vocab = len(tokenizer.vocab)
    empty = LLMatcher.grammar_from_json_schema(RECURSIVE)  # what the schema check refuses before this
    with pytest.raises(GrammarError, match="no reply can satisfy it"):
        compiler.matcher(empty)

    ll_tokenizer = compiler._llguidance_tokenizer()  # the compiler's own, for a matcher it would refuse
    cut_short = GrammarMatcher(LLMatcher(ll_tokenizer, empty, log_level=0), ll_tokenizer, eos, empty, None)
    allowed = cut_short(mx.array([1, 2]), mx.zeros((1, vocab)))
    assert {int(t) for t in np.flatnonzero(np.isfinite(np.array(allowed[0])))} <= set(eos)
    with pytest.raises(IncompleteOutputError, match="no token that continues"):
        cut_short.check_complete()

    complete = compiler.matcher(json_schema_grammar({"enum": ["yes"]}, "schema"))
    tokens = [1, 2]
    complete(mx.array(tokens), mx.zeros((1, vocab)))
    for token in tokenizer.encode('"yes"', add_special_tokens=False):
        tokens.append(token)
        complete(mx.array(tokens), mx.zeros((1, vocab)))  # ends allowing only the end: accepting
    complete.check_complete()


def test_openai_refuses_unknown_roles_and_content_parts(shared_server: ServerProcess) -> None:
    for messages_field, path in (
        ([{"role": "robot", "content": "hi"}], "$.messages[0].role"),
        ([{"role": "user", "content": [{"type": "video", "text": "hi"}]}], "$.messages[0].content[0].type"),
    ):
        status, reply = chat(shared_server, messages=messages_field)
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
        assert path in reply["error"]["message"], reply
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    status, reply = chat(
        shared_server, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    )
    assert status == 400 and "reads text only" in reply["error"]["message"], reply

    # `developer` is OpenAI's newer `system`: the template renders it as one (no default system prompt).
    def prompt_tokens(role: str) -> int:
        status, reply = chat(
            shared_server, messages=[{"role": role, "content": "Be brief."}, *HI], max_tokens=1
        )
        assert status == 200, reply
        return int(reply["usage"]["prompt_tokens"])

    assert prompt_tokens("developer") == prompt_tokens("system")


def test_anthropic_refuses_tool_results_and_choices_that_name_nothing(shared_server: ServerProcess) -> None:
    weather = {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    call_block = {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}
    asked = [*HI, {"role": "assistant", "content": [call_block]}]

    def result(tool_use_id: str) -> dict[str, Any]:
        return {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "22C"}],
        }

    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, reply = messages(shared_server, path, tools=[weather], messages=[*asked, result("toolu_01")])
        assert status == 200, reply
        status, reply = messages(shared_server, path, tools=[weather], messages=[*asked, result("toolu_02")])
        assert status == 400 and "messages.2.content.0" in reply["error"]["message"], reply
        assert "'toolu_02'" in reply["error"]["message"] and reply["type"] == "error"
        status, reply = messages(shared_server, path, messages=[*HI, result("toolu_01")])
        assert status == 400 and "tool_use_id" in reply["error"]["message"], reply
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
            status, reply = messages(shared_server, path, tool_choice=choice)
            assert status == 400 and "the request has no tools" in reply["error"]["message"], reply
        status, reply = messages(
            shared_server, path, tools=[weather], tool_choice={"type": "tool", "name": "nope"}
        )
        assert status == 400 and "no tool named 'nope'" in reply["error"]["message"], reply


def test_count_tokens_takes_what_a_turn_takes_and_refuses_what_it_refuses(
    shared_server: ServerProcess,
) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [
        {"name": f"tool_{i}", "description": "Looks something up.", "input_schema": schema} for i in range(24)
    ]
    status, turn = messages(shared_server, tools=tools, max_tokens=1)
    assert status == 200, turn
    status, counted = messages(shared_server, "/v1/messages/count_tokens", tools=tools)
    assert status == 200 and counted["input_tokens"] == turn["usage"]["input_tokens"], counted

    # max_tokens over its bound is refused by both.
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, reply = messages(shared_server, path, max_tokens=10**6)
        assert status == 400 and "limits.max_tokens" in reply["error"]["message"], (path, reply)
    # Over the context once tokenized: a turn is refused, and the count says by how much (as
    # Anthropic's does: clients count to learn that a conversation no longer fits).
    too_long = [{"role": "user", "content": "hi " * 9000}]
    status, reply = messages(shared_server, messages=too_long)
    assert status == 400 and "8192" in reply["error"]["message"], reply
    status, counted = messages(shared_server, "/v1/messages/count_tokens", messages=too_long)
    assert status == 200 and counted["input_tokens"] > 8192, counted
