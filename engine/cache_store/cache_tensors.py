"""An agent's cache outside the pool (snapshots) and as numpy arrays: what crosses from the engine
thread to the disk writers.

A snapshot holds, per attention layer, keys and values over the tokens it keeps (every token for a
full layer; for a sliding one, the run of tokens its blocks still hold, which ends where the
agent's tokens end), and the recurrent layers' states at the points a turn can resume from.

Both directions run on the engine thread, which owns every MLX array; the numpy side is plain
memory that a worker thread may read and write.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from semantic.engine.cache_store.cache_spec import ModelCacheSpec

# numpy has no bfloat16: arrays travel as unsigned integers of the same width and are viewed back.
_STORAGE_VIEW = {2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32), 1: (mx.uint8, np.uint8)}


# None for an agent with no tokens yet (or a sliding layer with none held).
LayerKV = tuple[mx.array | None, mx.array | None]


@dataclass(slots=True)
class StatePoint:
    """What resuming after a sequence's first `num_tokens` tokens takes beside its blocks: per STATE
    layer, the arrays of its `ArraysCache`, and (an agent's own points) per sliding layer, the keys
    and values of the window before it (`windows`, in `ModelCacheSpec.window_slots` order; () where
    the blocks are to hold them). A turn whose prompt starts with those tokens resumes from it."""

    num_tokens: int
    layers: tuple[tuple[Any, ...], ...]
    windows: tuple[tuple[Any, Any], ...] = ()

    @property
    def nbytes(self) -> int:
        arrays = [array for layer in self.layers for array in layer]
        arrays += [array for window in self.windows for array in window]
        return sum(int(array.nbytes) for array in arrays)


@dataclass(slots=True)
class CacheSnapshot:
    """An agent's whole cache outside the pool: what persistence writes and reads."""

    agent_id: str
    token_ids: list[int]
    attention_layers: list[LayerKV]  # per attention layer, keys and values of tokens [start, end)
    kv_starts: list[int]  # per attention layer, the first token it holds
    state_points: list[StatePoint]
    imported: bool = False  # from another server's archive: its blocks serve only its agent


@dataclass(slots=True)
class HostSnapshot:
    """An agent's cache as read from its file: attention layers as numpy arrays (bfloat16 as uint16),
    of `dtype` once in MLX; states already MLX arrays."""

    agent_id: str
    token_ids: list[int]
    attention_layers: list[tuple[np.ndarray | None, np.ndarray | None]]
    kv_starts: list[int]
    state_points: list[StatePoint]
    dtype: mx.Dtype
    imported: bool = False


@dataclass(slots=True)
class SerializedCache:
    agent_id: str
    tensors: dict[str, np.ndarray]
    kv_starts: list[int]  # per attention layer, the first token its tensors hold ([]: all from 0)
    num_tokens: int
    # Per state point: its token count and, per STATE layer, how many arrays it has.
    state_points: list[tuple[int, list[int]]] = field(default_factory=list)
    imported: bool = False  # written as the file's `origin`


def tokens_digest(tokens: list[int] | np.ndarray) -> str:
    """What identifies a cache's content: the token ids it holds (the same ids, the same cache)."""
    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()


def attention_tensor_name(slot: int, part: str) -> str:
    return f"attn.{slot}.{part}"


def state_tensor_name(point: int, layer: int, index: int) -> str:
    return f"state.{point}.{layer}.{index}"


def window_tensor_name(point: int, window: int, part: str) -> str:
    """A state point's keys or values of its `window`-th sliding layer."""
    return f"window.{point}.{window}.{part}"


def stored_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy type a file holds arrays of the MLX dtype named `dtype` as; ValueError for a name
    that is not one of MLX's dtypes of a width a file holds."""
    mx_dtype = getattr(mx, dtype, None) if dtype.isidentifier() else None
    view = _STORAGE_VIEW.get(mx_dtype.size) if isinstance(mx_dtype, mx.Dtype) else None
    if view is None:
        raise ValueError(f"{dtype!r} is not a dtype a cache file holds")
    return np.dtype(view[1])


def _to_numpy(array: mx.array) -> np.ndarray:
    mx_view, _ = _STORAGE_VIEW[array.dtype.size]
    return np.array(array.view(mx_view), copy=False)


def _from_numpy(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(array).view(dtype)


def to_tensors(snapshot: CacheSnapshot) -> SerializedCache:
    """Engine thread: evaluate and copy a snapshot into numpy arrays."""
    arrays: dict[str, mx.array] = {}
    for slot, (keys, values) in enumerate(snapshot.attention_layers):
        if keys is not None and values is not None:
            arrays[attention_tensor_name(slot, "keys")] = keys
            arrays[attention_tensor_name(slot, "values")] = values
    points = []
    for p, point in enumerate(snapshot.state_points):
        for layer, state in enumerate(point.layers):
            for index, array in enumerate(state):
                arrays[state_tensor_name(p, layer, index)] = array
        for window, (keys, values) in enumerate(point.windows):
            arrays[window_tensor_name(p, window, "keys")] = keys
            arrays[window_tensor_name(p, window, "values")] = values
        points.append((point.num_tokens, [len(state) for state in point.layers]))
    mx.eval(list(arrays.values()))
    tensors = {name: _to_numpy(array) for name, array in arrays.items()}
    tensors["tokens"] = np.array(snapshot.token_ids, dtype=np.int32)
    return SerializedCache(
        snapshot.agent_id,
        tensors,
        list(snapshot.kv_starts),
        len(snapshot.token_ids),
        points,
        snapshot.imported,
    )


def from_tensors(cache: SerializedCache, spec: ModelCacheSpec) -> HostSnapshot:
    """Engine thread: a file's tensors as a snapshot to restore. Attention layers stay numpy arrays:
    the pool copies each block out of them once (`BlockCodec.encode_host`). Raises ValueError where
    the file's states do not have the model's shapes."""
    tensors = cache.tensors
    attention: list[tuple[np.ndarray | None, np.ndarray | None]] = []
    for slot, (heads, key_dim, value_dim) in enumerate(spec.kv_widths):
        keys, values = (
            tensors.get(attention_tensor_name(slot, "keys")),
            tensors.get(attention_tensor_name(slot, "values")),
        )
        for name, array, width in (("keys", keys, key_dim), ("values", values, value_dim)):
            if array is not None and (array.shape[1], array.shape[3]) != (heads, width):
                raise ValueError(
                    f"attention layer {slot}'s {name} have {array.shape[1]} heads of {array.shape[3]}, "
                    f"the model {heads} of {width}"
                )
        attention.append((keys, values))
    num_attention = len(attention)
    points = []
    for p, (num_tokens, counts) in enumerate(cache.state_points):
        if counts != [len(layer) for layer in spec.state_arrays]:
            raise ValueError(f"state point {p} does not have the model's recurrent layers")
        layers = []
        for layer, arrays in enumerate(spec.state_arrays):
            state = []
            for index, (shape, dtype) in enumerate(arrays):
                array = tensors[state_tensor_name(p, layer, index)]
                if tuple(array.shape) != shape:
                    raise ValueError(f"state {p}.{layer}.{index} has shape {array.shape}, the model {shape}")
                state.append(_from_numpy(array, getattr(mx, dtype)))
            layers.append(tuple(state))
        points.append(StatePoint(num_tokens, tuple(layers), _windows_of(tensors, p, spec)))
    return HostSnapshot(
        cache.agent_id,
        tensors["tokens"].tolist(),
        attention,
        list(cache.kv_starts) or [0] * num_attention,
        points,
        getattr(mx, spec.dtype),
        cache.imported,
    )


def _windows_of(
    tensors: dict[str, np.ndarray], point: int, spec: ModelCacheSpec
) -> tuple[tuple[Any, Any], ...]:
    """A state point's sliding windows, where the file holds every one (() otherwise: the point then
    needs the blocks to hold them). The layout check has bounded their shapes."""
    dtype = getattr(mx, spec.dtype)
    windows = []
    for window in range(len(spec.window_slots)):
        keys = tensors.get(window_tensor_name(point, window, "keys"))
        values = tensors.get(window_tensor_name(point, window, "values"))
        if keys is None or values is None:
            return ()
        windows.append((_from_numpy(keys, dtype), _from_numpy(values, dtype)))
    return tuple(windows)
