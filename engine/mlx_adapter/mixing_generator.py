"""A BatchGenerator whose step decodes and prefills in one forward pass (`mixed_step.py`).

A step of mlx-lm's generator decodes one token for every generating sequence and then prefills a
chunk of the prompt batch. Where one prompt is being prefilled beside sequences that decode, this
generator runs both as one packed pass and hands each side its logits: the decode batch through
mlx-lm's own `GenerationBatch` step (sampling, logits processors and grammars are mlx-lm's), the
prompt's chunk by the same bookkeeping as mlx-lm's prefill, or, when the chunk ends the prompt, by
the fold's hand-over to the decode batch. Any other step (nothing decoding, several prompts, a
prompt down to mlx-lm's lone last token) is the folding generator's. Subclasses mlx-lm 0.32.2's
BatchGenerator through the folding one, and reads the same internals its fork does.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from semantic.engine.mlx_adapter.guided_batch import guided
from semantic.engine.mlx_adapter.last_token_fold import (
    FoldingBatchGenerator,
    GivenLogits,
    LastPositionHead,
    fold_head,
    make_batch_generator,
)
from semantic.engine.mlx_adapter.mixed_step import MixedForward, mixed_forward_for
from semantic.engine.mlx_adapter.speculative_batch import speculative
from semantic.engine.speculation.drafting import Speculation


class GeneratorFactory:
    """Makes a model's batch generators (a new one after a failed step): mixing where the model
    packs, else folding where its head splits, else mlx-lm's own, as the backend profile chose. The
    head and the packed pass are set up once, on the engine's stream."""

    def __init__(
        self,
        model: Any,
        stream: mx.Stream,
        *,
        fold: bool,
        mixed_step: bool,
        joining_cache: bool,
        speculation: Speculation | None = None,
        **options: Any,
    ) -> None:
        self._model = model
        self._speculation = speculation
        self._options = {**options, "stream": stream}
        self._joining_cache = joining_cache
        with mx.stream(stream):
            self.head: LastPositionHead | None = fold_head(model, fold)
            self.mixed: MixedForward | None = mixed_forward_for(model, self.head) if mixed_step else None

    def __call__(self) -> BatchGenerator:
        joining = self._joining_cache
        generator: BatchGenerator
        if self.mixed is not None and self.head is not None:  # packing folds with the same head
            generator = MixingBatchGenerator(
                self._model, mixed=self.mixed, joining_cache=joining, **self._options
            )
        else:
            generator = make_batch_generator(self._model, self.head, joining_cache=joining, **self._options)
        if self._speculation is None:
            return guided(generator)
        self._speculation.clear()  # a new generator: the old one's sequences are gone
        return speculative(generator, self._speculation)


class MixingBatchGenerator(FoldingBatchGenerator):
    def __init__(self, model: Any, *, mixed: MixedForward, **kwargs: Any) -> None:
        super().__init__(model, head=mixed.split, **kwargs)  # the packed pass's head folds lone prompts
        self._mixed = mixed
        self.num_mixed_steps = 0  # steps that decoded and prefilled in one pass

    def _next(self) -> tuple[list[Any], list[Any]]:
        mixed = self._mixed_next()
        return mixed if mixed is not None else super()._next()

    def _mixed_next(self) -> tuple[list[Any], list[Any]] | None:
        """Decode and prefill the lone prompt's next chunk in one pass; None where this step is not one
        such (the folding generator's step then runs)."""
        generation = self._generation_batch
        if not 0 < len(generation) < self.completion_batch_size:
            return None
        self._admit_prompts()  # before decoding, unlike mlx-lm: nothing here depends on its outcome
        if len(self._currently_processing) != 1:
            return None
        segments = self._currently_processing[0][0]
        if len(segments) == 1 and len(segments[0]) == 1:
            return None  # mlx-lm's hand-over of a prompt's lone last token
        folds = self._foldable()
        chunk = segments[0] + segments[1] if folds else segments[0][: self.prefill_step_size]
        prompt_caches = self._prompt_batch.prompt_cache

        tic = time.perf_counter()
        decode_logits, last_logits = self._mixed(
            generation._next_tokens, generation.prompt_cache, chunk, prompt_caches, folds
        )
        generation.model = GivenLogits(decode_logits)
        try:
            generation_responses = generation.next()
        finally:
            generation.model = self.model
        mx.async_eval([c.state for c in prompt_caches])  # computed with the decode step's logits
        self._count_decode_step(tic, len(generation_responses))
        self.num_mixed_steps += 1
        if folds:
            return [self._fold(last_logits)], generation_responses
        return [self._prefilled(chunk)], generation_responses

    def _prefilled(self, chunk: list[int]) -> PromptProcessingBatch.Response:
        """mlx-lm's bookkeeping for a chunk of the lone prompt that a packed pass prefilled."""
        _, response = self._take_chunk(0, len(chunk))
        self._prompt_batch.tokens[0] += chunk
        self._counters.prompt_tokens += len(chunk)
        return response
