"""Digests of weight files over every byte, kept on disk against each file's identity, so that a
restart knows which weights it loaded without reading gigabytes again.

The digests file is ours but trusted no further than it checks: unreadable, of another shape or
another version, it counts as empty, and an entry is used only while its file's stamp is unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from time import time_ns

import msgspec
import xxhash
from loguru import logger

DIGESTS_VERSION = 1
CHUNK_BYTES = 8 << 20  # read and hashed a chunk at a time: memory stays flat for any file size
MAX_DIGESTS_FILE_BYTES = 1 << 24  # far past any real one; a larger file is not ours
# HFS+ stamps whole seconds and FAT two: a file rewritten within its stamp's granule after it was
# hashed keeps its stamp, so only stamps older than this when hashing began are kept (as git does).
RACY_WINDOW_NS = 3 * 10**9


class FileStamp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What changes when a file's bytes do (ctime too: `touch -r` and `cp -p` can set mtime back)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        stat = path.stat()
        return cls(stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)

    @property
    def changed_ns(self) -> int:
        return max(self.mtime_ns, self.ctime_ns)


class KnownDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    stamp: FileStamp
    digest: str


class DigestsFile(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    path_to_digest: dict[str, KnownDigest]


_decode_digests = msgspec.json.Decoder(DigestsFile).decode
_encode_digests = msgspec.json.Encoder().encode


def file_digest(path: Path) -> str:
    """XXH3-128 of every byte of `path`."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while num_read := f.readinto(buffer):
            digest.update(view[:num_read])
    return str(digest.hexdigest())


def digests_of(files: Sequence[Path], digests_path: Path | None = None) -> list[str]:
    """Each file's digest over every byte. A file the digests file knows with the same stamp (its
    resolved path, size, mtime, ctime and inode) is not read; what is learned is written back."""
    known = read_digests(digests_path) if digests_path is not None else {}
    learned: dict[str, KnownDigest] = {}
    digests = []
    for path in files:
        key, stamp = str(path.resolve()), FileStamp.of(path)
        entry = known.get(key)
        if entry is not None and entry.stamp == stamp:
            digests.append(entry.digest)
            continue
        started_ns = time_ns()
        digests.append(file_digest(path))
        # a file written while it was read, or too recently to trust its stamp, is read again next time
        if FileStamp.of(path) == stamp and started_ns - stamp.changed_ns > RACY_WINDOW_NS:
            learned[key] = KnownDigest(stamp, digests[-1])
    if digests_path is not None and learned:
        write_digests(digests_path, {**_still_current(known), **learned})
    return digests


def read_digests(path: Path) -> dict[str, KnownDigest]:
    """The digests file's entries; empty where it is missing, unreadable or not ours."""
    try:
        if path.stat().st_size > MAX_DIGESTS_FILE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes")
        digests = _decode_digests(path.read_bytes())
        if digests.version != DIGESTS_VERSION:
            raise ValueError(f"version {digests.version}, expected {DIGESTS_VERSION}")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:  # msgspec's DecodeError and ValidationError are ValueErrors
        logger.warning("ignoring the weight digests in {} ({}): weights are read again", path, error)
        return {}
    return digests.path_to_digest


def write_digests(path: Path, path_to_digest: dict[str, KnownDigest]) -> None:
    """Replace the digests file whole (temp file, rename); a failure is logged and costs only a
    read of the weights next time."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(staging, "wb") as f:
            f.write(_encode_digests(DigestsFile(DIGESTS_VERSION, path_to_digest)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)
    except OSError as error:
        logger.warning("could not keep the weight digests in {}: {}", path, error)
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)


def _still_current(known: dict[str, KnownDigest]) -> dict[str, KnownDigest]:
    """Entries whose files are still there unchanged: the file does not grow with every model tried."""
    current = {}
    for key, entry in known.items():
        try:
            if FileStamp.of(Path(key)) == entry.stamp:
                current[key] = entry
        except OSError:
            pass
    return current
