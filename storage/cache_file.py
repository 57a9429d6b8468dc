"""One agent's cache as a safetensors file: tokens, per-layer K/V, and metadata that proves it fits.

Conversion between MLX and numpy happens on the engine thread (`to_tensors`/`from_tensors`);
reading and writing bytes happens in a worker thread (`write_cache_file`/`read_cache_file`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from semantic.engine.agent_cache import CacheSnapshot

FORMAT_VERSION = "1"
_STORAGE_VIEW = {2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32), 1: (mx.uint8, np.uint8)}


class CacheFileError(ValueError):
    """The file cannot be used: truncated, corrupt, or made for another model."""


@dataclass(slots=True)
class CacheIdentity:
    model_name: str
    fingerprint: str
    block_size: int
    spec: dict[str, Any]


@dataclass(slots=True)
class SerializedCache:
    agent_id: str
    tensors: dict[str, np.ndarray]
    sliding_meta: list[list[int]]
    num_tokens: int


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


def from_tensors(cache: SerializedCache, dtype: str, num_full: int, num_sliding: int) -> CacheSnapshot:
    """Engine thread: rebuild MLX arrays from a file's tensors."""
    mx_dtype = getattr(mx, dtype)
    tensors = cache.tensors
    full_layers: list[Any] = []
    for i in range(num_full):
        if f"full.{i}.keys" in tensors:
            full_layers.append(
                (
                    _from_numpy(tensors[f"full.{i}.keys"], mx_dtype),
                    _from_numpy(tensors[f"full.{i}.values"], mx_dtype),
                )
            )
        else:
            full_layers.append((None, None))
    sliding_layers = []
    for i in range(num_sliding):
        offset, keep, max_size, idx = cache.sliding_meta[i]
        keys = _from_numpy(tensors[f"sliding.{i}.keys"], mx_dtype)
        values = _from_numpy(tensors[f"sliding.{i}.values"], mx_dtype)
        sliding_layers.append((keys, values, offset, keep, max_size, idx))
    return CacheSnapshot(cache.agent_id, tensors["tokens"].tolist(), full_layers, sliding_layers)


def _checksum(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tensors[name]).tobytes())
    return digest.hexdigest()


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temp file, fsync it, rename it over `path`, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_cache_file(path: Path, cache: SerializedCache, identity: CacheIdentity) -> int:
    """Worker thread: write atomically (temp file, fsync, rename). Returns the file size."""
    metadata = {
        "format_version": FORMAT_VERSION,
        "agent_id": cache.agent_id,
        "model_name": identity.model_name,
        "model_fingerprint": identity.fingerprint,
        "block_size": str(identity.block_size),
        "cache_spec": json.dumps(identity.spec, sort_keys=True),
        "sliding_meta": json.dumps(cache.sliding_meta),
        "num_tokens": str(cache.num_tokens),
        "checksum": _checksum(cache.tensors),
    }
    replace_atomically(path, lambda tmp: save_file(cache.tensors, str(tmp), metadata=metadata))
    return path.stat().st_size


def read_cache_file(path: Path, identity: CacheIdentity) -> SerializedCache:
    """Worker thread: read and verify; raises CacheFileError when the file must not be used."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as error:
        raise CacheFileError(f"unreadable cache file: {error}") from error
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(f"format version {metadata.get('format_version')!r}, expected {FORMAT_VERSION}")
    if metadata.get("model_fingerprint") != identity.fingerprint:
        raise CacheFileError(
            f"written by model {metadata.get('model_name')!r} ({metadata.get('model_fingerprint')}), "
            f"not {identity.model_name!r} ({identity.fingerprint})"
        )
    if json.loads(metadata.get("cache_spec", "null")) != identity.spec:
        raise CacheFileError("cache spec differs from the loaded model's")
    if metadata.get("checksum") != _checksum(tensors):
        raise CacheFileError("checksum mismatch: the file is corrupt")
    return SerializedCache(
        metadata["agent_id"], tensors, json.loads(metadata["sliding_meta"]), int(metadata["num_tokens"])
    )
