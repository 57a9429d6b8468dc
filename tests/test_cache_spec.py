"""A model's cache spec is read from the caches mlx-lm makes for it: every layer's kind, window and
widths, or a refusal naming the layer semantic cannot keep."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache

from semantic.engine.cache_store.cache_spec import (
    LayerKind,
    ModelCacheSpec,
    UnsupportedModelError,
    describe_layers,
)


class CachesOf:
    """A model of the given caches: one token through it fills each with keys and values of the
    given (heads, key width, value width), or a recurrent state."""

    def __init__(self, *layers: tuple[Any, tuple[int, int, int]]) -> None:
        self.layers = layers

    def make_cache(self) -> list[Any]:
        return [cache for cache, _ in self.layers]

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        for layer, (_, (heads, key_dim, value_dim)) in zip(cache, self.layers, strict=True):
            if isinstance(layer, ArraysCache):
                layer[0], layer[1] = mx.zeros((1, 3, 8)), mx.zeros((1, heads, key_dim, value_dim))
            else:
                layer.update_and_fetch(mx.zeros((1, heads, 1, key_dim)), mx.zeros((1, heads, 1, value_dim)))
        return tokens


def test_every_layer_keeps_its_own_window_and_widths() -> None:
    model = CachesOf(
        (KVCache(), (1, 576, 512)),  # MLA: one latent head, keys wider than values
        (RotatingKVCache(max_size=128), (8, 64, 64)),
        (RotatingKVCache(max_size=1024), (8, 64, 64)),
        (ArraysCache(2), (4, 16, 16)),
    )
    spec = ModelCacheSpec.from_model(model, block_size=16)
    assert spec.layer_kinds == (LayerKind.FULL, LayerKind.SLIDING, LayerKind.SLIDING, LayerKind.STATE)
    assert spec.layer_windows == (None, 128, 1024, None) and spec.sliding_window == 1024
    assert spec.kv_widths == ((1, 576, 512), (8, 64, 64), (8, 64, 64))
    assert spec.state_bytes == (3 * 8 + 4 * 16 * 16) * 4
    # A block is charged the full layer's bytes; one keeping its sliding layers too, enough more.
    full, sliding = (576 + 512) * 4, 2 * 8 * 128 * 4
    assert spec.bytes_per_block == full * 16 and spec.window_extra == -(-sliding // full)
    assert describe_layers(spec) == "1 full, 2 sliding (windows 128, 1024), 1 state"
    assert spec.to_dict()["layer_windows"] == [None, 128, 1024, None]  # what a cache file states


@pytest.mark.parametrize(
    ("cache", "reason"),
    [
        (RotatingKVCache(max_size=64, keep=4), "keeps 4 sink tokens"),
        (ChunkedKVCache(chunk_size=64), "keeps a ChunkedKVCache"),
    ],
)
def test_a_cache_semantic_cannot_rebuild_exactly_is_refused_naming_its_layer(cache: Any, reason: str) -> None:
    model = CachesOf((KVCache(), (2, 16, 16)), (cache, (2, 16, 16)))
    with pytest.raises(UnsupportedModelError, match=f"layer 1 {reason}"):
        ModelCacheSpec.from_model(model)


def test_a_model_without_attention_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="no attention layers"):
        ModelCacheSpec.from_model(CachesOf((ArraysCache(2), (2, 8, 8)), (ArraysCache(2), (2, 8, 8))))
