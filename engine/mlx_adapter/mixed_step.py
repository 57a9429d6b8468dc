"""Decode rows and a prompt chunk in one forward pass of the model.

While sequences decode and a prompt is prefilled beside them, mlx-lm's BatchGenerator runs two
forward passes a step: one token for each decoding sequence, then the prompt's chunk. On the CPU
each pass reads every weight, so a tick that decodes a few streams and prefills a small chunk paid
that read twice, where one pass reads them once.

Here the two are one pass, as vLLM and SGLang schedule them. Every token is its own row, so the
model's per-token layers (embedding, norms, projections, MLP, head) see one matrix of B + C rows;
only attention is per group. Each layer's cache is a `PackedLayerCache`: its offsets put every row
at its own position for RoPE, it writes the decode rows into the batch's cache and the chunk's rows
into the prompt's, and the model's `scaled_dot_product_attention` (hooked in `model_hooks.py`)
attends each group apart, with the masks both would have had on their own.

Models are packed only where, on a probe at load, the packed pass gives what the two passes give:
logits and caches (`mixed_forward_for`); a model whose attention reads its cache in other ways, or
whose layers keep other caches, keeps mlx-lm's two passes. Written against mlx-lm 0.32.2: the pass
hands the model's layers a cache object of ours, relying on how its models call their caches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from loguru import logger
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from semantic.engine.mlx_adapter.last_token_fold import LastPositionHead

# Two decoding sequences of different lengths (so the batch is left-padded) and a prompt with history.
PROBE_DECODE_HISTORIES = [[1, 2, 3], [4, 5, 6, 7, 8]]
PROBE_PROMPT_HISTORY = [9, 10, 11, 12]
PROBE_DECODE_TOKENS = [13, 14]
PROBE_CHUNK = [15, 16, 17]

Attend = Callable[[mx.array, mx.array, mx.array, Any, float, Any], mx.array]


@dataclass(frozen=True, slots=True)
class PackedKV:
    """What a packed layer's cache hands attention in place of keys (or values): both groups' own."""

    decode: mx.array
    prompt: mx.array


def rows_to_sequence(x: mx.array) -> mx.array:
    """(C, heads, 1, dim), a token a row, to (1, heads, C, dim), one sequence; its own inverse."""
    return x.transpose(2, 1, 0, 3)


class PackedLayerCache:
    """One layer's cache for a packed pass: rows [0, num_decode) are the decode batch's next tokens,
    the rest the prompt's chunk in order."""

    def __init__(
        self,
        decode: BatchKVCache,
        prompt: BatchKVCache,
        num_decode: int,
        offset: mx.array,
        decode_mask: Any,
        prompt_mask: Any,
    ) -> None:
        self.decode, self.prompt, self.num_decode = decode, prompt, num_decode
        self.offset = offset  # every row's position, for RoPE
        self.decode_mask, self.prompt_mask = decode_mask, prompt_mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[PackedKV, PackedKV]:
        n = self.num_decode
        decode_keys, decode_values = self.decode.update_and_fetch(keys[:n], values[:n])
        prompt_keys, prompt_values = self.prompt.update_and_fetch(
            rows_to_sequence(keys[n:]), rows_to_sequence(values[n:])
        )
        return PackedKV(decode_keys, prompt_keys), PackedKV(decode_values, prompt_values)

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # each group's mask is made before the pass and applied by `packed_attention`


def packed_attention(
    queries: mx.array, keys: PackedKV, values: PackedKV, cache: PackedLayerCache, scale: float, attend: Attend
) -> mx.array:
    """Each group attends over its own cache with its own mask; rows come back in the packed order."""
    n = cache.num_decode
    decoded = attend(queries[:n], keys.decode, values.decode, cache.decode, scale, cache.decode_mask)
    prompt_queries = rows_to_sequence(queries[n:])
    prompted = attend(prompt_queries, keys.prompt, values.prompt, cache.prompt, scale, cache.prompt_mask)
    return mx.concatenate([decoded, rows_to_sequence(prompted)], axis=0)


def chunk_mask(cache: BatchKVCache, num_chunk: int) -> mx.array | str:
    """The prompt chunk's mask: "causal" for a lone prompt without left padding (the same mask, which
    the CPU attention applies to the last columns only), else the cache's own array."""
    padding = cache.left_padding
    if padding.size == 1 and padding.item() == 0:
        return "causal"
    return cache.make_mask(num_chunk)


