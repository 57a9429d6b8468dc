"""Between mlx-lm's per-layer cache objects and the block pool's per-block keys and values.

The pool holds caches that no sequence is decoding from (a running sequence keeps its own, at full
precision, in the batch), so with `--idle-kv-bits` its blocks are kept quantized (`mx.quantize`,
per group of `group_size` values along the head dimension) and dequantized when a turn starts
from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from semantic.engine.block_pool import BlockPool
from semantic.engine.cache_spec import ModelCacheSpec
from semantic.engine.kv_seams import batch_cache_over


@dataclass(frozen=True, slots=True)
class BlockCodec:
    """How the pool holds a block's keys and values: as computed, or quantized to `bits`."""

    bits: int | None = None
    group_size: int = 64

    @classmethod
    def for_spec(cls, spec: ModelCacheSpec, bits: int | None) -> BlockCodec:
        if bits is None:
            return cls()
        if bits not in (4, 8):
            raise ValueError(f"idle KV bits must be 4 or 8, got {bits}")
        group_size = next((g for g in (64, 32) if spec.head_dim % g == 0), None)
        if group_size is None:
            raise ValueError(f"idle KV quantization needs a head dim divisible by 32, not {spec.head_dim}")
        return cls(bits, group_size)

    def bytes_per_block(self, spec: ModelCacheSpec) -> int:
        if self.bits is None:
            return spec.bytes_per_block
        values = spec.bytes_per_block // spec.dtype_size
        scales_and_biases = 2 * (values // self.group_size) * spec.dtype_size
        return values * self.bits // 8 + scales_and_biases

    def encode(self, array: mx.array) -> Any:
        if self.bits is None:
            # Always a copy (`mx.contiguous` of a contiguous slice is a view): a block must not keep
            # the batch's whole arrays alive, nor stop the batch from updating them in place.
            return mx.array(array)
        return self._quantized(array)

    def encode_host(self, array: np.ndarray, dtype: mx.Dtype) -> Any:
        """A block from a cache file's numpy array (bfloat16 travels as uint16): one copy, straight
        into the block, rather than into a whole-history array first and then into blocks."""
        # A block is a strided slice of the file's array: MLX copies one ~4x slower than numpy makes it
        # contiguous (0.7 vs 0.19 ms for 256 tokens of a SmolLM2 layer here).
        block = mx.array(np.ascontiguousarray(array)).view(dtype)
        return block if self.bits is None else self._quantized(block)

    def _quantized(self, array: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(array, group_size=self.group_size, bits=self.bits))

    def decode(self, held: Any) -> mx.array:
        if self.bits is None:
            return held
        weights, scales, biases = held
        return mx.dequantize(weights, scales, biases, group_size=self.group_size, bits=self.bits)


def full_layers_of(
    pool: BlockPool, spec: ModelCacheSpec, block_ids: list[int], codec: BlockCodec, room: int = 0
) -> list[tuple[mx.array, mx.array]]:
    """Each full-attention layer's keys and values over `block_ids`, concatenated in order, and
    `room` zeroed positions after them."""
    payloads = [pool.payload(block_id) for block_id in block_ids]

    def joined(slot: int, part: int) -> mx.array:
        arrays = [codec.decode(p[slot][part]) for p in payloads]
        if room:
            arrays.append(mx.zeros((*arrays[0].shape[:2], room, arrays[0].shape[3]), dtype=arrays[0].dtype))
        return mx.concatenate(arrays, axis=2)

    return [(joined(slot, 0), joined(slot, 1)) for slot in range(len(spec.full_layer_ids))]


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


def layer_caches(
    spec: ModelCacheSpec,
    caches: list[Any],
    full_layers: list[tuple[Any, Any]],
    num_tokens: int,
    sliding_states: list[Any],
    sliding_trim: int = 0,
) -> list[Any]:
    """Fill `caches` (fresh mlx-lm per-layer caches): full layers from keys and values, sliding
    ones from their states, trimmed by `sliding_trim` tokens."""
    for (keys, values), layer in zip(full_layers, spec.full_layer_ids, strict=True):
        full = HistoryKVCache()
        full.state = (keys, values, num_tokens)
        caches[layer] = full
    for state, layer in zip(sliding_states, spec.sliding_layer_ids, strict=True):
        sliding = RotatingKVCache(max_size=1)
        sliding.state = state
        if sliding_trim:
            sliding.trim(sliding_trim)
        caches[layer] = sliding
    return caches


def sliding_state(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """A sliding-window layer's state as its cache object gives it back (read from a file)."""
    sliding = RotatingKVCache(max_size=1)
    sliding.state = state
    return tuple(sliding.state)


def kv_of(cache: Any, num_tokens: int) -> tuple[mx.array, mx.array]:
    keys, values = cache.state[0], cache.state[1]
    assert keys.shape[2] >= num_tokens, "cache holds fewer tokens than its token list: engine bug"
    return keys[..., :num_tokens, :], values[..., :num_tokens, :]


def block_payload(
    full_kv: list[tuple[Any, Any]], start: int, length: int, encode: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """One block's keys and values for every full-attention layer, copied out of the sequence's
    arrays by `encode` (`BlockCodec.encode` for MLX arrays, `encode_host` for a file's)."""
    end = start + length
    return tuple((encode(k[..., start:end, :]), encode(v[..., start:end, :])) for k, v in full_kv)


def rotating_can_trim(state: tuple[Any, ...], num_tokens: int) -> bool:
    cache = RotatingKVCache(max_size=1)
    cache.state = state
    return num_tokens == 0 or cache.is_trimmable()
