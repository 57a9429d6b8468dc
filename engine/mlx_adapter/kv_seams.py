"""mlx-lm's KV cache internals that semantic relies on, each with a check (run by `check_seams`);
written against mlx-lm 0.32.2.

A running sequence's cache read as views into the batch's arrays (not `extract_cache`'s copy of the
whole sequence; a sliding or recurrent layer, bounded in size, through its own `extract`), a batch
cache built over an agent's own arrays (not `merge`'s copy), and the `state` layouts that the
agent cache builds caches from and `cache_tensors` writes out. `HistoryKVCache` takes over the
merge of a lone prompt's rebuilt history.
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from semantic.engine.mlx_adapter.batch_joins import JoiningBatchKVCache, check_joins_match_mlx_lm
from semantic.engine.mlx_adapter.seam_check import generate_module, require

# The batch caches whose arrays `cache_views` can read: mlx-lm's, and the decode batch's own.
PLAIN_BATCH_CACHES = (BatchKVCache, JoiningBatchKVCache)


def check_kv_seams() -> None:
    check_cache_states()
    check_token_order()
    check_batch_cache_views()
    check_batch_cache_takeover()
    check_joins_match_mlx_lm()


def cache_views(generator: BatchGenerator, uid: int) -> list[KVCache] | None:
    """A running sequence's per-layer caches as views into the batch's arrays, so that only the
    slices read from them are ever copied (`extract_cache` copies the whole sequence first). None
    unless every layer is a plain `BatchKVCache` (or the decode batch's `JoiningBatchKVCache`)."""
    found = generator._find_uids([uid]).get(uid)
    if found is None or found[0] == 0:
        return None
    stage, index = found
    batch = generator._generation_batch if stage == 2 else generator._prompt_batch
    views: list[KVCache] = []
    for layer in batch.prompt_cache:
        if type(layer) not in PLAIN_BATCH_CACHES or layer.keys is None:
            return None
        views.append(_sequence_view(layer, index))
    return views


def sequence_caches(generator: BatchGenerator, uid: int) -> tuple[list[Any], int] | None:
    """A running sequence's per-layer caches and how many tokens they hold: attention layers of
    plain batch caches as views into the batch's arrays (`cache_views`), any other layer (a sliding
    window, a recurrent state: both bounded in size) as its own `extract`; None if the generator
    does not hold it."""
    found = generator._find_uids([uid]).get(uid)
    if found is None or found[0] == 0:
        return None
    stage, index = found
    batch = generator._generation_batch if stage == 2 else generator._prompt_batch
    layers: list[Any] = []
    for layer in batch.prompt_cache:
        if type(layer) in PLAIN_BATCH_CACHES and layer.keys is not None:
            layers.append(_sequence_view(layer, index))
        else:
            layers.append(layer.extract(index))
    # The token count from an attention layer's offset: the generator's token list may not hold the
    # last token fed yet.
    return layers, next(int(c.offset) for c in layers if not isinstance(c, ArraysCache))


def trimmed(layers: list[Any], num_tokens: int) -> list[Any]:
    """Views of `layers` (full-attention views, as `sequence_caches` reads them) without their last
    `num_tokens` tokens."""
    cut = []
    for layer in layers:
        view = KVCache()
        end = layer.offset - num_tokens
        view.keys, view.values, view.offset = layer.keys[..., :end, :], layer.values[..., :end, :], end
        cut.append(view)
    return cut


def _sequence_view(layer: Any, index: int) -> KVCache:
    """Sequence `index` of a BatchKVCache as a KVCache viewing its arrays: what `extract` copies."""
    padding = int(layer.left_padding[index].item())
    view = KVCache()
    view.keys = layer.keys[index : index + 1, :, padding : layer._idx]
    view.values = layer.values[index : index + 1, :, padding : layer._idx]
    view.offset = layer._idx - padding
    return view


def in_token_order(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A rotating cache's keys and values with its tokens in order (its buffer wraps around)."""
    return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)


def check_token_order() -> None:
    def wrapped_back_in_order() -> bool:
        rotating = RotatingKVCache(max_size=3)
        for token in range(5):  # one at a time: the buffer wraps
            value = mx.full((1, 1, 1, 1), float(token))
            rotating.update_and_fetch(value, value)
        keys, _ = in_token_order(rotating)
        return bool(keys.flatten().tolist() == [2.0, 3.0, 4.0])

    require("RotatingKVCache._temporal_order puts a wrapped buffer's tokens in order", wrapped_back_in_order)


def check_cache_states() -> None:
    keys = mx.zeros((1, 1, 4, 2))

    def full_state() -> bool:
        full = KVCache()
        full.state = (keys, keys, 3)
        return len(full.state) == 3 and full.offset == 3

    def sliding_state() -> bool:
        sliding = RotatingKVCache(max_size=4)
        sliding.state = (keys, keys, 2, 0, 4, 2)
        return len(sliding.state) == 6 and (sliding.offset, sliding.keep, sliding.max_size) == (2, 0, 4)

    require("KVCache.state is (keys, values, offset) and setting it sets the offset", full_state)
    require("RotatingKVCache.state is (keys, values, offset, keep, max_size, idx)", sliding_state)
    require(
        "ArraysCache keeps its arrays in the list `cache` (state points read and set it)",
        lambda: isinstance(ArraysCache(2).cache, list) and ArraysCache(2).state[0] == [None, None],
    )
    require(
        "quantized KV caches, and only they, have `bits` (the CPU attention hook leaves them to mlx-lm)",
        lambda: hasattr(QuantizedKVCache(), "bits") and not hasattr(KVCache(), "bits"),
    )


def check_batch_cache_views() -> None:
    """`cache_views` reads a BatchKVCache's keys, values, left padding and write index: its views
    must hold what `extract` copies."""

    def views_equal_extract() -> bool:
        batch: Any = BatchKVCache(left_padding=[2, 0])
        keys = mx.arange(2 * 1 * 5 * 2, dtype=mx.float32).reshape(2, 1, 5, 2)
        batch.update_and_fetch(keys, keys + 100)
        extracted, view = batch.extract(0), _sequence_view(batch, 0)
        assert view.keys is not None and view.values is not None
        return (
            view.offset == extracted.offset
            and bool(mx.array_equal(view.keys, extracted.keys))
            and bool(mx.array_equal(view.values, extracted.values))
        )

    require(
        "BatchKVCache keeps `keys`, `values`, `left_padding` and `_idx`, and extract(i) copies "
        "keys[i, :, left_padding[i]:_idx] (cache_views reads them without the copy)",
        views_equal_extract,
    )


def batch_cache_over(cache: KVCache) -> BatchKVCache:
    """A one-sequence BatchKVCache over `cache`'s own arrays, with no left padding: what
    `BatchKVCache.merge([cache])` holds, without its copy of the whole history, and keeping the room
    `cache` has past its offset for the tokens to come."""
    batch: Any = BatchKVCache(left_padding=[0])
    batch.keys, batch.values = cache.keys, cache.values
    batch.offset = batch.offset + cache.offset
    batch._idx = cache.offset
    return batch


def check_batch_cache_takeover() -> None:
    """`batch_cache_over` sets the fields `merge` sets, and mlx-lm merges a prompt batch's caches
    through the first cache's own `merge` (a layer cache can take the merge over)."""

    def same_as_merge() -> bool:
        history = mx.arange(1 * 2 * 3 * 2, dtype=mx.float32).reshape(1, 2, 3, 2)
        room = mx.zeros((1, 2, 5, 2))
        roomy, plain = KVCache(), KVCache()
        roomy.state = (
            mx.concatenate([history, room], axis=2),
            mx.concatenate([history + 50, room], axis=2),
            3,
        )
        plain.state = (history, history + 50, 3)
        new = mx.ones((1, 2, 2, 2))
        ours, theirs = batch_cache_over(roomy), BatchKVCache.merge([plain])
        ours_kv, theirs_kv = ours.update_and_fetch(new, new), theirs.update_and_fetch(new, new)
        return (
            ours._idx == theirs._idx == 5
            and ours.offset.tolist() == theirs.offset.tolist()
            and ours.left_padding.tolist() == theirs.left_padding.tolist()
            and all(bool(mx.array_equal(a, b)) for a, b in zip(ours_kv, theirs_kv, strict=True))
        )

    require(
        "BatchKVCache keeps `keys`, `values`, `offset`, `left_padding` and `_idx`, and merge([c]) holds "
        "c's keys and values up to its offset (batch_cache_over builds the same without a copy)",
        same_as_merge,
    )
    require(
        "PromptProcessingBatch merges its caches with the first cache's `merge` (a rebuilt history "
        "hands its arrays over through it)",
        lambda: ".merge([c[i] for c in caches])" in inspect.getsource(generate_module._merge_caches),
    )


class HistoryKVCache(KVCache):
    """A turn's full-attention layer rebuilt from pool blocks, with room after its history for the
    turn's new tokens.

    mlx-lm merges a prompt batch's caches into a `BatchKVCache` by copying each one, and the copy has
    no room, so the first chunk copies it all again to grow it. A lone prompt (the CPU prefills one
    at a time) hands its arrays to the batch cache instead: the history is copied once, out of the
    blocks, and the prefill writes into the room in place. The cache is empty after the hand-over.
    """

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        if len(caches) != 1 or caches[0].keys is None:
            return BatchKVCache.merge(caches)
        (cache,) = caches
        batch = batch_cache_over(cache)
        cache.keys = cache.values = None  # the batch cache's alone, so MLX may update it in place
        cache.offset = 0
        return batch
