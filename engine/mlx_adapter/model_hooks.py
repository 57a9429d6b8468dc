"""Hooks into mlx-lm's model modules, which call module globals (`scaled_dot_product_attention`,
`swiglu`, `create_causal_mask`) that we replace: written against mlx-lm 0.32.2, whose models call
these by their module-level names (and the attention by its signature, checked at load).

Attention is hooked on every backend, for one reason everywhere: a packed pass (`mixed_step.py`)
hands it a `PackedLayerCache`, and each group is attended apart. On the CPU the hooks also use our
kernels, `cpu_attention` and `cpu_swiglu`, but only on a thread that asked for them (the engine
thread, inside `cpu_kernels_on_this_thread`) and only where they compute what mlx-lm would (no
attention sinks, no quantized KV cache, shapes and masks `cpu_attention.supports`; float32
SwiGLU); everywhere else each is mlx-lm's own
function, bit for bit. Metal and CUDA keep their fused kernels.

A batch cache's mask is a boolean array even for one sequence without padding (mlx-lm's
`BatchKVCache.make_mask`), and masking every score costs a returning agent's short turn over a
long history time in every layer. So on the engine thread the masks of more than one row that
`create_causal_mask` makes are remembered with their largest left padding, and attention given
one of them masks only the columns that need it (`cpu_attention.PaddedCausal`); any other array is
applied whole.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from loguru import logger
from mlx_lm.models import activations, base

from semantic.engine.cpu import cpu_attention, cpu_swiglu
from semantic.engine.mlx_adapter.mixed_step import PackedLayerCache, packed_attention
from semantic.engine.mlx_adapter.seam_check import require

ATTENTION_PARAMETERS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")

_engine_thread = threading.local()


@contextmanager
def cpu_kernels_on_this_thread(enabled: bool = True) -> Iterator[None]:
    """Let the installed hooks use our kernels on the calling thread (the engine thread) only, where
    the backend profile has them on (`enabled`); elsewhere the hooks are mlx-lm's functions."""
    previous = getattr(_engine_thread, "enabled", False)
    _engine_thread.enabled = enabled
    try:
        yield
    finally:
        _engine_thread.enabled = previous


def _on_engine_thread() -> bool:
    return getattr(_engine_thread, "enabled", False)


def _second_cpu_stream() -> mx.Stream | None:
    """A second CPU stream for the engine thread, made by the first attention big enough to split.
    MLX runs each stream's ops one at a time on a thread of its own, and an elementwise op on one
    core, so work split over two streams takes both cores (BLAS calls stay on one stream: their own
    threads already take both). Only attention's weights are made there, used up within the layer:
    a returning turn's values gathered there from the pool (arrays the batch then updates in place)
    made its first token slower through the server, not faster.
    None off the engine thread, where the model is not on the CPU, or with one core."""
    if not _on_engine_thread() or mx.default_device() != mx.cpu or (os.cpu_count() or 1) < 2:
        return None
    stream: mx.Stream | None = getattr(_engine_thread, "second_stream", None)
    if stream is None:
        stream = _engine_thread.second_stream = mx.new_stream(mx.cpu)
    return stream


# The last few causal masks made on the engine thread (a packed pass makes two before attending).
NUM_REMEMBERED_MASKS = 4


def _remembered_masks() -> deque[cpu_attention.PaddedCausal]:
    masks: deque[cpu_attention.PaddedCausal] | None = getattr(_engine_thread, "masks", None)
    if masks is None:
        masks = _engine_thread.masks = deque(maxlen=NUM_REMEMBERED_MASKS)
    return masks


