"""SwiGLU (`silu(gate) * x`, the MLP of most mlx-lm models) for MLX's CPU backend, made cheaper.

MLX's CPU `exp`, and so its sigmoid, costs ~10 ns an element here: in mlx-lm's compiled `swiglu`
that is 0.9 ms of a SmolLM2 layer's 2.9 ms for a 40-token turn, and ~10 ms a layer for a 512-token
chunk, a fifth of the prefill. Here the sigmoid takes its exponential from `cpu_attention`'s
polynomial (relative error < 3e-7) on a non-positive argument, exp(-|gate|), so nothing overflows:

    sigmoid(g) = 1 / (1 + e)  for g >= 0,   e / (1 + e)  for g < 0,   where e = exp(-|g|).

Float32 only (the polynomial builds floats from their bits); other dtypes get mlx-lm's function.
`cpu_kernels.install_kernel_hooks` routes mlx-lm's `swiglu` here on the engine thread, on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from semantic.engine.cpu_attention import LOG2_E, MIN_EXPONENT, exp2, jit_works


def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    e = exp2(mx.maximum(-mx.abs(gate) * LOG2_E, MIN_EXPONENT))
    sigmoid = mx.where(gate >= 0, 1.0, e) / (1.0 + e)
    return gate * sigmoid * x


_compiled: Callable[[mx.array, mx.array], mx.array] | None = None


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`silu(gate) * x` for float32 arrays of one shape (the caller checks both)."""
    global _compiled
    if _compiled is None:
        _compiled = mx.compile(_swiglu) if jit_works() else _swiglu
    return _compiled(gate, x)