@dataclass(frozen=True, slots=True)
class MixedForward:
    """The model's body and head, run over decode rows and a prompt chunk at once."""

    split: LastPositionHead

    def __call__(
        self,
        decode_tokens: mx.array,
        decode_caches: list[BatchKVCache],
        chunk: list[int],
        prompt_caches: list[BatchKVCache],
        with_last: bool,
    ) -> tuple[mx.array, mx.array | None]:
        """Logits (B, 1, vocab) for the decode rows and, `with_last`, (1, 1, vocab) for the chunk's
        last token; both groups' caches take their new keys and values."""
        num_decode, num_chunk = decode_tokens.shape[0], len(chunk)
        first_decode, first_prompt = decode_caches[0], prompt_caches[0]
        decode_mask = first_decode.make_mask(1)  # before the pass writes the new positions
        prompt_mask = chunk_mask(first_prompt, num_chunk)
        offset = mx.concatenate([first_decode.offset, first_prompt.offset + mx.arange(num_chunk)])
        packed = [
            PackedLayerCache(d, p, num_decode, offset, decode_mask, prompt_mask)
            for d, p in zip(decode_caches, prompt_caches, strict=True)
        ]
        inputs = mx.concatenate([decode_tokens.astype(mx.int32), mx.array(chunk, dtype=mx.int32)])
        hidden = self.split.body(inputs[:, None], cache=packed)  # (B + C, 1, hidden)
        rows = mx.concatenate([hidden[:num_decode], hidden[-1:]]) if with_last else hidden[:num_decode]
        logits = self.split.head(rows)
        if not with_last:
            return logits, None
        return logits[:num_decode], logits[num_decode:].reshape(1, 1, -1)


def _batch_caches(model: Any, histories: list[list[int]]) -> list[BatchKVCache]:
    caches = [make_prompt_cache(model) for _ in histories]
    for history, cache in zip(histories, caches, strict=True):
        model(mx.array([history]), cache=cache)
    return [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]


def _agrees(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.allclose(a, b, rtol=1e-4, atol=1e-4))


def _probe(model: Any, mixed: MixedForward) -> bool:
    """Whether one packed pass gives the logits and caches of mlx-lm's two passes, on tiny inputs."""
    decode = _batch_caches(model, PROBE_DECODE_HISTORIES)
    prompt = _batch_caches(model, [PROBE_PROMPT_HISTORY])
    if not all(type(c) is BatchKVCache for c in [*decode, *prompt]):
        return False  # rotating (sliding-window) or state-space layers: not packed
    # The same histories for mlx-lm's passes, copied rather than run again: each forward pass reads
    # all the model's weights, and the probe runs at every load.
    reference_decode, reference_prompt = copy.deepcopy(decode), copy.deepcopy(prompt)
    decode_logits, last_logits = mixed(mx.array(PROBE_DECODE_TOKENS), decode, PROBE_CHUNK, prompt, True)
    decode_expected = model(mx.array(PROBE_DECODE_TOKENS)[:, None], cache=reference_decode)
    prompt_expected = model(mx.array([PROBE_CHUNK]), cache=reference_prompt)[:, -1:, :]
    assert last_logits is not None
    caches_agree = all(
        _agrees(a, b)
        for ours, theirs in zip([*decode, *prompt], [*reference_decode, *reference_prompt], strict=True)
        for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True)
    )
    return caches_agree and _agrees(decode_logits, decode_expected) and _agrees(last_logits, prompt_expected)


def mixed_forward_for(model: Any, split: LastPositionHead | None) -> MixedForward | None:
    """The packed pass for `model` (split into body and head), if a probe shows it computes what
    mlx-lm's two passes do; else None."""
    if split is None:
        return None
    mixed = MixedForward(split)
    try:
        agrees = _probe(model, mixed)
    except Exception as error:  # any failure: the model's layers do not work as packing assumes
        logger.info("decode and prefill run as two passes: the model cannot be packed ({})", error)
        return None
    if not agrees:
        logger.info("decode and prefill run as two passes: a packed pass changes the model's results")
    return mixed if agrees else None
