"""The streaming tool-call parser: same result however the text is split, and text stays text."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from semantic.protocols.tool_parser import (
    ParsedPart,
    TextPart,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallParser,
    ToolCallStart,
)

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a/b.txt", "n": [1, {"x": "}"}]}}'
    "\n</tool_call>"
)
SAMPLES = [
    HERMES,
    HERMES + "\n<tool_call>\n" + '{"name": "ls", "arguments": {}}' + "\n</tool_call>",
    '{"name": "search", "parameters": {"q": "moon \\"phase\\""}}',
    '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "<|python_tag|>" + '{"name": "add", "arguments": {"a": 1}}' + "<|eom_id|>",
    "Plain text with a < sign and [brackets] and {braces}.",
    "Text, then a broken call <tool_call> not json </tool_call> and more text.",
    '<tool_call>\n{"name": "cut", "arguments": {"text": "unfinished',
]


def run(chunks: list[str]) -> list[ParsedPart]:
    parser = ToolCallParser()
    parts: list[ParsedPart] = []
    for chunk in chunks:
        parts += parser.feed(chunk)
    return parts + parser.finish()


def summary(parts: list[ParsedPart]) -> tuple[str, list[tuple[str, str, dict[str, object]]]]:
    """All text joined, and per call: its name, its streamed arguments, its final arguments."""
    text = "".join(p.text for p in parts if isinstance(p, TextPart))
    calls = []
    streamed: dict[int, str] = {}
    for part in parts:
        if isinstance(part, ToolArgumentsDelta):
            streamed[part.index] = streamed.get(part.index, "") + part.json_text
        if isinstance(part, ToolCallEnd):
            calls.append((part.name, streamed.get(part.index, ""), part.arguments))
    return text, calls


@st.composite
def split(draw: st.DrawFn) -> list[str]:
    text = draw(st.sampled_from(SAMPLES))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(split())
def test_splitting_the_text_never_changes_the_result(chunks: list[str]) -> None:
    assert summary(run(chunks)) == summary(run(["".join(chunks)]))


def test_calls_are_read_in_every_supported_form() -> None:
    text, calls = summary(run([HERMES]))
    assert text == "Let me look.\n"
    ((name, streamed, arguments),) = calls
    assert name == "read" and arguments == {"path": "a/b.txt", "n": [1, {"x": "}"}]}
    assert json.loads(streamed) == arguments  # what a client assembles from the deltas
    assert summary(run([SAMPLES[2]]))[1][0][::2] == ("search", {"q": 'moon "phase"'})
    assert summary(run([SAMPLES[3]]))[1][0][::2] == ("add", {"a": 1, "b": 2})
    assert summary(run([SAMPLES[4]]))[1][0][::2] == ("add", {"a": 1})
    assert [c[0] for c in summary(run([SAMPLES[1]]))[1]] == ["read", "ls"]


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    assert summary(run([SAMPLES[5]])) == (SAMPLES[5], [])
    assert summary(run([SAMPLES[6]])) == (SAMPLES[6], [])
    assert summary(run(['Use {"name": "x"} like this.'])) == ('Use {"name": "x"} like this.', [])
    disabled = ToolCallParser(enabled=False)
    assert disabled.feed(HERMES) == [TextPart(HERMES)] and disabled.finish() == []


def test_a_call_cut_off_by_max_tokens_is_closed_into_valid_json() -> None:
    parts = run([SAMPLES[7]])
    assert isinstance(parts[0], ToolCallStart)
    ((name, streamed, arguments),) = summary(parts)[1]
    assert name == "cut" and json.loads(streamed) == arguments == {"text": "unfinished"}
