"""The CPU kernels' compiled functions see a new input shape nearly every step; the traces MLX
keeps for them stay bounded, and every call still computes what the function does."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import pytest

from semantic.engine.cpu.cpu_exp import _log2_factors, jit_works
from semantic.engine.cpu.shape_bound_compile import ShapeBoundCompile

pytestmark = pytest.mark.skipif(not jit_works(), reason="mx.compile cannot build CPU kernels here")


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def test_past_its_bound_it_starts_afresh_and_still_computes_the_function() -> None:
    kernel = ShapeBoundCompile(_log2_factors, max_shapes=8)
    for width in [*range(1, 30), *range(1, 5)]:  # new shapes, then ones seen before a restart
        scores = -mx.arange(width * 3, dtype=mx.float32).reshape(1, 3, 1, width) / 7
        for got, expected in zip(kernel(scores), _log2_factors(scores), strict=True):
            assert mx.array_equal(got, expected)
        assert 1 <= kernel.num_shapes <= 8
    assert kernel.num_restarts == 4  # 29 shapes, then 4 from before: restarts at 9, 17, 25 and 30


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from Linux's /proc")
def test_memory_stays_bounded_over_thousands_of_history_lengths() -> None:
    """A decode step's scores are one column wider per token of history: 3,000 widths kept every
    trace of a plain `mx.compile` (~32 KB each, ~95 MiB) for the server's life."""
    kernel = ShapeBoundCompile(_log2_factors, max_shapes=256)
    for width in range(1, 300):
        mx.eval(kernel(mx.zeros((1, 3, 1, width))))  # the allocator reaches its working size
    gc.collect()
    before = rss_mib()
    for width in range(300, 3300):
        mx.eval(kernel(mx.zeros((1, 3, 1, width))))
    gc.collect()
    assert rss_mib() - before < 32
