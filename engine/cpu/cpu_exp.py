"""The exponential for MLX's CPU backend, where `mx.exp` runs an element at a time: a degree-5
polynomial on 2^fraction, scaled by 2^integer built from the float's bits (relative error < 3e-7),
compiled into one vectorised loop where the JIT works. The integer part is rounded with the
1.5·2^23 trick rather than `floor`, and the compiled kernel returns the polynomial and the bits as
two arrays of the input's shape, multiplied outside it: every input and output then has one shape,
so `mx.compile` builds one vectorised loop (a broadcast input, or a bit-cast inside, makes it an
element-at-a-time strided loop or splits it in several, both much slower). Attention's softmax
(`cpu_attention`) and SwiGLU's sigmoid (`cpu_swiglu`) use it.
"""

from __future__ import annotations

import mlx.core as mx
from loguru import logger

from semantic.engine.cpu.shape_bound_compile import ShapeBoundCompile

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


class ExpKernels:
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


_kernels: ExpKernels | None = None


def kernels() -> ExpKernels:
    global _kernels
    if _kernels is None:
        _kernels = ExpKernels(compiled=jit_works())
    return _kernels


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis in float32, with the compiled exponential. Weights below 2**-125
    come out zero: the exponential stops at 2**-126, so a masked score weighs that divided by the
    row's sum, often a denormal, and a denormal operand costs x86 CPUs a microcode assist on every
    multiply that meets it (the tool model's LoRA steps, half their weights masked, ran several
    times slower for it); such a weight adds nothing a float32 sum can hold."""
    weights = kernels().plain(scores, scores.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return mx.where(weights < 2.0 ** (MIN_EXPONENT + 1), 0.0, weights)


def jit_works() -> bool:
    """Whether `mx.compile` can build CPU kernels here (it needs a C++ compiler at run time)."""
    try:
        mx.eval(mx.compile(_log2_factors)(mx.array([[0.0, -1.0, -2.0]])))
        return True
    except Exception as exc:  # any failure means: use MLX's own exp
        logger.info("mx.compile cannot build CPU kernels here ({}); using mx.exp", exc)
        return False
