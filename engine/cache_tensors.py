"""An agent's cache outside the pool (snapshots) and as numpy arrays: what crosses from the engine
thread to the disk writers.

Both directions run on the engine thread, which owns every MLX array; the numpy side is plain
memory that a worker thread may read and write.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

# numpy has no bfloat16: arrays travel as unsigned integers of the same width and are viewed back.
_STORAGE_VIEW = {2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32), 1: (mx.uint8, np.uint8)}


# None for an agent with no tokens yet.
LayerKV = tuple[mx.array | None, mx.array | None]


@dataclass(slots=True)
class CacheSnapshot:
    """An agent's whole cache outside the pool: what persistence writes and reads."""

    agent_id: str
    token_ids: list[int]
    full_layers: list[LayerKV]
    sliding_layers: list[tuple[Any, ...]]


@dataclass(slots=True)
class HostSnapshot:
    """An agent's cache as read from its file: full layers as numpy arrays (bfloat16 as uint16), of
    `dtype` once in MLX; sliding-window states already MLX arrays."""

    agent_id: str
    token_ids: list[int]
    full_layers: list[tuple[np.ndarray | None, np.ndarray | None]]
    sliding_layers: list[tuple[Any, ...]]
    dtype: mx.Dtype


@dataclass(slots=True)
class SerializedCache:
    agent_id: str
    tensors: dict[str, np.ndarray]
    sliding_meta: list[list[int]]
    num_tokens: int


def tokens_digest(tokens: list[int] | np.ndarray) -> str:
    """What identifies a cache's content: the token ids it holds (the same ids, the same cache)."""
    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()


def _to_numpy(array: mx.array) -> np.ndarray:
    mx_view, _ = _STORAGE_VIEW[array.dtype.size]
    return np.array(array.view(mx_view), copy=False)


def _from_numpy(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(array).view(dtype)


def to_tensors(snapshot: CacheSnapshot) -> SerializedCache:
    """Engine thread: evaluate and copy a snapshot into numpy arrays."""
    arrays: dict[str, mx.array] = {"tokens": mx.array(snapshot.token_ids, dtype=mx.int32)}
    for i, (keys, values) in enumerate(snapshot.full_layers):
        if keys is not None and values is not None:
            arrays[f"full.{i}.keys"], arrays[f"full.{i}.values"] = keys, values
    sliding_meta = []
    for i, state in enumerate(snapshot.sliding_layers):
        keys, values, offset, keep, max_size, idx = state
        arrays[f"sliding.{i}.keys"], arrays[f"sliding.{i}.values"] = keys, values
        sliding_meta.append([int(offset), int(keep), int(max_size), int(idx)])
    mx.eval(list(arrays.values()))
    tensors = {name: _to_numpy(array) for name, array in arrays.items()}
    tensors["tokens"] = np.array(snapshot.token_ids, dtype=np.int32)
    return SerializedCache(snapshot.agent_id, tensors, sliding_meta, len(snapshot.token_ids))


def from_tensors(cache: SerializedCache, dtype: str, num_full: int, num_sliding: int) -> HostSnapshot:
    """Engine thread: a file's tensors as a snapshot to restore. Full layers stay numpy arrays: the
    pool copies each block out of them once (`BlockCodec.encode_host`)."""
    mx_dtype = getattr(mx, dtype)
    tensors = cache.tensors
    full_layers: list[tuple[np.ndarray | None, np.ndarray | None]] = [
        (tensors.get(f"full.{i}.keys"), tensors.get(f"full.{i}.values")) for i in range(num_full)
    ]
    sliding_layers = []
    for i in range(num_sliding):
        offset, keep, max_size, idx = cache.sliding_meta[i]
        keys = _from_numpy(tensors[f"sliding.{i}.keys"], mx_dtype)
        values = _from_numpy(tensors[f"sliding.{i}.values"], mx_dtype)
        sliding_layers.append((keys, values, offset, keep, max_size, idx))
    return HostSnapshot(cache.agent_id, tensors["tokens"].tolist(), full_layers, sliding_layers, mx_dtype)
