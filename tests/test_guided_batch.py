"""The guided decode batch masks every row in one op and decodes exactly what mlx-lm's per-row path
decodes: the same tokens and log-probabilities, greedy and sampled, with rows of every kind of
grammar (lazy in free text, lazy opening calls, whole-reply), rows without one and rows with a
penalty (whose batch takes the per-row path) joining and leaving the batch at different steps.
Run with the real tiny Llama in mlx-lm's BatchGenerator."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semantic.engine.decoding.grammar_matcher import GrammarCompiler
from semantic.engine.decoding.sampling import SamplingParams, make_processors
from semantic.engine.mlx_adapter.api import BatchGenerator, load
from semantic.engine.mlx_adapter.guided_batch import GrammarMaskedModel, guided

# Each row's grammar and trigger (None: no grammar).
GRAMMARS: dict[str, tuple[str, str | None] | None] = {
    "free": None,
    # Lazy, with a trigger the random model never writes: every step masked a step late.
    "lagging": ('start: "<tool_call>" /[a-z]+/ "</tool_call>"\n', "<tool_call>"),
    # Lazy, with a trigger too many tokens complete for a lookahead: calls open and close often,
    # each step read at once.
    "opens": ('start: "x" /[a-z]{1,3}/ "."\n', "e"),
    # The whole reply: it ends when the grammar does.
    "whole": ('start: /[a-z]{2,12}/ " " /[0-9]{1,4}/\n', None),
}
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21]]


@functools.cache
def setup(model_dir: Path) -> tuple[Any, Any, GrammarCompiler]:
    model, tokenizer = load(str(model_dir))[:2]
    return model, tokenizer, GrammarCompiler(tokenizer, [tokenizer.eos_token_id])


def decode(
    model_dir: Path, rows: list[tuple[str, int, int, bool]], temperature: float, seed: int, batched: bool
) -> dict[int, tuple[list[int], list[np.ndarray]]]:
    """Each row's tokens and log-probabilities, by row: rows as (grammar, join step, max tokens,
    penalty)."""
    model, tokenizer, compiler = setup(model_dir)
    generator = BatchGenerator(
        model,
        stop_tokens=[[tokenizer.eos_token_id]],
        sampler=(lambda logprobs: mx.random.categorical(logprobs / temperature, axis=-1))
        if temperature
        else (lambda logprobs: mx.argmax(logprobs, axis=-1)),
        completion_batch_size=len(rows),
    )
    if batched:
        generator = guided(generator)
    mx.random.seed(seed)
    replies: dict[int, tuple[list[int], list[np.ndarray]]] = {}
    finished: set[int] = set()
    row_of: dict[int, int] = {}  # by uid
    step = 0
    while len(finished) < len(rows):
        for index, (kind, join, max_tokens, penalty) in enumerate(rows):
            if join == step:
                grammar = GRAMMARS[kind]
                processors = make_processors(SamplingParams(repetition_penalty=1.3), 0) if penalty else []
                if grammar is not None:
                    processors.append(compiler.matcher(*grammar))
                (uid,) = generator.insert(
                    [PROMPTS[index % len(PROMPTS)]], [max_tokens], logits_processors=[processors]
                )
                row_of[uid] = index
                replies[index] = ([], [])
        for response in generator.next()[1]:
            tokens, logprobs = replies[row_of[response.uid]]
            tokens.append(response.token)
            logprobs.append(np.array(response.logprobs))
            if response.finish_reason is not None:
                finished.add(response.uid)
        step += 1
    generator.close()
    return replies


# A row with a penalty sends its batch to the per-row path while it decodes: guided rows switch paths.
penalties = st.sampled_from([False, False, False, True])
row_kinds = st.tuples(st.sampled_from(sorted(GRAMMARS)), st.integers(0, 6), st.integers(1, 24), penalties)


@settings(max_examples=8, deadline=None)
@given(
    rows=st.lists(row_kinds, min_size=1, max_size=6),
    temperature=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_the_guided_batch_decodes_what_the_per_row_path_decodes(
    tiny_llama_dir: Path, rows: list[tuple[str, int, int, bool]], temperature: float, seed: int
) -> None:
    expected = decode(tiny_llama_dir, rows, temperature, seed, batched=False)
    got = decode(tiny_llama_dir, rows, temperature, seed, batched=True)
    for row, (tokens, logprobs) in expected.items():
        assert got[row][0] == tokens, f"row {row} ({rows[row][0]}) decoded other tokens"
        assert all(np.array_equal(a, b) for a, b in zip(got[row][1], logprobs, strict=True))


def test_the_guided_step_masks_in_one_op_and_other_processors_keep_the_per_row_path(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows above take the guided step; a row with a penalty sends the whole batch to mlx-lm's
    per-row path, with the same replies as without the guided batch. Calls do open."""
    steps: list[int] = []
    call = GrammarMaskedModel.__call__

    def counted(self: GrammarMaskedModel, inputs: mx.array, cache: Any = None) -> mx.array:
        steps.append(inputs.shape[0])
        return call(self, inputs, cache)

    monkeypatch.setattr(GrammarMaskedModel, "__call__", counted)
    rows = [
        ("lagging", 0, 20, False),
        ("opens", 0, 20, False),
        ("whole", 1, 20, False),
        ("free", 2, 20, False),
    ]
    replies = decode(tiny_llama_dir, rows, 0.0, 0, batched=True)
    assert steps and max(steps) == len(rows), "the guided step never masked the whole batch"
    tokenizer = setup(tiny_llama_dir)[1]
    opened = tokenizer.decode(replies[1][0])
    assert "e" in opened and "x" in opened.split("e", 1)[1], f"no call opened: {opened!r}"

    steps.clear()
    penalised = [*rows, ("lagging", 0, 20, True)]
    got = decode(tiny_llama_dir, penalised, 0.0, 0, batched=True)
    assert not steps, "a penalty row's batch took the guided step"
    expected = decode(tiny_llama_dir, penalised, 0.0, 0, batched=False)
    assert got.keys() == expected.keys()
    for row, (tokens, _) in expected.items():
        assert got[row][0] == tokens
