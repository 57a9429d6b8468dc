"""SwiGLU (`silu(gate) * x`, the MLP of most mlx-lm models) for MLX's CPU backend, made cheaper.

MLX's CPU `exp`, and so its sigmoid, runs an element at a time, which makes mlx-lm's compiled
`swiglu` a large part of a prefill (docs/benchmarks.md, "Linux CPU speed"). Here the sigmoid takes
its exponential from `cpu_exp`'s polynomial (relative error < 3e-7) on a non-positive argument,
exp(-|gate|), so nothing overflows:

    sigmoid(g) = 1 / (1 + e)  for g >= 0,   e / (1 + e)  for g < 0,   where e = exp(-|g|).

Float32 only (the polynomial builds floats from their bits); other dtypes get mlx-lm's function.
`mlx_adapter.model_hooks.install_kernel_hooks` routes mlx-lm's `swiglu` here on the engine thread, on the CPU.
"""

from __future__ import annotations

import mlx.core as mx

from semantic.engine.cpu.cpu_exp import LOG2_E, exp2_factors, jit_works
from semantic.engine.cpu.shape_bound_compile import ShapeBoundCompile


def _exp_factors(gate: mx.array) -> tuple[mx.array, mx.array]:
    return exp2_factors(-mx.abs(gate) * LOG2_E)


def _swiglu_of(gate: mx.array, x: mx.array, e: mx.array) -> mx.array:
    sigmoid = mx.where(gate >= 0, 1.0, e) / (1.0 + e)
    return gate * sigmoid * x


class _Kernels:
    """Two loops where the JIT works (exp(-|gate|)'s factors, then the rest: `cpu_exp` says why
    the bit-cast between them stays outside), MLX's ops otherwise."""

    def __init__(self, compiled: bool) -> None:
        self.factors = ShapeBoundCompile(_exp_factors) if compiled else _exp_factors
        self.rest = ShapeBoundCompile(_swiglu_of) if compiled else _swiglu_of


_kernels: _Kernels | None = None


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`silu(gate) * x` for float32 arrays of one shape (the caller checks both)."""
    global _kernels
    if _kernels is None:
        _kernels = _Kernels(jit_works())
    poly, bits = _kernels.factors(gate)
    return _kernels.rest(gate, x, poly * bits.view(mx.float32))
