"""Output that obeys its schema: JSON schemas and forced tool calls decoded under a grammar, with the
real default model behind a real server, checked with `jsonschema`: greedy and sampled replies per
API, each prompt different (3 each in the suite, each schema once; 12 with the slow tests;
`STRUCTURED_OUTPUT_REPLIES=50` for the full run)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
REVIEW = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "keywords": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 4,
        },
    },
    "required": ["sentiment", "score", "keywords"],
    "additionalProperties": False,
}
STEPS = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 1, "maximum": 9},
                    "do": {"type": "string", "maxLength": 40},
                },
                "required": ["n", "do"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
        "done": {"type": "boolean"},
    },
    "required": ["title", "steps", "done"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, REVIEW, STEPS]
TOPICS = [
    "a baker", "a pilot", "a chess player", "a gardener", "a violinist", "a nurse", "a sailor",
    "a teacher", "a painter", "a miner", "a chef", "a poet", "a judge", "a farmer", "a diver",
    "a potter", "a tailor", "a coder", "a runner", "a monk", "a clown", "a smith", "a hunter",
    "a weaver", "a barber",
]  # fmt: skip
NUM_REPLIES = int(os.environ.get("STRUCTURED_OUTPUT_REPLIES", "3"))
# Replies per temperature: the suite's, and more with the slow tests.
REPLIES = [pytest.param(NUM_REPLIES, id="suite"), pytest.param(12, id="more", marks=pytest.mark.slow)]
TEMPERATURES = (0.0, 0.8)  # greedy and sampled
# The cap is room, not something under test: a schema's grammar ends each reply, and a sampled one
# may wander into rare multi-byte text, a few tokens a character, before it does. The longest of
# 190 sampled STEPS replies took 186 tokens; one in CI was cut at 200 inside its third step's
# 40-character string. Every string and array in these schemas has a bound (only a number's
# digits and CITY's extra keys have none), so 1024 holds a whole document even at several tokens a
# character.
ROOM = 1024
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}


@pytest.fixture
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server


def _cases(num_replies: int) -> list[tuple[dict[str, Any], str, float]]:
    """Each prompt greedy and sampled: all of them are asked at once, so they decode as one batch."""
    cases = []
    for temperature in TEMPERATURES:
        for index in range(num_replies):
            schema = SCHEMAS[index % len(SCHEMAS)]
            topic = TOPICS[index % len(TOPICS)]
            cases.append((schema, f"Describe {topic} (case {index}) as JSON.", temperature))
    return cases


def _all(fn: Any, cases: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(min(len(cases), 16)) as pool:  # the server's default batch
        return list(pool.map(fn, cases))


@pytest.mark.parametrize("num_replies", REPLIES)
def test_openai_json_schema_replies_validate(server, num_replies: int) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

    def ask(case: tuple[dict[str, Any], str, float]) -> tuple[dict[str, Any], str, str | None]:
        schema, prompt, temperature = case
        reply = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=ROOM,
            temperature=temperature,
            seed=7,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema, "strict": True},
            },
        )
        return schema, reply.choices[0].message.content or "", reply.choices[0].finish_reason

    for schema, text, finish_reason in _all(ask, _cases(num_replies)):
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("num_replies", REPLIES)
def test_anthropic_output_config_replies_validate(server, num_replies: int) -> None:  # type: ignore[no-untyped-def]
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)

    def ask(case: tuple[dict[str, Any], str, float]) -> tuple[dict[str, Any], str, str | None]:
        schema, prompt, temperature = case
        reply = client.messages.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=ROOM,
            output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body={"temperature": temperature},
        )
        text = "".join(block.text for block in reply.content if block.type == "text")
        return schema, text, reply.stop_reason

    for schema, text, stop_reason in _all(ask, _cases(num_replies)):
        assert stop_reason == "end_turn", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_the_beta_output_format(server) -> None:  # type: ignore[no-untyped-def]
    oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = oa.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Return a JSON object with keys name and color for a cat."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with client.messages.stream(
        model="default",
        messages=[{"role": "user", "content": "Review: the soup was cold."}],
        max_tokens=200,
        extra_body={"temperature": 0, "output_format": {"type": "json_schema", "schema": REVIEW}},
    ) as stream:
        text = "".join(stream.text_stream)
    jsonschema.validate(json.loads(text), REVIEW)


@pytest.mark.parametrize("num_replies", REPLIES)
@pytest.mark.parametrize("temperature", TEMPERATURES, ids=["greedy", "sampled"])
def test_forced_tool_call_input_validates(server, temperature: float, num_replies: int) -> None:  # type: ignore[no-untyped-def]
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tools = [
        {"name": "get_weather", "description": "Weather forecast for a city", "input_schema": WEATHER},
        {"name": "get_time", "description": "Time in a city", "input_schema": CITY},
    ]  # fmt: skip
    choices = [{"type": "tool", "name": "get_weather"}, {"type": "any"}]

    def ask(index: int) -> tuple[Any, Any]:
        reply = client.messages.create(
            model="default",
            messages=[
                {"role": "user", "content": f"What is the weather in {TOPICS[index % len(TOPICS)][2:]}ville?"}
            ],
            max_tokens=ROOM,
            extra_body={"temperature": temperature},
            tools=tools,  # type: ignore[arg-type]
            tool_choice=choices[index % 2],  # type: ignore[arg-type]
        )
        return reply.stop_reason, reply.content

    for stop_reason, content in _all(ask, list(range(num_replies))):
        assert stop_reason == "tool_use", content
        (call,) = [block for block in content if block.type == "tool_use"]
        schema = next(tool["input_schema"] for tool in tools if tool["name"] == call.name)
        jsonschema.validate(call.input, schema)
        assert not [block for block in content if block.type == "text" and block.text.strip()], content


def test_a_forced_call_whose_argument_holds_the_call_closer_is_not_cut_there(server) -> None:  # type: ignore[no-untyped-def]
    """The grammar, not a stop string, ends a forced call: `</tool_call>` inside a string is text."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    closer = {"type": "object", "properties": {"note": {"enum": ["a</tool_call>b"]}}, "required": ["note"]}
    reply = client.messages.create(
        model="default",
        messages=[{"role": "user", "content": "Write the note."}],
        max_tokens=60,
        tools=[{"name": "write_note", "description": "Write a note", "input_schema": closer}],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "write_note"},
    )
    assert reply.stop_reason == "tool_use", reply.content
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.input == {"note": "a</tool_call>b"}


def test_unenforceable_schemas_are_refused_in_each_protocols_shape(server) -> None:  # type: ignore[no-untyped-def]
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=x)"}}}
    negation = {"not": {"type": "string"}}
    oa = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": lookahead}},
        )
    assert "look-around" in str(refused.value)
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused_too:
        client.messages.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            output_config={"format": {"type": "json_schema", "schema": negation}},
        )
    assert refused_too.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "not" in refused_too.value.body["error"]["message"]  # type: ignore[index]
