"""Attention for MLX's CPU backend: the softmax that dominates long prompts, made cheaper.

On the CPU, `mx.fast.scaled_dot_product_attention` falls back to matmul, softmax, matmul, and the
softmax's scalar `exp` is the largest cost of a long prefill (docs/benchmarks.md, "Linux CPU
speed", has the figures). Here:

- the query heads that share a KV head are folded into the rows of one matmul per KV head;
- the exponential is `cpu_exp`'s compiled polynomial, not MLX's element-at-a-time `exp`;
- a causal mask only touches its last L columns: the columns before them (in whole blocks of 64)
  are scored, exponentiated and weighted as a part of their own, with no mask, and only the rest
  is masked (a `where` over every score cost about as much as the exponential);
- MLX's CPU reductions over the last axis run an element at a time, so row maxima are taken over
  blocks of 64 columns first and the normaliser is a matrix-vector product with ones.

MLX runs each stream's ops one at a time on a thread of its own, and an elementwise op on one core.
Given a second CPU stream, a call with many scores computes the second half of its query positions'
row maxima and weights there (the matmuls stay on the calling stream: BLAS threads take both cores
already), which pays for long histories and long chunks alike.

Metal and CUDA keep their fused kernels: `mlx_adapter.model_hooks.install_kernel_hooks` routes
mlx-lm's attention here only when the model runs on the CPU, only on the engine thread, and only for
attention it can do exactly as mlx-lm would (no attention sinks, no quantized KV cache, inputs
`supports` takes).

Masks take every shape MLX's own attention takes: anything that broadcasts to [B, heads, L, S], one
for all heads or one per query head. MLA models (DeepSeek V3, GLM-4 MoE Lite, Kimi) pass their RoPE
scores as a per-head additive mask, decode with one latent KV head shared by every query head, and
prefill with values of another head size than their keys.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from semantic.engine.cpu.cpu_exp import ExpKernels, kernels

MAX_BLOCK = 64  # row maxima are taken over blocks of this many columns first (`_row_max`)
# From this many scores in one call (batch x heads x queries x keys) the elementwise work is split
# over two streams (`worth_splitting`): below about a million scores the second stream's overhead
# eats what it saves.
SPLIT_SCORES = 1 << 20


def _row_max(scores: mx.array) -> mx.array:
    """Each row's maximum (keepdims). A row reduced in one pass runs an element at a time here;
    as blocks of `MAX_BLOCK` columns (the block maxima elementwise, then one max per row) the first
    pass vectorises."""
    *lead, width = scores.shape
    if width % MAX_BLOCK or width == MAX_BLOCK:
        return scores.max(axis=-1, keepdims=True)
    return scores.reshape(*lead, width // MAX_BLOCK, MAX_BLOCK).max(axis=-2).max(axis=-1, keepdims=True)


@dataclass(frozen=True, slots=True)
class _Columns:
    """Some of the key positions, attended with one kind of mask: none (`mask` None), kept where the
    boolean mask is true, or an additive bias; a mask broadcasts to the scores' shape."""

    keys: mx.array
    values: mx.array
    mask: mx.array | None = None

    def row_max(self, scores: mx.array) -> mx.array:
        if self.mask is None:
            return _row_max(scores)
        if self.mask.dtype == mx.bool_:
            return _row_max(mx.where(self.mask, scores, -mx.inf))
        return _row_max(scores + self.mask)

    def rows(self, start: int, end: int, length: int) -> _Columns:
        """These columns for query positions `start` to `end` of `length` (the mask's rows)."""
        if self.mask is None or self.mask.ndim < 2 or self.mask.shape[-2] != length:
            return self
        return _Columns(self.keys, self.values, self.mask[..., start:end, :])

    def weights(self, exp: ExpKernels, scores: mx.array, row_max: mx.array) -> mx.array:
        """exp(scores - row_max), zero where masked out."""
        if self.mask is None:
            return exp.plain(scores, row_max)
        if self.mask.dtype == mx.bool_:
            return exp.kept(scores, row_max, self.mask)
        return exp.biased(scores, row_max, self.mask.astype(mx.float32))


