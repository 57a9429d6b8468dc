"""Tool calls in every format mlx-lm parses: detected from the tokenizer as mlx-lm detects it, read
whole or in 1-3 character pieces alike, and text that only looked like a call stays text."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.prompting.tool_format import HERMES, ToolFormat
from semantic.protocols.tool_parser import (
    ParsedPart,
    TextPart,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
)
from tests.tool_call_samples import ARGUMENTS, BY_KEY, FAMILIES, TOOLS, tokenizer_for

Calls = list[tuple[str, dict[str, object]]]


def tool_format(key: str) -> ToolFormat:
    return ChatFormat(tokenizer_for(key)).tool_format


def run(key: str, chunks: list[str], tools: list[dict[str, object]] | None = TOOLS) -> list[ParsedPart]:
    parser = ToolCallParser(tool_format(key), tools)
    parts: list[ParsedPart] = []
    for chunk in chunks:
        parts += parser.feed(chunk)
    return parts + parser.finish()


def summary(parts: list[ParsedPart]) -> tuple[str, Calls]:
    """All text joined, and each call's name and arguments, checked against its streamed parts."""
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    calls: Calls = []
    streamed: dict[int, str] = {}
    opened: dict[int, str] = {}
    for part in parts:
        match part:
            case ToolCallStart(index=index, name=name):
                assert index == len(calls) and index not in opened
                opened[index] = name
            case ToolArgumentsDelta(index=index, json_text=json_text):
                streamed[index] = streamed.get(index, "") + json_text
            case ToolCallEnd(index=index, name=name, arguments=arguments):
                assert opened[index] == name and json.loads(streamed[index]) == arguments
                calls.append((name, arguments))
    return text, calls


