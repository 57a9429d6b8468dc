"""A prompt's last token prefilled with the rest of its last chunk, not in a forward pass of its own.

mlx-lm's BatchGenerator holds each prompt's last token back from the prefill and runs it as a
one-token forward pass when the prompt joins the decode batch. That pass reads every weight for a
single token: on the CPU a sizeable part of a returning agent's short turn, and a tick of its own.

Here, when one prompt is being prefilled and what is left of it fits the tick's chunk, the chunk
carries the last token too and the model's head runs on that position alone. The prompt then
joins the decode batch through mlx-lm's own first step (`GenerationBatch`, handed those logits in
place of its forward pass), so logits processors, samplers and the token bookkeeping are mlx-lm's.

`BatchGenerator._next` is forked for this, pinned to the source it was forked from: with another
mlx-lm whose `_next` or `GenerationBatch._step` differ, the generator is mlx-lm's own, unfolded.
The head is split from the model only where the split computes what the whole model computes
(checked on a probe at load); pipelined or sharded models are not folded.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from loguru import logger
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import make_prompt_cache

from semantic.engine.mlx_adapter.batch_joins import JoiningBatchKVCache

# SHA-256 of the sources this module's `_next` and the logits hand-over were written against
# (mlx-lm 0.32.2): `BatchGenerator._next` and `GenerationBatch._step`.
FORKED_SOURCES = {
    "BatchGenerator._next": "eb3a4e361dc2c19eafd28e901155828fd4602d63e26c431ca9ffbf079302c665",
    "GenerationBatch._step": "d7513c5031029194ca3820ae81d8966b792e66a90c39c1d7ad61d30bc9e8c5ad",
}
PROBE_TOKENS = [[1, 2, 3, 4, 5]]


def _source_digest(function: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def forked_sources_match() -> bool:
    """Whether the installed mlx-lm has the `_next` and `_step` this module was forked from."""
    installed = {
        "BatchGenerator._next": _source_digest(BatchGenerator._next),
        "GenerationBatch._step": _source_digest(GenerationBatch._step),
    }
    return installed == FORKED_SOURCES


@dataclass(frozen=True, slots=True)
class LastPositionHead:
    """The model as its body (hidden states, caches updated) and its head, run on the last position."""

    body: Callable[..., mx.array]
    head: Callable[[mx.array], mx.array]

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        hidden = self.body(tokens, cache=cache)
        return self.head(hidden[:, -1:, :])


def last_position_head(model: Any) -> LastPositionHead | None:
    """The model split into body and head, if the split gives the model's own last-position logits
    on a probe (mlx-lm's models mostly are `model.model` then `lm_head` or the tied embedding);
    None where it does not (a soft cap, a logit scale, another layout)."""
    body = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(body, "embed_tokens", None), "as_linear", None)
    if not callable(body) or not callable(head):
        return None
    split = LastPositionHead(body, head)
    try:
        probe = mx.array(PROBE_TOKENS)
        whole = model(probe, cache=make_prompt_cache(model))[:, -1:, :]
        parts = split(probe, make_prompt_cache(model))
        agrees = whole.shape == parts.shape and bool(mx.allclose(whole, parts, rtol=1e-4, atol=1e-4))
    except Exception as error:  # any failure: the model is not laid out as assumed
        logger.info("the model's head cannot be run on its own ({}); prompts end with mlx-lm's step", error)
        return None
    return split if agrees else None


class GivenLogits:
    """Stands in for the model in `GenerationBatch`'s first step: the logits are already computed."""

    def __init__(self, logits: mx.array) -> None:
        self._logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self._logits


class FoldingBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator, but a lone prompt's last chunk carries its last token."""

    def __init__(
        self, model: Any, *, head: LastPositionHead, joining_cache: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(model, **kwargs)
        self._head = head
        self._joining_cache = joining_cache
        # Prompts whose cache is read where the prefill stops before the last token (a recurrent
        # model's state where the prompt ends): the last token runs as a step of its own.
        self.unfolded_uids: set[int] = set()

    def _foldable(self) -> bool:
        if len(self._currently_processing) != 1:  # one entry per sequence of the prompt batch
            return False
        if self._prompt_batch.uids[0] in self.unfolded_uids:
            return False
        segments = self._currently_processing[0][0]
        return len(segments) == 2 and len(segments[1]) == 1 and 0 < len(segments[0]) < self.prefill_step_size

    def _fold(self, logits: mx.array | None = None) -> PromptProcessingBatch.Response:
        """Prefill the lone prompt's rest and its last token in one pass (or take the logits of a pass
        that already did); it joins the decode batch."""
        segments, _, total = self._currently_processing[0]
        body, last = segments
        batch = self._prompt_batch
        tic = time.perf_counter()
        batch.tokens[0] += body  # the tokens in the cache; the first step adds `last`
        if logits is None:
            logits = self._head(mx.array([body + last]), batch.prompt_cache)
        generation = GenerationBatch(
            GivenLogits(logits),  # type: ignore[arg-type]
            batch.uids,
            mx.array(last),
            batch.prompt_cache,
            batch.tokens,
            batch.samplers,
            batch.fallback_sampler,
            batch.logits_processors,
            batch.stop_sequences,
            batch.max_tokens,
        )
        generation.model = self.model
        self._counters.prompt_tokens += len(body) + 1
        self._counters.prompt_time += time.perf_counter() - tic
        self._prompt_batch = PromptProcessingBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._currently_processing = []
        self._join(generation)
        return PromptProcessingBatch.Response(generation.uids[0], (total, total), True, True)

    def _join(self, generation: GenerationBatch) -> None:
        """Prompts that ended their prefill join the decode batch, whose caches copy each history
        once when sequences join or leave (`batch_joins.py`)."""
        if self._joining_cache:
            generation.prompt_cache = [JoiningBatchKVCache.adopt(c) for c in generation.prompt_cache]
        self._generation_batch.extend(generation)

    def _count_decode_step(self, tic: float, num_tokens: int) -> None:
        """mlx-lm's counters for a decode step that began at `tic`."""
        self._counters.decode_time += time.perf_counter() - tic
        self._counters.generation_tokens += num_tokens
        self._counters.generation_steps += 1
        if self._counters.generation_steps % 512 == 0:
            mx.clear_cache()

    def _admit_prompts(self) -> None:
        """Move waiting sequences into the prompt batch, as far as both batches have room."""
        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(self._generation_batch),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))

    def _take_chunk(self, index: int, num_tokens: int) -> tuple[list[int], PromptProcessingBatch.Response]:
        """The next `num_tokens` of prompt `index`'s current segment, and mlx-lm's progress for it."""
        seq = self._currently_processing[index]
        response = PromptProcessingBatch.Response(self._prompt_batch.uids[index], 0, False, False)  # type: ignore[arg-type]
        segments = seq[0]
        chunk = segments[0][:num_tokens]
        segments[0] = segments[0][num_tokens:]
        if len(segments[0]) == 0:
            segments.pop(0)
            response.end_of_segment = True
        seq[1] += len(chunk)
        response.progress = (seq[1], seq[2])
        return chunk, response

    def _next(self) -> tuple[list[Any], list[Any]]:
        # Forked from mlx-lm 0.32.2 `BatchGenerator._next`: the block marked FOLD and `_join` are ours, and
        # mlx-lm's own blocks are the three methods above, which the mixing generator shares.
        generation_responses: list[Any] = []
        prompt_responses: list[Any] = []

        # Generate tokens first
        if len(self._generation_batch) > 0:
            tic = time.perf_counter()
            generation_responses = self._generation_batch.next()
            self._count_decode_step(tic, len(generation_responses))

        # Exit early because we already have our hands full with decoding
        if len(self._generation_batch) >= self.completion_batch_size:
            return prompt_responses, generation_responses

        # Check if we have sequences and add them to the prompt batch
        self._admit_prompts()

        # Split the prompt sequences to the ones moving to generation and the rest
        keep = []
        split = []
        for i, seq in enumerate(self._currently_processing):
            segments = seq[0]
            if len(segments) == 1 and len(segments[0]) == 1:
                split.append(i)
            else:
                keep.append(i)

        # Actually split off part of the prompt batch and start generation
        if split:
            last_inputs = [self._currently_processing[i][0][0] for i in split]
            progress = [(self._currently_processing[i][2],) * 2 for i in split]
            self._currently_processing = [self._currently_processing[i] for i in keep]
            gen_batch = self._prompt_batch.split(split).generate(last_inputs)
            for i, p in enumerate(progress):
                prompt_responses.append(
                    PromptProcessingBatch.Response(
                        gen_batch.uids[i],
                        p,
                        True,
                        True,
                    )
                )
            self._join(gen_batch)

        # FOLD: a lone prompt whose rest fits this chunk ends here, its last token included.
        if self._foldable():
            prompt_responses.append(self._fold())
            return prompt_responses, generation_responses

        # Extract the next prompts input
        prompts = []
        for i, seq in enumerate(self._currently_processing):
            chunk, response = self._take_chunk(i, min(len(seq[0][0]), self.prefill_step_size))
            prompts.append(chunk)
            prompt_responses.append(response)

        # Process the prompts
        self._counters.prompt_tokens += sum(len(p) for p in prompts)
        tic = time.perf_counter()
        self._prompt_batch.prompt(prompts)
        self._counters.prompt_time += time.perf_counter() - tic

        return prompt_responses, generation_responses


def fold_head(model: Any, foldable: bool) -> LastPositionHead | None:
    """The head to fold prompts' last tokens with, where that is safe: the installed mlx-lm is the
    one `_next` was forked from and the model splits into body and head; else None."""
    if not foldable:
        return None
    if not forked_sources_match():
        logger.warning(
            "mlx-lm's BatchGenerator is not the one semantic forked; prompts end with its own step"
        )
        return None
    return last_position_head(model)


def make_batch_generator(
    model: Any, head: LastPositionHead | None, joining_cache: bool = True, **kwargs: Any
) -> BatchGenerator:
    """A generator that folds each lone prompt's last token into its last chunk given a head (its
    decode batch's caches joining at one copy with `joining_cache`), else mlx-lm's own."""
    if head is None:
        return BatchGenerator(model, **kwargs)
    return FoldingBatchGenerator(model, head=head, joining_cache=joining_cache, **kwargs)
