"""The reasoning splitter: the same parts however the reply is cut into pieces."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from semantic.protocols.reasoning import (
    ReasoningPart,
    ReasoningSplitter,
    ThinkingEnd,
    ThinkingPart,
    prompt_opens_thinking,
)


def merged(parts: list[ReasoningPart]) -> list[ReasoningPart]:
    out: list[ReasoningPart] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif isinstance(part, ThinkingPart) and out and isinstance(out[-1], ThinkingPart):
            out[-1] = ThinkingPart(out[-1].text + part.text)
        else:
            out.append(part)
    return out


def split(text: str, cuts: list[int], inside: bool = False) -> list[ReasoningPart]:
    splitter = ReasoningSplitter(inside)
    parts: list[ReasoningPart] = []
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for start, end in itertools.pairwise(bounds):
        parts += splitter.feed(text[start:end])
    return merged(parts + splitter.finish())


def test_reasoning_then_answer() -> None:
    assert split("\n<think>Paris is in France.</think>\n\nParis.", []) == [
        ThinkingPart("Paris is in France."),
        ThinkingEnd(),
        "\n\nParis.",
    ]
    assert split("Paris. <think>not reasoning</think>", []) == ["Paris. <think>not reasoning</think>"]
    assert split("cut short", [], inside=True) == [ThinkingPart("cut short"), ThinkingEnd()]
    assert split("<thi", []) == ["<thi"]


def test_prompt_opens_thinking() -> None:
    assert prompt_opens_thinking("<|Assistant|><think>\n")
    assert not prompt_opens_thinking("<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "Paris", "<th"])


@given(st.lists(PIECES, max_size=14), st.lists(st.integers(0, 200), max_size=8), st.booleans())
def test_any_split_gives_the_same_parts(pieces: list[str], cuts: list[int], inside: bool) -> None:
    text = "".join(pieces)
    whole = split(text, [], inside)
    assert split(text, cuts, inside) == whole
    rebuilt = "".join(
        p if isinstance(p, str) else p.text if isinstance(p, ThinkingPart) else "" for p in whole
    )
    assert len(rebuilt) <= len(text)  # only the tags (and blank space before `<think>`) are dropped
