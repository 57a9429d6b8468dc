"""One agent's cache as a safetensors file: tokens, per-layer K/V, and metadata that proves it fits.

Conversion between MLX and numpy happens on the engine thread (`semantic.engine.cache_store.cache_tensors`);
reading and writing bytes happens in a worker thread (`write_cache_file`/`read_cache_file`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from semantic.engine.cache_store.cache_tensors import (
    SerializedCache,
    attention_tensor_name,
    state_tensor_name,
    tokens_digest,
)
from semantic.engine.model.loading import LoadedModel
from semantic.storage.cache_layout import layout_problem
from semantic.storage.disk_full import as_disk_full, os_error_in

# 3: attention layers by position among attention layers, a sliding layer's from the first token its
# blocks hold, and recurrent layers' state points. Files of 1 and 2 (full and sliding layers apart,
# a sliding layer's rotating buffer) are set aside: their agents start cold.
FORMAT_VERSION = "3"
READABLE_VERSIONS = ("3",)
# A file's `origin`: imported from an archive (its KV is another person's data, which serves only
# its agent until a turn computes the agent's cache afresh) or computed here.
IMPORTED, LOCAL = "imported", "local"


class CacheFileError(ValueError):
    """The file cannot be used: truncated, corrupt, or made for another model."""


class NewerCacheFileError(CacheFileError):
    """A file of a format newer than this release reads: set aside for that release, not misread
    (a caller that does not tell it apart quarantines it as any unusable file)."""


def is_newer_version(version: object, current: str) -> bool:
    """Whether a stated format version (a decimal string) is newer than `current`."""
    return isinstance(version, str) and version.isdigit() and int(version) > int(current)


@dataclass(slots=True)
class CacheIdentity:
    model_name: str
    fingerprint: str
    block_size: int
    spec: dict[str, Any]
    vocab_size: int = 0  # token ids read from disk must be below it (0: unchecked)
    layout: str = ""  # a rank's part of a model split over a group ("" for a single process)
    legacy_fingerprint: str = ""  # its agents folder's name before format 3 (conversations moved on)


def identity_of(loaded: LoadedModel) -> CacheIdentity:
    """What a cache file of `loaded` must state to be read back (its rank's part, in a group)."""
    return CacheIdentity(
        loaded.name,
        loaded.fingerprint,
        loaded.spec.block_size,
        loaded.spec.to_dict(),
        loaded.num_embedding_rows,
        loaded.layout.shard if loaded.layout is not None else "",
        loaded.legacy_fingerprint,
    )


def _checksum(tensors: dict[str, np.ndarray], format_version: str = FORMAT_VERSION) -> str:
    """A digest of every tensor, by name, to catch a file damaged on disk (not a signature).

    Version 2 files use XXH3-128 over the tensors' own memory, many times faster than the SHA-256
    over a copy of each that version 1 files used."""
    digest: Any = xxhash.xxh3_128() if format_version == "2" else hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tensors[name]).data.cast("B"))
    return str(digest.hexdigest())


