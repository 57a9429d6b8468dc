"""How the adapter's seams check an assumption about mlx-lm, and the module they read."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx_lm

WRITTEN_FOR = (0, 32)  # mlx-lm 0.32.x (every seam was written against 0.32.2)
# The module, not the `mlx_lm.generate` function that the package exports under the same name.
generate_module = importlib.import_module("mlx_lm.generate")


class SeamError(RuntimeError):
    """An assumption semantic makes about mlx-lm's internals does not hold for the installed version."""


def require(assumption: str, holds: Callable[..., bool], *args: Any) -> None:
    """Raise SeamError naming `assumption` unless `holds(*args)` is true (raising counts as false)."""
    try:
        ok, detail = holds(*args), ""
    except Exception as error:
        ok, detail = False, f" ({type(error).__name__}: {error})"
    if not ok:
        raise SeamError(
            f"mlx-lm {mlx_lm.__version__} breaks an assumption semantic relies on: {assumption}{detail}; "
            f"written for mlx-lm {WRITTEN_FOR[0]}.{WRITTEN_FOR[1]}.x, see engine/mlx_adapter/"
        )
