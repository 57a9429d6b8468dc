"""`mx.compile` for functions called with ever new shapes, keeping a bounded number of traces.

A function compiled without `shapeless` is traced once per distinct set of input shapes, and MLX
keeps every trace for as long as the compiled function lives. The CPU kernels see a new shape nearly
every step (a decode step's scores are one column wider per token of history), so a server running
for days grew without bound. `shapeless=True` keeps one trace but builds a slower loop on the CPU.
So: compile per shape, and past `max_shapes` distinct shapes start a new compiled function (MLX
erases a compiled function's traces with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

MAX_SHAPES = 256


class ShapeBoundCompile:
    def __init__(self, function: Callable[..., Any], max_shapes: int = MAX_SHAPES) -> None:
        self.function = function
        self.max_shapes = max_shapes
        self.num_restarts = 0
        self._compiled = mx.compile(function)
        self._shapes: set[tuple[tuple[tuple[int, ...], mx.Dtype], ...]] = set()

    @property
    def num_shapes(self) -> int:
        """Distinct input shapes traced by the compiled function now in use."""
        return len(self._shapes)

    def __call__(self, *arrays: mx.array) -> Any:
        key = tuple((tuple(array.shape), array.dtype) for array in arrays)
        if key not in self._shapes:
            if len(self._shapes) >= self.max_shapes:
                self._compiled = mx.compile(self.function)  # the old one, and its traces, go
                self._shapes.clear()
                self.num_restarts += 1
            self._shapes.add(key)
        return self._compiled(*arrays)