@dataclass(frozen=True, slots=True)
class PaddedCausal:
    """A boolean mask that mlx-lm's `create_causal_mask(L, offset, left_padding=...)` made (`array`,
    [B, 1, L, S]; a batch cache's mask): row i of sequence b sees the columns j with
    left_padding[b] <= j <= offset + i. So the columns from the largest padding up to the last L
    need no mask, and only the others are masked (with the array's own columns)."""

    array: mx.array
    max_left_padding: int


Mask = mx.array | str | PaddedCausal | None


def supports(queries: mx.array, keys: mx.array, values: mx.array, mask: object) -> bool:
    """Whether `attention` computes what `mx.fast.scaled_dot_product_attention` would for these
    inputs; the caller gives anything else to MLX's own (which also raises what it refuses)."""
    if not queries.ndim == keys.ndim == values.ndim == 4:
        return False
    batch, heads, length, dims = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    if keys.shape[0] != batch or values.shape[:3] != keys.shape[:3] or keys.shape[3] != dims:
        return False
    if kv_heads == 0 or heads % kv_heads:
        return False
    if mask is None or isinstance(mask, PaddedCausal):
        return True
    if isinstance(mask, str):
        return mask == "causal" and length <= total
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return False
    if mask.dtype != mx.bool_ and not mx.issubdtype(mask.dtype, mx.floating):
        return False
    full = (batch, heads, length, total)[4 - mask.ndim :]
    return all(size in (1, wanted) for size, wanted in zip(mask.shape, full, strict=True))


