"""Attention for MLX's CPU backend: the softmax that dominates long prompts, made cheaper.

On the CPU, `mx.fast.scaled_dot_product_attention` falls back to matmul, softmax, matmul, and the
softmax's scalar `exp` is the largest cost of a long prefill: a 519-token turn on a 2,208-token
history spent 6.5 s of 9 s in it (SmolLM2-135M, 2 cores). Here:

- the query heads that share a KV head are folded into the rows of one matmul per KV head;
- the exponential is a degree-5 polynomial on 2^fraction, scaled by 2^integer built from the
  float's bits (relative error < 3e-7); the integer part is rounded with the 1.5·2^23 trick
  rather than `floor`, and the compiled kernel returns the polynomial and the bits as two arrays
  of the scores' shape, multiplied outside it: every input and output then has one shape, so
  `mx.compile` builds one vectorised loop (a broadcast input, or a bit-cast inside, makes it an
  element-at-a-time strided loop or splits it in several: 1.45 ms instead of 0.73 for the scores
  of a 41-token turn over a 2.3K history, one SmolLM2 layer);
- a causal mask only touches its last L columns, so the row maximum is taken over the rest
  unmasked;
- with many rows, the normaliser comes out of the second matmul (values with a column of ones)
  instead of a separate sum over every score.

Metal and CUDA keep their fused kernels: `cpu_kernels.install_kernel_hooks` routes mlx-lm's attention
here only when the model runs on the CPU, only on the engine thread, and only for attention it can
do exactly as mlx-lm would (no attention sinks, no quantized KV cache).
"""

from __future__ import annotations

import mlx.core as mx
from loguru import logger

from semantic.engine.shape_bound_compile import ShapeBoundCompile

LOG2_E = 1.4426950408889634
# Below 2^-126 a float32 is denormal; such weights are zero next to the row's maximum (weight 1).
MIN_EXPONENT = -126.0
ROUNDING = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds a float32 to an integer
# 2^f on [-0.5, 0.5], fitted for relative error (1.3e-7 with these float32 coefficients).
EXP2_COEFFICIENTS = (
    1.3313360570942506e-3,
    9.675888377944817e-3,
    5.550599827233194e-2,
    2.4022111126131823e-1,
    6.931470357007206e-1,
    1.0000000742738324,
)
# Rows of one matmul from which the normaliser rides on the second matmul (a column of ones
# appended to the values costs a copy of them; a separate sum costs a pass over every score).
MIN_ROWS_FOR_FOLDED_SUM = 16


def exp2_factors(t: mx.array) -> tuple[mx.array, mx.array]:
    """2**t for t <= 0 (below -126 as 2**-126) as two factors: a polynomial in t's fraction, and
    2**round(t) as the bits of a float32 (int32; `.view(mx.float32)` reads it). Elementwise only,
    so that `mx.compile` fuses it into one loop; the caller multiplies the two outside."""
    t = mx.where(t < MIN_EXPONENT, MIN_EXPONENT, t)  # `where` vectorises, NaN-aware `maximum` not
    whole = (t + ROUNDING) - ROUNDING
    fraction = t - whole
    poly = fraction * EXP2_COEFFICIENTS[0] + EXP2_COEFFICIENTS[1]  # constants, not array inputs
    for coefficient in EXP2_COEFFICIENTS[2:]:
        poly = poly * fraction + coefficient
    return poly, (whole.astype(mx.int32) + 127) << 23


def exp2(t: mx.array) -> mx.array:
    """2**t for t in [-126, 0]: 2**round(t) from the exponent bits times a polynomial in the rest."""
    poly, bits = exp2_factors(t)
    return poly * bits.view(mx.float32)


def _log2_factors(shifted: mx.array) -> tuple[mx.array, mx.array]:
    return exp2_factors(shifted * LOG2_E)


