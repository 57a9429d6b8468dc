"""What one model's KV cache looks like: layers, heads, dtype, and which layers slide."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


class LayerKind(Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int | None
    block_size: int

    def __post_init__(self) -> None:
        assert len(self.layer_kinds) == self.num_layers, "layer_kinds must name every layer"
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")

    @property
    def dtype_size(self) -> int:
        return int(getattr(mx, self.dtype).size)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def bytes_per_block_per_layer(self) -> int:
        return self.bytes_per_token_per_layer * self.block_size

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.FULL)

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.SLIDING)

    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.sliding_layer_ids)

    @property
    def bytes_per_block(self) -> int:
        # A block holds block_size tokens of every layer; sliding layers never hold more than
        # their window, but a running sequence's reservation counts them like full layers.
        return self.bytes_per_block_per_layer * self.num_layers

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "layer_kinds": [kind.value for kind in self.layer_kinds],
            "sliding_window": self.sliding_window,
            "block_size": self.block_size,
        }

    @classmethod
    def from_model(cls, model: Any, block_size: int = 256) -> ModelCacheSpec:
        """Derive the spec from the caches mlx-lm builds for `model` and one probe token."""
        caches = make_prompt_cache(model)
        kinds: list[LayerKind] = []
        windows = set()
        for cache in caches:
            if isinstance(cache, RotatingKVCache):
                kinds.append(LayerKind.SLIDING)
                windows.add(cache.max_size)
            elif isinstance(cache, KVCache):
                kinds.append(LayerKind.FULL)
            else:
                raise ValueError(
                    f"unsupported cache type {type(cache).__name__}: semantic needs KV attention caches"
                )
        if len(windows) > 1:
            raise ValueError(f"layers use several sliding windows {sorted(windows)}; one is supported")
        model(mx.array([[0]]), cache=caches)
        keys = caches[0].state[0]
        mx.eval(keys)
        return cls(
            num_layers=len(caches),
            num_kv_heads=int(keys.shape[1]),
            head_dim=int(keys.shape[3]),
            dtype=str(keys.dtype).removeprefix("mlx.core."),
            layer_kinds=tuple(kinds),
            sliding_window=windows.pop() if windows else None,
            block_size=block_size,
        )