def _grouped_mask(mask: mx.array, repeats: int) -> mx.array:
    """A mask that broadcasts to [B, heads, L, S] (MLX's shape) as one that broadcasts to the
    scores' [B, KV heads, repeats, L, S]: one for all heads gets an axis, a per-head one is split
    by the KV head its query head shares."""
    if mask.ndim < 3:
        return mask
    *lead, heads, length, total = mask.shape
    if heads == 1:
        return mx.expand_dims(mask, -3)
    return mask.reshape(*lead, heads // repeats, repeats, length, total)


def _causal_columns(
    keys: mx.array, values: mx.array, start: int, end: int, masked: Callable[[int, int], mx.array]
) -> list[_Columns]:
    """Columns `start` to `end` open, the ones before and after them masked by `masked(first, last)`
    (the mask of those columns); all of them masked where nothing is left open."""
    total = keys.shape[2]
    if start >= end:
        return [_Columns(keys, values, masked(0, total))]
    parts = [
        _Columns(keys[..., start:end, :], values[..., start:end, :]),
        _Columns(keys[..., end:, :], values[..., end:, :], masked(end, total)),
    ]
    if start:
        parts.insert(0, _Columns(keys[..., :start, :], values[..., :start, :], masked(0, start)))
    return parts


def _split_columns(keys: mx.array, values: mx.array, length: int, repeats: int, mask: Mask) -> list[_Columns]:
    """The key positions by how they are masked. A causal mask hides only some of the last `length`
    columns: the columns before them (rounded down to whole blocks for `_row_max`) need no mask,
    nor, with left padding, those from the largest padding on."""
    if mask is None:
        return [_Columns(keys, values)]
    if isinstance(mask, mx.array):
        return [_Columns(keys, values, _grouped_mask(mask, repeats))]
    total = keys.shape[2]
    end = (total - length) // MAX_BLOCK * MAX_BLOCK
    if isinstance(mask, PaddedCausal):
        array = mask.array
        start = -(-mask.max_left_padding // MAX_BLOCK) * MAX_BLOCK
        return _causal_columns(
            keys, values, start, end, lambda first, last: _grouped_mask(array[..., first:last], repeats)
        )

    def causal(first: int, last: int) -> mx.array:
        return mx.arange(total - length, total)[:, None] >= mx.arange(first, last)[None]

    return _causal_columns(keys, values, 0, end, causal)


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Mask,
    second_stream: mx.Stream | None = None,
) -> mx.array:
    """Scaled dot-product attention with mlx's semantics ("causal" is bottom-right aligned), for the
    inputs `supports` takes; the values' head size may differ from the keys' (MLA's prefill). Given
    a `second_stream` (the caller's choice: `worth_splitting` says when it pays), the second half of
    the query positions has its row maxima and weights computed there, beside the first half's on
    the calling stream (`_attend_rows`)."""
    batch, heads, length, dims = queries.shape
    kv_heads = keys.shape[1]
    repeats = heads // kv_heads
    folded = (queries * scale).reshape(batch, kv_heads, repeats * length, dims)
    columns = _split_columns(keys, values, length, repeats, mask)
    # Each part's scores as [batch, kv heads, repeats, length, width], so a mask broadcasts over repeats.
    scores = [
        (folded @ part.keys.swapaxes(-1, -2)).astype(mx.float32).reshape(batch, kv_heads, repeats, length, -1)
        for part in columns
    ]
    if second_stream is None or length < 2:
        out = _attend_rows(columns, scores, 0, length, values.dtype, None)
    else:
        half = length // 2
        first = _attend_rows(columns, scores, 0, half, values.dtype, None)
        out = mx.concatenate(
            [first, _attend_rows(columns, scores, half, length, values.dtype, second_stream)], -2
        )
    return out.reshape(batch, heads, length, values.shape[-1])


# Below this many scores a call goes to MLX's own attention. Ours traces its compiled exponential
# again for every new key length (every decode step), which only a larger score array repays: a
# small model's decode steps are faster with MLX's own (bench/results/step_overhead.json, issue 66).
MIN_SCORES = 1 << 14


def worth_using(queries: mx.array, keys: mx.array) -> bool:
    """Whether a call has scores enough (`MIN_SCORES`) for our kernel to beat MLX's own."""
    batch, heads, length, _ = queries.shape
    return batch * heads * length * keys.shape[2] >= MIN_SCORES


def worth_splitting(queries: mx.array, keys: mx.array) -> bool:
    """Whether a call has scores enough (`SPLIT_SCORES`) for its elementwise work to be split."""
    batch, heads, length, _ = queries.shape
    return length >= 2 and batch * heads * length * keys.shape[2] >= SPLIT_SCORES


def _attend_rows(
    columns: list[_Columns],
    scores: list[mx.array],
    start: int,
    end: int,
    dtype: mx.Dtype,
    stream: mx.Stream | None,
) -> mx.array:
    """Query positions `start` to `end`, as [batch, kv heads, repeats, end - start, dims]: row maxima
    and weights (elementwise work, which MLX runs a stream's ops one at a time on its thread) on
    `stream` (None: the calling one); the products with the values (BLAS, threaded already) on the
    calling stream."""
    length = scores[0].shape[-2]
    if (start, end) != (0, length):
        columns = [part.rows(start, end, length) for part in columns]
        scores = [part_scores[..., start:end, :] for part_scores in scores]
    batch, kv_heads, repeats = scores[0].shape[:3]
    exp = kernels()
    with mx.stream(stream) if stream is not None else contextlib.nullcontext():
        row_max = functools.reduce(
            mx.maximum, [part.row_max(s) for part, s in zip(columns, scores, strict=True)]
        )
        weights = [
            part.weights(exp, part_scores, row_max)
            .reshape(batch, kv_heads, -1, part_scores.shape[-1])
            .astype(dtype)
            for part, part_scores in zip(columns, scores, strict=True)
        ]
    outs, sums = [], []
    for part, part_weights in zip(columns, weights, strict=True):
        outs.append(part_weights @ part.values)
        # The normaliser as a matrix-vector product: a vectorised BLAS call where a sum over the
        # last axis runs an element at a time.
        sums.append(part_weights @ mx.ones((part_weights.shape[-1], 1), dtype=dtype))
    out, normaliser = functools.reduce(mx.add, outs), functools.reduce(mx.add, sums)
    # A row's largest visible weight is 1, so its normaliser is at least 1; a row with every
    # position masked has none and comes out zero, never NaN (which a zero weight would carry on).
    out = out / mx.maximum(normaliser, 1e-6)
    return out.reshape(batch, kv_heads, repeats, end - start, -1)


def describe() -> str:
    """Build the kernels (compiled if the JIT works); say which they are."""
    kind = "a compiled polynomial" if kernels().compiled else "MLX's"
    return f"CPU attention with {kind} exponential"
