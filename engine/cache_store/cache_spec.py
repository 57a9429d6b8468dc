"""What one model's cache looks like: its layers' kinds, the attention layers' widths, dtype.

Three kinds of layer, as mlx-lm builds their caches:
- FULL attention (`KVCache`): every token's keys and values;
- SLIDING-window attention (`RotatingKVCache`): the last `window` tokens' keys and values, the
  window per layer (a model may mix several);
- STATE (`ArraysCache`: Mamba, Gated DeltaNet, convolution layers): a fixed-size recurrent state
  per sequence, which cannot be cut back to an earlier token.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx

from semantic.engine.mlx_adapter.api import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache


class LayerKind(Enum):
    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"


class UnsupportedModelError(ValueError):
    """A model whose caches semantic cannot keep exactly: refused at load, with the reason."""


# (KV heads, key width, value width) of one attention layer: MLA's latent cache has one "head" whose
# keys are wider than its values; some models give sliding and global layers different widths.
KVWidth = tuple[int, int, int]
StateArray = tuple[tuple[int, ...], str]


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    num_layers: int
    num_kv_heads: int  # the first attention layer's (for logs; `kv_widths` has every layer's)
    head_dim: int
    dtype: str
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int | None  # the widest window (None: no sliding layers)
    block_size: int
    # Per layer, its window (None for full and state layers); () means `sliding_window` for every
    # sliding layer.
    layer_windows: tuple[int | None, ...] = ()
    # Per attention layer, in layer order; () means (num_kv_heads, head_dim, head_dim) for each.
    kv_widths: tuple[KVWidth, ...] = ()
    # Per STATE layer, its arrays' shapes (one sequence) and dtypes.
    state_arrays: tuple[tuple[StateArray, ...], ...] = ()

    def __post_init__(self) -> None:
        assert len(self.layer_kinds) == self.num_layers, "layer_kinds must name every layer"
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {self.block_size}")
        if not self.layer_windows:
            windows = tuple(self.sliding_window if k is LayerKind.SLIDING else None for k in self.layer_kinds)
            object.__setattr__(self, "layer_windows", windows)
        if not self.kv_widths:
            width = (self.num_kv_heads, self.head_dim, self.head_dim)
            object.__setattr__(self, "kv_widths", (width,) * len(self.attention_layer_ids))
        assert len(self.layer_windows) == self.num_layers, "layer_windows must name every layer"
        assert len(self.kv_widths) == len(self.attention_layer_ids), "kv_widths: one per attention layer"

    @property
    def dtype_size(self) -> int:
        return int(getattr(mx, self.dtype).size)

    def _bytes_per_token(self, kind: LayerKind) -> int:
        widths = [
            w
            for w, i in zip(self.kv_widths, self.attention_layer_ids, strict=True)
            if self.layer_kinds[i] is kind
        ]
        return sum(heads * (k + v) for heads, k, v in widths) * self.dtype_size

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token in every attention layer."""
        return self._bytes_per_token(LayerKind.FULL) + self._bytes_per_token(LayerKind.SLIDING)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """The mean over attention layers (for estimates)."""
        return self.bytes_per_token // max(1, len(self.attention_layer_ids))

    @property
    def window_slots(self) -> tuple[int, ...]:
        """The sliding layers' places among the attention layers (a block payload's order)."""
        return tuple(
            s for s, i in enumerate(self.attention_layer_ids) if self.layer_kinds[i] is LayerKind.SLIDING
        )

    @property
    def window_slots_mask(self) -> tuple[bool, ...]:
        """Per attention layer, whether it slides."""
        return tuple(self.layer_kinds[i] is LayerKind.SLIDING for i in self.attention_layer_ids)

    @property
    def window_extra(self) -> int:
        """Pool blocks a block is charged for holding its sliding layers too (0 where a block's own
        charge covers them: a model without full layers, or without sliding ones)."""
        full, sliding = self._bytes_per_token(LayerKind.FULL), self._bytes_per_token(LayerKind.SLIDING)
        return -(-sliding // full) if full and sliding else 0

    def num_blocks_reserved(self, num_tokens: int) -> int:
        """Pool blocks a running sequence of `num_tokens` tokens is charged: its blocks, and the
        window charge of those its sliding layers still hold (the widest window and a block more)."""
        num_blocks = self.num_blocks_for(num_tokens)
        if not self.window_extra:
            return num_blocks
        window_blocks = self.num_blocks_for(self.sliding_window or 0) + 1
        return num_blocks + self.window_extra * min(num_blocks, window_blocks)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers whose keys and values the pool's blocks hold: full and sliding."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is not LayerKind.STATE)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.FULL)

    @property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.SLIDING)

    @property
    def state_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind is LayerKind.STATE)

    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.sliding_layer_ids)

    @property
    def has_state_layers(self) -> bool:
        return bool(self.state_layer_ids)

    @property
    def bytes_per_block(self) -> int:
        """A pool block's charge: block_size tokens of the full-attention layers (of the sliding ones
        in a model without full layers); a block holding its sliding layers too is charged
        `window_extra` more."""
        per_token = self._bytes_per_token(LayerKind.FULL) or self._bytes_per_token(LayerKind.SLIDING)
        return per_token * self.block_size

    @property
    def state_bytes(self) -> int:
        """One sequence's state in every STATE layer."""
        total = 0
        for layer in self.state_arrays:
            for shape, dtype in layer:
                count = 1
                for size in shape:
                    count *= size
                total += count * int(getattr(mx, dtype).size)
        return total

    @property
    def num_blocks_per_state(self) -> int:
        """Pool blocks one state snapshot is charged: the byte budget counts snapshots too."""
        return -(-self.state_bytes // self.bytes_per_block) if self.state_bytes else 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "dtype": self.dtype,
            "layer_kinds": [kind.value for kind in self.layer_kinds],
            "layer_windows": list(self.layer_windows),
            "kv_widths": [list(width) for width in self.kv_widths],
            "state_arrays": [[[list(shape), dtype] for shape, dtype in layer] for layer in self.state_arrays],
            "block_size": self.block_size,
        }

    @classmethod
    def from_model(cls, model: Any, block_size: int = 256) -> ModelCacheSpec:
        """Derive the spec from the caches mlx-lm builds for `model` and one probe token; raises
        UnsupportedModelError naming what semantic cannot keep."""
        caches = make_prompt_cache(model)
        kinds: list[LayerKind] = []
        windows: list[int | None] = []
        for index, cache in enumerate(caches):
            kind, window = _layer_kind(index, cache)
            kinds.append(kind)
            windows.append(window)
        if LayerKind.STATE in kinds and len(set(kinds)) == 1:
            raise UnsupportedModelError(
                "no attention layers: semantic keeps agents' caches as blocks of attention keys and "
                "values, and a purely recurrent model (Mamba, RWKV) has none"
            )
        model(mx.array([[0]]), cache=caches)
        attention = [c for c, k in zip(caches, kinds, strict=True) if k is not LayerKind.STATE]
        states = [c for c, k in zip(caches, kinds, strict=True) if k is LayerKind.STATE]
        mx.eval([c.state for c in caches])
        widths = [(int(c.keys.shape[1]), int(c.keys.shape[3]), int(c.values.shape[3])) for c in attention]
        dtypes = {_dtype_name(c.keys.dtype) for c in attention} | {
            _dtype_name(c.values.dtype) for c in attention
        }
        if len(dtypes) > 1:
            raise UnsupportedModelError(
                f"attention layers keep keys and values in several dtypes {sorted(dtypes)}"
            )
        if any(array is None for state in states for array in state.cache):
            raise UnsupportedModelError("a recurrent layer left part of its state unset after a token")
        sliding = [w for w in windows if w is not None]
        return cls(
            num_layers=len(caches),
            num_kv_heads=widths[0][0],
            head_dim=widths[0][1],
            dtype=dtypes.pop(),
            layer_kinds=tuple(kinds),
            sliding_window=max(sliding) if sliding else None,
            block_size=block_size,
            layer_windows=tuple(windows),
            kv_widths=tuple(widths),
            state_arrays=tuple(
                tuple((tuple(int(n) for n in a.shape), _dtype_name(a.dtype)) for a in state.cache)
                for state in states
            ),
        )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _layer_kind(index: int, cache: Any) -> tuple[LayerKind, int | None]:
    # Exact types: a subclass may keep its tokens another way (a quantized or chunked cache).
    if type(cache) is KVCache:
        return LayerKind.FULL, None
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise UnsupportedModelError(
                f"layer {index} keeps {cache.keep} sink tokens in its rotating cache; semantic rebuilds "
                "sliding windows from blocks without them"
            )
        return LayerKind.SLIDING, int(cache.max_size)
    if isinstance(cache, ArraysCache):
        return LayerKind.STATE, None
    raise UnsupportedModelError(
        f"layer {index} keeps a {type(cache).__name__}; semantic keeps full-attention (KVCache), "
        "sliding-window (RotatingKVCache) and recurrent (ArraysCache) layers"
    )


def describe_layers(spec: ModelCacheSpec) -> str:
    """The layers by kind, for logs and reports: "24 full, 6 sliding (window 512)"."""
    parts = []
    for kind in LayerKind:
        layers = [i for i, k in enumerate(spec.layer_kinds) if k is kind]
        if not layers:
            continue
        part = f"{len(layers)} {kind.value}"
        if kind is LayerKind.SLIDING:
            windows = sorted({spec.layer_windows[i] or 0 for i in layers})
            part += f" (window{'s' if len(windows) > 1 else ''} {', '.join(map(str, windows))})"
        parts.append(part)
    return ", ".join(parts)
