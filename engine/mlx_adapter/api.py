"""mlx-lm's public, documented API as the engine uses it: the one place outside this package's seam
modules that names `mlx_lm`, so the adapter folder is the whole surface semantic builds on.

Nothing here reaches into mlx-lm: each name is exported by mlx-lm under a public name, and using
it the documented way needs no check at load (written against mlx-lm 0.32.2 all the same).
"""

from __future__ import annotations

import mlx_lm
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from mlx_lm.tool_parsers import json_tools
from mlx_lm.utils import load, sharded_load

MLX_LM_VERSION: str = mlx_lm.__version__

__all__ = [
    "MLX_LM_VERSION",
    "ArraysCache",
    "BatchGenerator",
    "BatchKVCache",
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "json_tools",
    "load",
    "make_logits_processors",
    "make_prompt_cache",
    "sharded_load",
    "stream_generate",
]
