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

from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_spec import ModelCacheSpec
from semantic.engine.cache_store.cache_tensors import StatePoint
from semantic.engine.mlx_adapter.api import ArraysCache, RotatingKVCache
from semantic.engine.mlx_adapter.kv_seams import HistoryKVCache, in_token_order


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
        dims = {dim for _, key_dim, value_dim in spec.kv_widths for dim in (key_dim, value_dim)}
        group_size = next((g for g in (64, 32) if all(dim % g == 0 for dim in dims)), None)
        if group_size is None:
            raise ValueError(f"idle KV quantization needs head dims divisible by 32, not {sorted(dims)}")
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
        # A block is a strided slice of the file's array, which MLX copies several times slower than
        # numpy makes it contiguous.
        block = mx.array(np.ascontiguousarray(array)).view(dtype)
        return block if self.bits is None else self._quantized(block)

    def _quantized(self, array: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(array, group_size=self.group_size, bits=self.bits))

    def num_tokens(self, held: Any) -> int:
        """How many tokens a held array covers (its third axis, which quantizing leaves alone)."""
        return int((held if self.bits is None else held[0]).shape[2])

    def decode(self, held: Any) -> mx.array:
        if self.bits is None:
            return held
        weights, scales, biases = held
        return mx.dequantize(weights, scales, biases, group_size=self.group_size, bits=self.bits)


def attention_kv_of(
    pool: BlockPool,
    spec: ModelCacheSpec,
    block_ids: list[int],
    codec: BlockCodec,
    num_tokens: int,
    room: int = 0,
    num_held: int | None = None,
    windows: tuple[tuple[Any, Any], ...] = (),
) -> list[tuple[mx.array, mx.array]]:
    """Each attention layer's keys and values for a sequence's first `num_tokens` tokens, from its
    blocks `block_ids` (holding `num_held` tokens, by default `num_tokens`): a full layer's over
    every block (up to the blocks' end) and `room` zeroed positions after them; a sliding layer's
    over the window before `num_tokens` only, from `windows` (a `StatePoint`'s, kept there) or else
    the blocks (`can_resume_at` says whether they hold it)."""
    payloads = [pool.payload(block_id) for block_id in block_ids]
    size, held = spec.block_size, num_tokens if num_held is None else num_held

    def joined(slot: int, part: int, first_block: int, last_block: int, pad: int) -> mx.array:
        arrays = [codec.decode(p[slot][part]) for p in payloads[first_block:last_block]]
        if pad:
            arrays.append(mx.zeros((*arrays[0].shape[:2], pad, arrays[0].shape[3]), dtype=arrays[0].dtype))
        return mx.concatenate(arrays, axis=2) if len(arrays) > 1 else arrays[0]

    layers = []
    last = spec.num_blocks_for(num_tokens)
    kept_windows = iter(windows)
    for slot, layer in enumerate(spec.attention_layer_ids):
        window = spec.layer_windows[layer]
        if window is None:
            layers.append((joined(slot, 0, 0, len(payloads), room), joined(slot, 1, 0, len(payloads), room)))
            continue
        if windows:
            layers.append(next(kept_windows))
            continue
        start = max(0, num_tokens - window)
        first = start // size
        begins = piece_start(codec, payloads[first][slot], first * size, min(size, held - first * size))
        cut = slice(start - begins, num_tokens - begins)
        keys, values = joined(slot, 0, first, last, 0), joined(slot, 1, first, last, 0)
        layers.append((keys[..., cut, :], values[..., cut, :]))
    return layers


def piece_start(codec: BlockCodec, piece: Any, block_start: int, block_length: int) -> int:
    """The first token a block's piece of a sliding layer holds: a piece is the end of its block
    (the window had passed the rest when the block was filed)."""
    return block_start + block_length - codec.num_tokens(piece[0])


def window_start(
    pool: BlockPool, codec: BlockCodec, spec: ModelCacheSpec, block_ids: list[int], slot: int, num_held: int
) -> int:
    """The first token from which on the blocks `block_ids` (holding `num_held` tokens) hold attention
    layer `slot` without a gap, to their end (`num_held` where the last holds none of it)."""
    size, start = spec.block_size, min(num_held, len(block_ids) * spec.block_size)
    for index in range(len(block_ids) - 1, -1, -1):
        piece = pool.payload(block_ids[index])[slot]
        if piece is None:
            break
        start = piece_start(codec, piece, index * size, min(size, num_held - index * size))
        if start > index * size:
            break
    return start


