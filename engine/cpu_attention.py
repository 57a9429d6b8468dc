"""Attention for MLX's CPU backend: the softmax that dominates prefill, made cheaper.

On the CPU, `mx.fast.scaled_dot_product_attention` falls back to matmul, softmax, matmul, and the
softmax's scalar `exp` is the largest cost of a long prefill: a 519-token turn on a 2,208-token
history spent 6.5 s of 9 s in it (SmolLM2-135M, 2 cores). Here the exponential is a degree-5
polynomial on 2^fraction, scaled by 2^integer built from the float's bits (relative error
< 3e-7), fused by `mx.compile` into one kernel with the mask, and the rows are split across one
CPU stream per core so every core works on it. Metal and CUDA keep their fused kernels:
`mlx_seams.install_cpu_attention` routes mlx-lm's attention here only when the model runs on the
CPU, only on the engine thread, and only for attention it can do exactly as mlx-lm would (no
attention sinks, no quantized KV cache).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import partial

import mlx.core as mx
from loguru import logger

LOG2_E = 1.4426950408889634
# Below 2^-126 a float32 is denormal; such weights are zero next to the row's maximum (weight 1).
MIN_EXPONENT = -126.0
# Split a softmax across streams only when each part has at least this many scores.
MIN_SCORES_PER_STREAM = 1 << 16

_threads = threading.local()  # MLX streams belong to the thread that made them


def _streams() -> list[mx.Stream]:
    """This thread's CPU streams, one per core (at most 8)."""
    streams: list[mx.Stream] | None = getattr(_threads, "streams", None)
    if streams is None:
        streams = [mx.new_stream(mx.cpu) for _ in range(max(1, min(os.cpu_count() or 1, 8)))]
        _threads.streams = streams
    return streams


def synchronize_streams() -> None:
    """Wait for this thread's attention streams (the engine thread calls it before it ends)."""
    for stream in getattr(_threads, "streams", None) or ():
        mx.synchronize(stream)


def _exp2(t: mx.array) -> mx.array:
    """2**t for t in [-126, 0]: 2**floor(t) from the exponent bits times a polynomial in the fraction."""
    whole = mx.floor(t)
    fraction = t - whole
    poly = 1.8775767e-3 * fraction + 8.9893397e-3
    poly = poly * fraction + 5.5826318e-2
    poly = poly * fraction + 2.4015361e-1
    poly = poly * fraction + 6.9315308e-1
    poly = poly * fraction + 9.9999994e-1
    return poly * ((whole.astype(mx.int32) + 127) << 23).view(mx.float32)


def _softmax(scores: mx.array) -> mx.array:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = _exp2(mx.maximum(shifted * LOG2_E, MIN_EXPONENT))
    return weights / weights.sum(axis=-1, keepdims=True)


class _Softmax:
    """Masked softmax over the last axis in float32: compiled polynomial, or MLX's own."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        core: Callable[[mx.array], mx.array] = _softmax if compiled else partial(mx.softmax, axis=-1)

        def plain(scores: mx.array) -> mx.array:
            return core(scores)

        def keep(scores: mx.array, keep: mx.array) -> mx.array:
            return core(mx.where(keep, scores, mx.finfo(scores.dtype).min))

        def add(scores: mx.array, bias: mx.array) -> mx.array:
            return core(scores + bias)

        wrap: Callable[[Callable[..., mx.array]], Callable[..., mx.array]] = (
            mx.compile if compiled else (lambda fn: fn)
        )
        self.plain, self.keep, self.add = wrap(plain), wrap(keep), wrap(add)

    def __call__(self, scores: mx.array, mask: mx.array | None) -> mx.array:
        if mask is None:
            return self.plain(scores)
        if mask.dtype == mx.bool_:
            return self.keep(scores, mask)
        return self.add(scores, mask.astype(scores.dtype))


_softmax_impl: _Softmax | None = None


def _masked_softmax() -> _Softmax:
    global _softmax_impl
    if _softmax_impl is None:
        _softmax_impl = _Softmax(compiled=_jit_works())
    return _softmax_impl


def _split_softmax(scores: mx.array, mask: mx.array | None) -> mx.array:
    """The softmax of row blocks on separate CPU streams, so each core takes a share."""
    softmax = _masked_softmax()
    rows = scores.shape[-2]
    streams = _streams()
    parts = min(len(streams), rows, max(1, scores.size // MIN_SCORES_PER_STREAM))
    if parts < 2:
        return softmax(scores, mask)
    bounds = [rows * i // parts for i in range(1, parts)]
    score_parts = mx.split(scores, bounds, axis=-2)
    if mask is not None and mask.ndim >= 2 and mask.shape[-2] == rows:
        mask_parts: list[mx.array | None] = list(mx.split(mask, bounds, axis=-2))
    else:
        mask_parts = [mask] * parts
    outputs = []
    for stream, part, part_mask in zip(streams, score_parts, mask_parts, strict=False):
        with mx.stream(stream):
            outputs.append(softmax(part, part_mask))
    return mx.concatenate(outputs, axis=-2)


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """Scaled dot-product attention with mlx's semantics ("causal" is bottom-right aligned)."""
    batch, heads, length, dims = queries.shape
    kv_heads = keys.shape[1]
    repeats = heads // kv_heads
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(batch, kv_heads, repeats, length, dims)
        keys = mx.expand_dims(keys, 2)
        values = mx.expand_dims(values, 2)
    scores = queries @ keys.swapaxes(-1, -2)
    in_dtype = scores.dtype
    scores = scores.astype(mx.float32)
    if isinstance(mask, str):
        total = scores.shape[-1]
        mask = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
    elif mask is not None and repeats > 1 and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)
    weights = _split_softmax(scores, mask).astype(in_dtype)
    out = weights @ values
    if repeats > 1:
        out = out.reshape(batch, heads, length, dims)
    return out


def _jit_works() -> bool:
    """Whether `mx.compile` can build CPU kernels here (it needs a C++ compiler at run time)."""
    try:
        probe = mx.array([[0.0, -1.0, -2.0]])
        mx.eval(mx.compile(_softmax)(probe))
        return True
    except Exception as exc:  # any failure means: use MLX's own softmax
        logger.info("mx.compile cannot build CPU kernels here ({}); using mx.softmax", exc)
        return False


def describe() -> str:
    """Build the softmax (compiled if the JIT works) and this thread's streams; say which they are."""
    kind = "a compiled polynomial" if _masked_softmax().compiled else "MLX's"
    return f"CPU attention with {kind} softmax over {len(_streams())} streams"