def pieces(text: str, seed: int) -> list[str]:
    """`text` cut into pieces of 1 to 3 characters."""
    rng = random.Random(seed)
    cuts = [0]
    while cuts[-1] < len(text):
        cuts.append(min(len(text), cuts[-1] + rng.randint(1, 3)))
    return [text[a:b] for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize("key", BY_KEY)
def test_each_family_is_detected_as_mlx_lm_names_it(key: str) -> None:
    family = BY_KEY[key]
    chat = ChatFormat(tokenizer_for(key))
    assert chat.tool_format.name == family.parser
    # The sample is what the family's template writes for a call in the history...
    call = {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    assert family.call in chat.render(history, TOOLS)
    # ...and a forced call opens it as the model would.
    if key != "llama3_python_tag":  # forcing writes Llama's bare form
        assert family.call.startswith(chat.forced_call_prefix("get_weather"))
        assert chat.forced_call_prefix("get_weather").startswith(chat.forced_call_prefix(None))
    assert chat.tool_call_closer == (chat.tool_format.end or None)


@pytest.mark.parametrize("key", BY_KEY)
def test_each_family_reads_whole_or_in_1_to_3_character_pieces(key: str) -> None:
    family = BY_KEY[key]
    reply = (
        family.text_before + family.call + (" Done." if family.parser not in ("mistral", "llama3") else "")
    )
    expected = (reply.replace(family.call, ""), [("get_weather", ARGUMENTS)])
    assert summary(run(key, [reply])) == expected
    for seed in range(3):
        assert summary(run(key, pieces(reply, seed))) == expected


def test_text_around_a_call_streams_as_it_arrives() -> None:
    parser = ToolCallParser(tool_format("qwen3_coder"), TOOLS)
    assert parser.feed("Let me ") == [TextPart("Let me ")]
    assert parser.feed("check <tool") == [TextPart("check ")]  # `<tool` may open a call: held
    assert parser.feed("_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n") == []
    done = parser.feed("</function>\n</tool_call> Bye")
    assert done == [
        ToolCallStart(0, "get_weather"),
        ToolArgumentsDelta(0, '{"city": "Paris"}'),
        ToolCallEnd(0, "get_weather", {"city": "Paris"}),
        TextPart(" Bye"),
    ]
    assert parser.finish() == []


def test_the_request_tools_type_the_arguments_as_mlx_lm_does() -> None:
    call = BY_KEY["qwen3_coder"].call
    assert summary(run("qwen3_coder", [call], tools=None))[1] == [
        ("get_weather", {"city": "Paris", "days": "3"})
    ]
    assert summary(run("qwen3_coder", [call]))[1] == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize(
    ("key", "reply", "names"),
    [
        (
            "hermes",
            BY_KEY["hermes"].call + "\n" + BY_KEY["hermes"].call.replace("get_weather", "ls"),
            ["get_weather", "ls"],
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
            '{"query": "weather"}<|tool_call_end|><|tool_call_begin|>functions.read_file:1'
            '<|tool_call_argument_begin|>{"path": "/tmp/a.txt"}<|tool_call_end|><|tool_calls_section_end|>',
            ["search", "read_file"],
        ),
        (
            "minimax_m2",
            '<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">weather</parameter>\n'
            '</invoke>\n<invoke name="read_file">\n<parameter name="path">/tmp/a.txt</parameter>\n'
            "</invoke>\n</minimax:tool_call>",
            ["search", "read_file"],
        ),
        ("gemma4", '<|tool_call>call:glob{pattern:<|"|>*.md<|"|>}call:ls{}<tool_call|>', ["glob", "ls"]),
        ("pythonic", '<|tool_call_start|>[glob(pattern="*.md"), ls()]<|tool_call_end|>', ["glob", "ls"]),
        ("llama3", '{"name": "glob", "parameters": {}}; {"name": "ls", "parameters": {}}', ["glob", "ls"]),
    ],
)
def test_several_calls_in_a_reply_get_running_indices(key: str, reply: str, names: list[str]) -> None:
    for chunks in ([reply], pieces(reply, 7)):
        parts = run(key, chunks)
        assert [p.index for p in parts if isinstance(p, ToolCallEnd)] == list(range(len(names)))
        assert [name for name, _ in summary(parts)[1]] == names


@pytest.mark.parametrize(
    ("key", "reply"),
    [
        ("hermes", "Plain text with a < sign and [brackets] and {braces}."),
        ("hermes", "Text, then a broken call <tool_call> not json </tool_call> and more text."),
        ("json_tools", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),
        ("qwen3_coder", "<tool_call>\nno function here\n</tool_call> after"),
        ("pythonic", "<|tool_call_start|>not python(<|tool_call_end|>"),
        ("minimax_m2", "<minimax:tool_call>\nnothing to invoke\n</minimax:tool_call>"),
        ("kimi_k2", "<|tool_calls_section_begin|>nothing<|tool_calls_section_end|>"),
        ("llama3", 'Use {"name": "x"} like this.'),
        ("llama3", '{"name": "x", but then prose'),
        ("mistral", "[TOOL_CALLS] are how I would call a tool"),
    ],
)
def test_text_that_only_looks_like_a_call_stays_text(key: str, reply: str) -> None:
    assert summary(run(key, [reply])) == (reply, [])
    assert summary(run(key, pieces(reply, 1))) == (reply, [])


def test_a_parser_that_is_off_passes_everything_as_text() -> None:
    disabled = ToolCallParser(tool_format("hermes"), TOOLS, enabled=False)
    call = BY_KEY["hermes"].call
    assert disabled.feed(call) == [TextPart(call)] and disabled.finish() == []


@pytest.mark.parametrize(
    ("key", "reply", "calls"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "cut", "arguments": {"text": "unfinished',
            [("cut", {"text": "unfinished"})],
        ),
        (
            "mistral_v3",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": [2',
            [("add", {"a": 1, "b": [2]})],
        ),
        ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": "tw', [("add", {"a": 1, "b": "tw"})]),
        ("llama3", '{"name": "add", "parameters": {"a": 1', [("add", {"a": 1})]),
        ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": 1}}}\n</tool_call>', [("x", {"a": 1})]),
    ],
)
def test_a_json_call_cut_off_or_overrun_is_read_as_far_as_it_goes(key: str, reply: str, calls: Calls) -> None:
    assert summary(run(key, [reply]))[1] == calls


def test_a_cut_off_call_that_no_parser_reads_comes_back_as_text() -> None:
    reply = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert summary(run("qwen3_coder", [reply])) == (reply, [])


@pytest.mark.parametrize("key", ["hermes", "glm47", "qwen3_coder", "minimax_m2"])
@pytest.mark.parametrize("step", [1, 2, 1000])
def test_a_closer_written_again_right_after_a_call_is_dropped_not_text(key: str, step: int) -> None:
    """GLM-4.7 was seen writing `</tool_call>` again after a guided call had closed."""
    closer = tool_format(key).end
    reply = BY_KEY[key].call + "\n" + closer + "\nDone."
    parser = ToolCallParser(tool_format(key), TOOLS)
    parts = [part for at in range(0, len(reply), step) for part in parser.feed(reply[at : at + step])]
    assert summary(parts + parser.finish()) == ("\nDone.", [("get_weather", ARGUMENTS)])
    assert parser.failures == [f"a stray {closer} after a call, dropped"]


@pytest.mark.parametrize(
    "after",
    ["\n</tool_thing> stays", "\n</tool_", "  Done. </tool_call>", "\n<tool_call>\nnot json\n</tool_call>"],
)
def test_text_after_a_call_that_is_not_its_closer_again_stays_text(after: str) -> None:
    call = BY_KEY["hermes"].call
    for chunks in ([call + after], list(call + after)):
        assert summary(run("hermes", chunks)) == (after, [("get_weather", ARGUMENTS)])


def test_whitespace_between_two_calls_stays_text() -> None:
    call = BY_KEY["hermes"].call
    assert summary(run("hermes", [call + "\n\n" + call])) == ("\n\n", [("get_weather", ARGUMENTS)] * 2)


SAMPLES = [(family.key, family.text_before + family.call) for family in FAMILIES] + [
    ("hermes", "Text, then a broken call <tool_call> not json </tool_call> and more text."),
    ("llama3", '{"name": "cut", "parameters": {"text": "unfinished'),
]


@st.composite
def split(draw: st.DrawFn) -> tuple[str, list[str]]:
    key, text = draw(st.sampled_from(SAMPLES))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return key, [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@settings(max_examples=200, deadline=None)
@given(split())
def test_splitting_the_text_never_changes_the_result(sample: tuple[str, list[str]]) -> None:
    key, chunks = sample
    assert summary(run(key, chunks)) == summary(run(key, ["".join(chunks)]))


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_closer_inside_a_json_string_argument_is_part_of_the_call(step: int) -> None:
    text = 'Sure. <tool_call>\n{"name": "note", "arguments": {"text": "a</tool_call>b"}}\n</tool_call> done'
    parser = ToolCallParser(HERMES)
    parts = [part for at in range(0, len(text), step) for part in parser.feed(text[at : at + step])]
    parts += parser.finish()
    ends = [part for part in parts if isinstance(part, ToolCallEnd)]
    assert [(end.name, end.arguments) for end in ends] == [("note", {"text": "a</tool_call>b"})]
    assert "".join(part.text for part in parts if isinstance(part, TextPart)) == "Sure.  done"
