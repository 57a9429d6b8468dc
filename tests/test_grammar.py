"""Grammar matchers driven the way mlx-lm's BatchGenerator drives a logits processor, with the default
model's real tokenizer: what each step allows, eager and lazy (triggered by a tool call's opening)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from semantic.actors.prompting.output_grammars import (
    json_schema_grammar,
    strict_calls_grammar,
    tool_call_grammar,
)
from semantic.engine.decoding.grammar_matcher import GrammarCompiler, GrammarError, GrammarMatcher

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
OPENER, CLOSER = "<tool_call>\n", "</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, list(tokenizer.eos_token_ids))


class Driver:
    """Steps a matcher as the generator does: the prompt first, then one sampled token per step."""

    def __init__(self, matcher: GrammarMatcher, vocab_size: int) -> None:
        self.matcher, self.tokens = matcher, [1, 2, 3]
        self.logits = mx.zeros((1, vocab_size))
        self.allowed = self._step()

    def _step(self) -> np.ndarray:
        masked = self.matcher(mx.array(self.tokens), self.logits)
        return np.isfinite(np.array(masked[0]))

    def feed(self, token_ids: list[int]) -> None:
        for token in token_ids:
            assert self.allowed[token], f"token {token} was masked"
            self.tokens.append(token)
            self.allowed = self._step()

    @property
    def is_free(self) -> bool:
        return bool(self.allowed.all())


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_a_json_schema_allows_only_valid_json(tokenizer: Any, compiler: GrammarCompiler) -> None:
    driver = Driver(compiler.matcher(json_schema_grammar(WEATHER, "schema")), len(tokenizer.vocab))
    assert not driver.allowed[encode(tokenizer, "Sure")[0]]
    driver.feed(encode(tokenizer, '{"city": "Paris", "days": '))
    assert not driver.allowed[encode(tokenizer, '"')[0]]  # days is an integer
    driver.feed(encode(tokenizer, "3}"))
    assert {int(t) for t in np.flatnonzero(driver.allowed)} <= set(tokenizer.eos_token_ids)


def test_a_forced_call_continues_from_its_opening(tokenizer: Any, compiler: GrammarCompiler) -> None:
    vocab = len(tokenizer.vocab)
    any_tool = Driver(compiler.matcher(tool_call_grammar(None, "arguments", TOOLS, CLOSER, "tools")), vocab)
    any_tool.feed(encode(tokenizer, 'get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'))
    assert {int(t) for t in np.flatnonzero(any_tool.allowed)} <= set(tokenizer.eos_token_ids)
    named_grammar = tool_call_grammar("get_weather", "arguments", TOOLS, CLOSER, "tools")
    named = Driver(compiler.matcher(named_grammar), vocab)
    assert not named.allowed[encode(tokenizer, '"')[0]]  # the arguments object, not another name
    named.feed(encode(tokenizer, '{"city": "Oslo", "days": 2}}\n</tool_call>'))
    assert {int(t) for t in np.flatnonzero(named.allowed)} <= set(tokenizer.eos_token_ids)


@settings(max_examples=25, deadline=None)
@given(
    before=st.text(alphabet="abc <>_/{}\"'\n", max_size=40).filter(lambda text: OPENER not in text),
    city=st.text(alphabet="abcxyz ", min_size=1, max_size=12),
    days=st.integers(0, 10_000),
)
def test_strict_calls_hold_only_inside_a_call(
    tokenizer: Any, compiler: GrammarCompiler, before: str, city: str, days: int
) -> None:
    grammar = strict_calls_grammar(TOOLS, "arguments", CLOSER, "tools")
    driver = Driver(compiler.matcher(grammar, trigger=OPENER), len(tokenizer.vocab))
    driver.feed(encode(tokenizer, before + "Let me check."))
    assert driver.is_free
    driver.feed(encode(tokenizer, OPENER + '{"name": "get_weather", "arguments": {"city": '))
    assert not driver.is_free
    assert not driver.allowed[encode(tokenizer, "3")[0]]  # city is a string
    call_rest = json.dumps(city) + f', "days": {days}}}}}\n</tool_call>'
    driver.feed(encode(tokenizer, call_rest))
    assert driver.is_free  # the call closed: text is free again, and so is a second call
    driver.feed(encode(tokenizer, " Done. " + OPENER + '{"name": "'))
    assert not driver.allowed[encode(tokenizer, "x")[0]]


def test_what_cannot_be_enforced_is_refused(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match="look-around"):
        compiler.matcher(json_schema_grammar({"type": "string", "pattern": "(?=a)"}, "schema"))
    with pytest.raises(GrammarError, match="not"):
        compiler.matcher(json_schema_grammar({"not": {"type": "string"}}, "schema"))
    with pytest.raises(GrammarError, match="more than this server allows"):
        json_schema_grammar({"enum": ["x" * 70_000]}, "schema")