class _Kernels:
    """exp(scores - row max), masked or biased: the polynomial compiled into one loop where the JIT
    works, MLX's `exp` otherwise."""

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled
        self._factors = ShapeBoundCompile(_log2_factors) if compiled else None

    def _exp(self, shifted: mx.array) -> mx.array:
        if self._factors is None:
            return mx.exp(shifted)
        poly, bits = self._factors(shifted)
        return poly * bits.view(mx.float32)

    def plain(self, scores: mx.array, row_max: mx.array) -> mx.array:
        return self._exp(scores - row_max)

    def kept(self, scores: mx.array, row_max: mx.array, keep: mx.array) -> mx.array:
        return mx.where(keep, self._exp(scores - row_max), 0.0)

    def biased(self, scores: mx.array, row_max: mx.array, bias: mx.array) -> mx.array:
        return self._exp(scores + bias - row_max)


_kernels: _Kernels | None = None


def _compiled() -> _Kernels:
    global _kernels
    if _kernels is None:
        _kernels = _Kernels(compiled=jit_works())
    return _kernels


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis in float32, with the compiled exponential."""
    weights = _compiled().plain(scores, scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def _row_max(scores: mx.array, length: int, causal: bool, mask: mx.array | None) -> mx.array:
    if causal:
        # Only the last `length` columns hold masked (future) positions.
        total = scores.shape[-1]
        visible = scores[..., : total - length].max(axis=-1, keepdims=True) if total > length else None
        tail_keep = mx.arange(length)[:, None] >= mx.arange(length)[None]
        tail = mx.where(tail_keep, scores[..., total - length :], -mx.inf).max(axis=-1, keepdims=True)
        return tail if visible is None else mx.maximum(visible, tail)
    if mask is None:
        return scores.max(axis=-1, keepdims=True)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf).max(axis=-1, keepdims=True)
    return (scores + mask).max(axis=-1, keepdims=True)


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """Scaled dot-product attention with mlx's semantics ("causal" is bottom-right aligned)."""
    batch, heads, length, dims = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    rows = repeats * length
    folded = (queries * scale).reshape(batch, kv_heads, rows, dims)
    scores = (folded @ keys.swapaxes(-1, -2)).astype(mx.float32)
    # [batch, kv heads, repeats, length, total]: a mask of [.., length, total] broadcasts over repeats.
    scores = scores.reshape(batch, kv_heads, repeats, length, total)
    causal = isinstance(mask, str)
    array_mask: mx.array | None = None
    if isinstance(mask, mx.array):
        array_mask = mx.expand_dims(mask, -3) if mask.ndim > 3 else mask
    row_max = _row_max(scores, length, causal, array_mask)
    kernels = _compiled()
    if causal:
        keep = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
        weights = kernels.kept(scores, row_max, keep)
    elif array_mask is None:
        weights = kernels.plain(scores, row_max)
    elif array_mask.dtype == mx.bool_:
        weights = kernels.kept(scores, row_max, array_mask)
    else:
        weights = kernels.biased(scores, row_max, array_mask.astype(mx.float32))
    weights = weights.reshape(batch, kv_heads, rows, total).astype(values.dtype)
    if rows >= MIN_ROWS_FOR_FOLDED_SUM:
        ones = mx.ones((*values.shape[:-1], 1), dtype=values.dtype)
        weighted = weights @ mx.concatenate([values, ones], axis=-1)
        out, normaliser = weighted[..., :-1], weighted[..., -1:]
    else:
        out, normaliser = weights @ values, weights.sum(axis=-1, keepdims=True)
    # A row's largest visible weight is 1, so its normaliser is at least 1; a row with every
    # position masked has none and comes out zero, never NaN (which a zero weight would carry on).
    out = out / mx.maximum(normaliser, 1e-6)
    return out.reshape(batch, heads, length, values.shape[-1])


def jit_works() -> bool:
    """Whether `mx.compile` can build CPU kernels here (it needs a C++ compiler at run time)."""
    try:
        mx.eval(mx.compile(_log2_factors)(mx.array([[0.0, -1.0, -2.0]])))
        return True
    except Exception as exc:  # any failure means: use MLX's own exp
        logger.info("mx.compile cannot build CPU kernels here ({}); using mx.exp", exc)
        return False


def describe() -> str:
    """Build the kernels (compiled if the JIT works); say which they are."""
    kind = "a compiled polynomial" if _compiled().compiled else "MLX's"
    return f"CPU attention with {kind} exponential"