TEMP_SUFFIX = ".tmp"
# safetensors' save_file (0.8.0) writes through a temp file of its own in its target's folder, named
# as the Rust tempfile crate names them: ".tmp" and six letters or digits. Ours land in our staging
# folders; this pattern is for those an older writer left in the agents' folder.
SAFETENSORS_TEMP_NAME = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def is_temp_name(name: str) -> bool:
    """A name only an interrupted write leaves: a staging folder (or, from older writers, a temp
    file) `.{name}.{pid}.tmp`, or safetensors' own `.tmpXXXXXX`."""
    return name.startswith(".") and (
        name.endswith(TEMP_SUFFIX) or SAFETENSORS_TEMP_NAME.fullmatch(name) is not None
    )


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` whole or not at all: into a staging folder beside it, fsync, rename over `path`,
    fsync the directory. The folder (`.{name}.{pid}.tmp`) is the only name a crash can leave, as the
    temp file a library makes next to its target lands inside it; a failed write removes it. A
    full disk raises DiskFullError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    staged = staging / path.name
    try:
        staging.mkdir(exist_ok=True)  # a crashed process of the same pid may have left it
        write(staged)
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(staged, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as error:
        disk_full = as_disk_full(error, path.name)
        if disk_full is error:
            raise
        raise disk_full from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_file(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the OS errors it reports as its own type raised as OSErrors."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:
        os_error = os_error_in(error, path.name)
        if os_error is None:
            raise
        raise os_error from error


def write_cache_file(path: Path, cache: SerializedCache, identity: CacheIdentity) -> tuple[int, str]:
    """Worker thread: write atomically (temp file, fsync, rename). Returns the file's size and the
    digest of the token ids it holds (its header states it too)."""
    # safetensors writes a strided array's underlying memory, not its elements: make each contiguous
    # (a no-op for the usual, contiguous ones) so the file holds what the checksum covers.
    tensors = {name: np.ascontiguousarray(tensor) for name, tensor in cache.tensors.items()}
    metadata = {
        "format_version": FORMAT_VERSION,
        "agent_id": cache.agent_id,
        "model_name": identity.model_name,
        "model_fingerprint": identity.fingerprint,
        "block_size": str(identity.block_size),
        "cache_spec": json.dumps(identity.spec, sort_keys=True),
        "kv_starts": json.dumps(cache.kv_starts or [0] * _num_attention_layers(identity.spec)),
        "state_points": json.dumps(cache.state_points),
        "num_tokens": str(cache.num_tokens),
        "tokens_digest": (digest := tokens_digest(tensors["tokens"])),
        "layout": identity.layout,
        "origin": IMPORTED if cache.imported else LOCAL,
        "checksum": _checksum(tensors),
    }
    replace_atomically(path, lambda staged: _save_file(tensors, staged, metadata))
    return path.stat().st_size, digest


def mark_imported(path: Path) -> None:
    """Rewrite a verified cache file with `origin` imported (its tensors, so its checksum, unchanged)."""
    metadata = {**read_metadata(path), "origin": IMPORTED}
    tensors = load_file(str(path))
    replace_atomically(path, lambda staged: _save_file(tensors, staged, metadata))


def read_stated_tokens(path: Path) -> tuple[int, str]:
    """The token count and tokens digest a cache file's header states ((0, "") if unreadable; "" for
    a file from before digests): for listings and for skipping rewrites, no tensors read. Unverified
    until the file is read: a wrong digest can only keep a file another cache's turn would replace,
    and a restored cache is reused only as far as its token ids match the prompt's."""
    try:
        metadata = read_metadata(path)
        digest = metadata.get("tokens_digest", "")
        return int(metadata.get("num_tokens", 0)), digest if isinstance(digest, str) else ""
    except (OSError, ValueError, struct.error, AttributeError):
        return 0, ""


MAX_HEADER_BYTES = 1 << 24


def read_metadata(path: Path) -> dict[str, Any]:
    """A cache file's header metadata, no tensors read and nothing checked; raises OSError,
    ValueError (json's too), struct.error or AttributeError on a file that is not safetensors."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {header_len} bytes")
        metadata = json.loads(f.read(header_len)).get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError("metadata is not a JSON object")
    return metadata


def read_cache_file(path: Path, identity: CacheIdentity, agent_id: str | None = None) -> SerializedCache:
    """Worker thread: read and verify; raises CacheFileError when the file must not be used."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as error:
        raise CacheFileError(f"unreadable cache file: {error}") from error
    try:
        return _verified(metadata, tensors, identity, agent_id)
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError, RecursionError) as error:  # metadata another writer made
        raise CacheFileError(f"bad metadata: {type(error).__name__}: {error}") from error


def _verified(
    metadata: dict[str, str], tensors: dict[str, np.ndarray], identity: CacheIdentity, agent_id: str | None
) -> SerializedCache:
    version = metadata.get("format_version")
    if is_newer_version(version, FORMAT_VERSION):
        raise NewerCacheFileError(f"format version {version!r}, newer than this release's {FORMAT_VERSION}")
    if version not in READABLE_VERSIONS:
        raise CacheFileError(f"format version {version!r}, expected one of {', '.join(READABLE_VERSIONS)}")
    if metadata.get("model_fingerprint") != identity.fingerprint:
        raise CacheFileError(
            f"written by model {metadata.get('model_name')!r} ({metadata.get('model_fingerprint')}), "
            f"not {identity.model_name!r} ({identity.fingerprint})"
        )
    if metadata.get("layout", "") != identity.layout:
        written_by, expected = (
            metadata.get("layout") or "a single process",
            identity.layout or "a single process",
        )
        raise CacheFileError(f"written by {written_by}, not {expected}")
    if json.loads(metadata.get("cache_spec", "null")) != identity.spec:
        raise CacheFileError("cache spec differs from the loaded model's")
    if metadata.get("checksum") != _checksum(tensors, version):
        raise CacheFileError("checksum mismatch: the file is corrupt")
    if agent_id is not None and metadata.get("agent_id") != agent_id:
        raise CacheFileError(f"written for agent {metadata.get('agent_id')!r}, not {agent_id!r}")
    tokens = tensors.get("tokens")
    num_tokens = int(metadata["num_tokens"])
    if tokens is None or tokens.ndim != 1 or len(tokens) != num_tokens:
        raise CacheFileError("token list missing or not as long as the metadata says")
    kv_starts = _kv_starts(json.loads(metadata["kv_starts"]), identity.spec, num_tokens)
    for slot, start in enumerate(kv_starts):
        for part in ("keys", "values"):
            tensor = tensors.get(attention_tensor_name(slot, part))
            if start == num_tokens and tensor is None:
                continue  # a sliding layer that holds nothing
            if tensor is None or tensor.ndim != 4 or tensor.shape[2] < num_tokens - start:
                raise CacheFileError(f"attention layer {slot} does not hold tokens {start} to {num_tokens}")
    state_points = _state_points(json.loads(metadata["state_points"]), tensors, num_tokens)
    if problem := layout_problem(tensors, identity.spec, kv_starts, num_tokens, state_points):
        raise CacheFileError(problem)
    if len(tokens) and (tokens.min() < 0 or (identity.vocab_size and tokens.max() >= identity.vocab_size)):
        raise CacheFileError(f"token ids outside the vocabulary (0..{identity.vocab_size - 1})")
    imported = metadata.get("origin") == IMPORTED
    return SerializedCache(metadata["agent_id"], tensors, kv_starts, num_tokens, state_points, imported)


def _num_attention_layers(spec: dict[str, Any]) -> int:
    return sum(kind != "state" for kind in spec.get("layer_kinds", []))


def _kv_starts(stated: object, spec: dict[str, Any], num_tokens: int) -> list[int]:
    """Per attention layer the first token it holds: 0 for a full layer, at most `num_tokens`."""
    kinds = [kind for kind in spec.get("layer_kinds", []) if kind != "state"]
    if not isinstance(stated, list) or len(stated) != len(kinds):
        raise CacheFileError(f"kv_starts is not a list of {len(kinds)} token positions")
    for start, kind in zip(stated, kinds, strict=True):
        if type(start) is not int or not 0 <= start <= num_tokens or (kind == "full" and start):
            raise CacheFileError(f"kv_starts holds {start!r} for a {kind} layer of {num_tokens} tokens")
    return stated


def _state_points(
    stated: object, tensors: dict[str, np.ndarray], num_tokens: int
) -> list[tuple[int, list[int]]]:
    """The state points a file states, each with its tensors present: [token count, arrays per layer]."""
    if not isinstance(stated, list):
        raise CacheFileError("state_points is not a list")
    points: list[tuple[int, list[int]]] = []
    for index, point in enumerate(stated):
        if (
            not isinstance(point, list)
            or len(point) != 2
            or type(point[0]) is not int
            or not 0 < point[0] <= num_tokens
            or not isinstance(point[1], list)
            or not all(type(count) is int and 0 <= count < 64 for count in point[1])
        ):
            raise CacheFileError(f"state point {index} is not [tokens, [arrays per layer]]")
        for layer, count in enumerate(point[1]):
            for array in range(count):
                if state_tensor_name(index, layer, array) not in tensors:
                    raise CacheFileError(f"state point {index} lacks its array {layer}.{array}")
        points.append((point[0], list(point[1])))
    return points