def _causal_mask_hook(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    @functools.wraps(original)
    def create_causal_mask(
        N: int,
        offset: int = 0,
        window_size: int | None = None,
        right_padding: mx.array | None = None,
        left_padding: mx.array | None = None,
    ) -> mx.array:
        mask = original(N, offset, window_size, right_padding, left_padding)
        # A decode step's one-row mask is applied whole: its largest padding would be read with a
        # sync (`tolist`) while the previous step still computes, which stalls mlx-lm's pipelined
        # decode, which costs more than masking the row whole.
        if N > 1 and _on_engine_thread() and window_size is None and right_padding is None:
            max_left_padding = 0 if left_padding is None else int(left_padding.max().tolist())  # type: ignore[arg-type]
            _remembered_masks().append(cpu_attention.PaddedCausal(mask, max_left_padding))
        return mask

    return create_causal_mask


def _known_mask(mask: Any, length: int, total: int) -> Any:
    """`mask` as a `PaddedCausal` if `create_causal_mask` made it for these shapes, else as it is."""
    if not isinstance(mask, mx.array) or mask.shape[-2:] != (length, total):
        return mask
    return next((known for known in _remembered_masks() if known.array is mask), mask)


def _attention_hook(original: Callable[..., mx.array], cpu_kernels: bool) -> Callable[..., mx.array]:
    @functools.wraps(original)
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: mx.array | str | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        def attend(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float, mask: Any) -> Any:
            ours = cpu_kernels and _on_engine_thread() and sinks is None and not hasattr(cache, "bits")
            supported = ours and cpu_attention.supports(queries, keys, values, mask)
            if not (supported and cpu_attention.worth_using(queries, keys)):
                return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
            mask = _known_mask(mask, queries.shape[2], keys.shape[2])
            second = _second_cpu_stream() if cpu_attention.worth_splitting(queries, keys) else None
            return cpu_attention.attention(queries, keys, values, scale, mask, second)

        if isinstance(cache, PackedLayerCache):
            return packed_attention(queries, keys, values, cache, scale, attend)
        return attend(queries, keys, values, cache, scale, mask)

    return scaled_dot_product_attention


def _swiglu_hook(
    original: Callable[[mx.array, mx.array], mx.array],
) -> Callable[[mx.array, mx.array], mx.array]:
    @functools.wraps(original)
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        ours = _on_engine_thread() and gate.dtype == x.dtype == mx.float32
        if not ours or gate.shape != x.shape:
            return original(gate, x)
        return cpu_swiglu.swiglu(gate, x)

    return swiglu


def _install(name: str, original: Any, hook: Any, home: Any, description: str) -> None:
    for module_name, module in list(sys.modules.items()):
        uses_original = getattr(module, name, None) is original
        if module_name.startswith("mlx_lm.models.") and module is not home and uses_original:
            setattr(module, name, hook)
            logger.info("{}: {} on the engine thread", module_name, description)


def install_kernel_hooks(cpu_kernels: bool = True, packed_passes: bool = True) -> bool:
    """Hook attention into every imported mlx-lm model module that uses mlx-lm's own where packed
    passes need it, and with `cpu_kernels` (on the CPU only) SwiGLU and the masks too; True if the
    CPU kernels are on. Call after loading a model (its module is then imported), on the engine
    thread. Neither: nothing is installed, every module keeps mlx-lm's functions."""
    cpu_kernels = cpu_kernels and mx.default_device() == mx.cpu
    if not (cpu_kernels or packed_passes):
        return False
    original_attention = base.scaled_dot_product_attention
    attention = _attention_hook(original_attention, cpu_kernels)
    description = cpu_attention.describe() if cpu_kernels else "packed passes attended per group"
    _install("scaled_dot_product_attention", original_attention, attention, base, description)
    if cpu_kernels:
        swiglu = _swiglu_hook(activations.swiglu)
        _install("swiglu", activations.swiglu, swiglu, activations, "SwiGLU with the polynomial exponential")
        masks = _causal_mask_hook(base.create_causal_mask)
        _install("create_causal_mask", base.create_causal_mask, masks, base, "causal masks told apart")
    return cpu_kernels


def check_model_hooks() -> None:
    check_attention(base.scaled_dot_product_attention)


def check_attention(function: Callable[..., Any]) -> None:
    """The attention hook takes the place of mlx-lm's by its signature."""
    require(
        f"mlx_lm.models.base.scaled_dot_product_attention takes ({', '.join(ATTENTION_PARAMETERS)})",
        lambda: tuple(inspect.signature(function).parameters) == ATTENTION_PARAMETERS,
    )