def can_resume_at(
    pool: BlockPool,
    codec: BlockCodec,
    spec: ModelCacheSpec,
    block_ids: list[int],
    num_tokens: int,
    num_held: int,
) -> bool:
    """Whether every sliding layer holds the window before `num_tokens` in `block_ids` (which hold
    `num_held` tokens)."""
    last = spec.num_blocks_for(num_tokens)
    for slot, layer in enumerate(spec.attention_layer_ids):
        window = spec.layer_windows[layer]
        if window is None or num_tokens == 0:
            continue
        if window_start(pool, codec, spec, block_ids[:last], slot, num_held) > max(0, num_tokens - window):
            return False
    return True


def layer_caches(
    spec: ModelCacheSpec,
    caches: list[Any],
    attention_kv: list[tuple[Any, Any]],
    num_tokens: int,
    state: StatePoint | None,
) -> list[Any]:
    """Fill `caches` (fresh mlx-lm per-layer caches) for a sequence's first `num_tokens` tokens:
    attention layers from `attention_kv` (`attention_kv_of`), recurrent ones from `state`."""
    for (keys, values), layer in zip(attention_kv, spec.attention_layer_ids, strict=True):
        window = spec.layer_windows[layer]
        if window is None:
            full = HistoryKVCache()
            full.state = (keys, values, num_tokens)
            caches[layer] = full
        else:
            sliding = RotatingKVCache(max_size=window)
            sliding.state = (keys, values, num_tokens, 0, window, int(keys.shape[2]))
            caches[layer] = sliding
    if spec.has_state_layers:
        assert state is not None and state.num_tokens == num_tokens, (
            "no state where the turn resumes: engine bug"
        )
        for arrays, layer in zip(state.layers, spec.state_layer_ids, strict=True):
            recurrent = caches[layer]
            assert isinstance(recurrent, ArraysCache), (
                "a state layer's cache is not an ArraysCache: engine bug"
            )
            recurrent.cache = list(arrays)
    return caches


def kv_run(cache: Any, num_tokens: int) -> tuple[mx.array, mx.array, int]:
    """A live attention layer's keys and values of the sequence's tokens [start, num_tokens), and
    start: every token for a full layer, those still in the window for a sliding one."""
    if isinstance(cache, RotatingKVCache):
        keys, values = in_token_order(cache)
        held = min(int(keys.shape[2]), cache.offset)
        assert cache.offset == num_tokens, "sliding cache and token list disagree: engine bug"
        return keys[..., -held:, :], values[..., -held:, :], num_tokens - held
    keys, values = cache.state[0], cache.state[1]
    assert keys.shape[2] >= num_tokens, "cache holds fewer tokens than its token list: engine bug"
    return keys[..., :num_tokens, :], values[..., :num_tokens, :], 0


def state_point_of(
    spec: ModelCacheSpec, caches: list[Any], num_tokens: int, with_windows: bool = False
) -> StatePoint | None:
    """The recurrent layers' state in a sequence's live caches and, `with_windows`, its sliding
    layers' windows before `num_tokens`, copied (so it keeps no batch array alive); None for a model
    with neither to keep."""
    windowed = with_windows and spec.has_sliding_layers
    if not spec.has_state_layers and not windowed:
        return None
    layers = tuple(tuple(mx.array(array) for array in caches[layer].cache) for layer in spec.state_layer_ids)
    windows: list[tuple[Any, Any]] = []
    for layer in spec.sliding_layer_ids if windowed else ():
        keys, values, _ = kv_run(caches[layer], num_tokens)
        held = min(int(keys.shape[2]), spec.layer_windows[layer] or 0)
        windows.append((mx.array(keys[..., -held:, :]), mx.array(values[..., -held:, :])))
    mx.eval(layers, windows)
    return StatePoint(num_tokens, layers, tuple(windows))


def block_payload(
    kv_runs: list[tuple[Any, Any, int]], start: int, length: int, encode: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """One block's keys and values for every attention layer, copied out of the sequence's arrays by
    `encode` (`BlockCodec.encode` for MLX arrays, `encode_host` for a file's): the part of the block
    each run (`kv_run`) holds, which for a sliding layer may be only its end, or none (None)."""
    end = start + length
    payload: list[Any] = []
    for keys, values, kv_start in kv_runs:
        if keys is None or kv_start >= end or end - kv_start > keys.shape[2]:
            payload.append(None)
            continue
        cut = slice(max(start, kv_start) - kv_start, end - kv_start)
        payload.append((encode(keys[..., cut, :]), encode(values[..., cut, :])))
    return tuple(payload)
