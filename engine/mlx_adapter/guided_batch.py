"""mlx-lm's decode batch, whose rows' grammars mask a step's logits in one op.

mlx-lm's `GenerationBatch._step` applies logits processors row by row once any row has one: it
slices each row's logits, appends the row's token to a token buffer of its own, calls the row's
processors and concatenates the rows back. A grammar (`GrammarMatcher`) reads only the token just
sampled, so where every row's processors are a grammar or none, this batch's step hands mlx-lm a
model whose logits come out masked already: the forward pass, then each grammar's mask after its
row's input token (`GrammarMatcher.next_mask`), applied to the whole batch at once, and no
processors for mlx-lm to run. The masks and the tokens sampled are those of mlx-lm's per-row path;
a batch with any other processor (a penalty, a logit bias) takes mlx-lm's step as it is.

A guided row's token buffer is then not kept up to date; only its last token is ever read (by the
grammar, on a speculative verify or a per-row step). Written against mlx-lm 0.32.2's
`GenerationBatch._step`, which calls `self.model(inputs[:, None], cache=...)`, keeps the last
position's logits, and runs no processors when `self.logits_processors` holds none.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from semantic.engine.decoding.grammar_matcher import GrammarMatcher, masked_rows
from semantic.engine.mlx_adapter.seam_check import require


class GuidedGenerationBatch(GenerationBatch):
    """mlx-lm's decode batch; a step whose rows' processors are each one grammar or none is masked by
    `GrammarMaskedModel`, any other is mlx-lm's own."""

    def _step(self) -> tuple[list[int], list[mx.array]]:
        grammars = grammars_alone(self.logits_processors or [])
        if grammars is None:
            return super()._step()
        model, processors = self.model, self.logits_processors
        self.model, self.logits_processors = GrammarMaskedModel(model, grammars), []  # type: ignore[assignment]
        try:
            return super()._step()
        finally:
            self.model, self.logits_processors = model, processors


def grammars_alone(processors: Sequence[Sequence[Any] | None]) -> list[GrammarMatcher | None] | None:
    """Each row's grammar, where every row's processors are one grammar or none and some row has
    one; else None (mlx-lm's per-row path)."""
    grammars: list[GrammarMatcher | None] = []
    for row in processors:
        if not row:
            grammars.append(None)
        elif len(row) == 1 and isinstance(row[0], GrammarMatcher):
            grammars.append(row[0])
        else:
            return None
    return grammars if any(g is not None for g in grammars) else None


class GrammarMaskedModel:
    """Stands in for the model in one step of the decode batch: its logits masked by the rows' grammars."""

    def __init__(self, model: Any, grammars: list[GrammarMatcher | None]) -> None:
        self._model = model
        self._grammars = grammars

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits = self._model(inputs, cache=cache)[:, -1, :]
        tokens = {row: inputs[row, -1] for row, grammar in enumerate(self._grammars) if grammar is not None}
        # Queued ahead of the step's forward pass (which a grammar reading its token now queues, else
        # mlx-lm once this returns): a grammar that leaves its row's token lagging reads it at the
        # next step without waiting for that pass.
        mx.async_eval(list(tokens.values()))
        masks = [
            None if grammar is None else grammar.next_mask(tokens[row], logits)
            for row, grammar in enumerate(self._grammars)
        ]
        return masked_rows(logits, masks)[:, None, :]


def guided(generator: BatchGenerator) -> BatchGenerator:
    """`generator` with a decode batch whose grammars mask in one op (before any sequence joins)."""
    assert len(generator._generation_batch) == 0
    generator._generation_batch = GuidedGenerationBatch.empty(generator.model, generator.sampler)
    return generator


def check_guided_batch() -> None:
    """The parts of mlx-lm's `GenerationBatch._step` the guided step relies on."""
    step = inspect.getsource(GenerationBatch._step)
    for assumption, text in (
        ("calls the model on the input tokens", "self.model(inputs[:, None], cache=self.prompt_cache)"),
        ("keeps the last position's logits", "logits = logits[:, -1, :]"),
        ("runs processors only when some row has one", "if any(self.logits_processors):"),
    ):
        require(f"GenerationBatch._step {assumption} (the guided batch's step)", lambda t: t in step, text)
