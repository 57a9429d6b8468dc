"""One agent as a portable archive: a tar holding `manifest.json` (the agent's id, its model's
fingerprint, each file's size and sha256) and then its cache and conversation files.

An archive comes from outside, so `import_archive` trusts nothing in it: a bounded number and size
of members, each a regular file (not sparse, no link or device, no larger than the archive) named
exactly as the manifest's agent would name it (no paths), the manifest's id through AgentId, every
file's sha256, and every file through the checks the server reads it with (a cache's tensors against
its model's layout among them), all in a staging folder before any file takes its place.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import IO

import msgspec

from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import CONVERSATION_SUFFIX, SUFFIX
from semantic.storage.cache_dir_files import AgentFiles, check_cache_file
from semantic.storage.cache_file import TEMP_SUFFIX, mark_imported, read_metadata, replace_atomically
from semantic.storage.conversation_file import read_conversation

ARCHIVE_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 16
MAX_CONVERSATION_BYTES = 1 << 28  # 256 MiB: tens of millions of token ids
MAX_CACHE_BYTES = 1 << 38  # 256 GiB: beyond any model's cache this machine could hold
FINGERPRINT = re.compile(r"[0-9a-f]{16,128}")
COPY_CHUNK_BYTES = 1 << 20


class ArchiveError(ValueError):
    """The archive cannot be imported: malformed, damaged, or not what its manifest says."""


class ArchivedFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    num_bytes: int
    sha256: str


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    archive_version: int
    agent_id: str
    model_fingerprint: str  # the full one where the cache file states it, else its folder's 16 digits
    model_name: str
    files: list[ArchivedFile]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def export_archive(files: AgentFiles, out: Path) -> Manifest:
    """Write `out` atomically: the manifest, then the agent's files (read while no server writes)."""
    header = files.header()
    manifest = Manifest(
        ARCHIVE_VERSION,
        str(files.agent_id),
        str(header.get("model_fingerprint") or files.folder.name),
        str(header.get("model_name", "")),
        [ArchivedFile(p.name, p.stat().st_size, _sha256(p)) for p in files.paths],
    )
    data = msgspec.json.encode(manifest)

    def write(staged: Path) -> None:
        with tarfile.open(staged, "w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(MANIFEST_NAME)
            info.size = len(data)
            tar.addfile(info, _BytesReader(data))
            for path in files.paths:
                tar.add(path, arcname=path.name, recursive=False)

    replace_atomically(out, write)
    return manifest


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else self._at + size
        chunk, self._at = self._data[self._at : end], min(end, len(self._data))
        return chunk


def read_manifest(tar: tarfile.TarFile) -> tuple[Manifest, AgentId]:
    first = tar.next()
    if first is None or first.name != MANIFEST_NAME or not first.isreg() or first.size > MAX_MANIFEST_BYTES:
        raise ArchiveError(
            f"the archive does not start with a {MANIFEST_NAME} of at most {MAX_MANIFEST_BYTES} bytes"
        )
    reader = tar.extractfile(first)
    assert reader is not None, "a regular member without a reader: tarfile bug"
    try:
        manifest = msgspec.json.decode(reader.read(), type=Manifest)
        agent_id = AgentId(manifest.agent_id)
    except (msgspec.DecodeError, ValueError) as error:
        raise ArchiveError(f"bad manifest: {error}") from error
    if manifest.archive_version != ARCHIVE_VERSION:
        raise ArchiveError(
            f"archive version {manifest.archive_version}, this release reads {ARCHIVE_VERSION}"
        )
    if not FINGERPRINT.fullmatch(manifest.model_fingerprint):
        raise ArchiveError(f"model fingerprint {manifest.model_fingerprint!r} is not hex digits")
    names = [f.name for f in manifest.files]
    allowed = {f"{agent_id}{SUFFIX}", f"{agent_id}{CONVERSATION_SUFFIX}"}
    if not names or len(set(names)) != len(names) or not set(names) <= allowed:
        raise ArchiveError(f"the manifest lists {names}, not the files of agent {agent_id}")
    return manifest, agent_id


def import_archive(archive: Path, cache_dir: Path, force: bool = False) -> tuple[Manifest, Path]:
    """Check `archive` and place its files in its model's folder under `cache_dir` (while no
    server runs there); refuses an agent that has files there unless `force`. The folder."""
    try:
        with tarfile.open(archive, "r:") as tar:  # uncompressed only: no decompression bomb
            manifest, agent_id = read_manifest(tar)
            folder = cache_dir / "agents" / manifest.model_fingerprint[:16]
            existing = [
                p.name
                for p in (folder / f"{agent_id}{SUFFIX}", folder / f"{agent_id}{CONVERSATION_SUFFIX}")
                if p.exists()
            ]
            if existing and not force:
                raise ArchiveError(
                    f"agent {agent_id} already has {', '.join(existing)} in {folder}; --force replaces them"
                )
            staging = folder / f".import-{agent_id}.{os.getpid()}{TEMP_SUFFIX}"
            staging.mkdir(parents=True, exist_ok=True)
            try:
                _stage(tar, manifest, staging, archive.stat().st_size)
                _check_staged(staging, manifest, agent_id, folder.name)
                archived = {f.name for f in manifest.files}
                for name in (f"{agent_id}{SUFFIX}", f"{agent_id}{CONVERSATION_SUFFIX}"):
                    if name not in archived:
                        continue
                    replace_atomically(folder / name, functools.partial(os.replace, staging / name))
                for name in existing:
                    if name not in archived:
                        (folder / name).unlink()  # forced: what the archive lacks must not stay behind
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except (tarfile.TarError, EOFError) as error:
        raise ArchiveError(f"not a readable tar archive: {error}") from error
    return manifest, folder


def _stage(tar: tarfile.TarFile, manifest: Manifest, staging: Path, archive_bytes: int) -> None:
    expected = {f.name: f for f in manifest.files}
    seen: set[str] = set()
    for index, member in enumerate(tar):
        if index == 0:
            continue  # the manifest, read already
        entry = expected.get(member.name)
        if entry is None or member.name in seen:
            raise ArchiveError(f"member {member.name!r} is not one of the manifest's files (or comes twice)")
        _check_member(member, entry, archive_bytes)
        reader = tar.extractfile(member)
        assert reader is not None, "a regular member without a reader: tarfile bug"
        if _copy_hashed(reader, staging / member.name, member.size) != entry.sha256:
            raise ArchiveError(f"{member.name}: sha256 differs from the manifest's: the archive is damaged")
        seen.add(member.name)
    if missing := set(expected) - seen:
        raise ArchiveError(f"the archive lacks {', '.join(sorted(missing))}")


def _check_member(member: tarfile.TarInfo, entry: ArchivedFile, archive_bytes: int) -> None:
    """Refuse, before a byte is written, a member that would land as more than the archive holds:
    a sparse file (its holes expand), anything but a regular file, a size the manifest does not state."""
    if member.issparse():
        raise ArchiveError(f"member {member.name!r} is a sparse file of {member.size} bytes: not imported")
    if not member.isreg():
        raise ArchiveError(f"member {member.name!r} is not a regular file (tar type {member.type!r})")
    limit = MAX_CACHE_BYTES if member.name.endswith(SUFFIX) else MAX_CONVERSATION_BYTES
    if member.size != entry.num_bytes or member.size > limit:
        raise ArchiveError(
            f"{member.name}: {member.size} bytes, the manifest says {entry.num_bytes} (at most {limit})"
        )
    if member.size > archive_bytes:  # a regular member's bytes lie in the archive itself
        raise ArchiveError(f"{member.name}: {member.size} bytes, more than the archive's {archive_bytes}")


def _copy_hashed(reader: IO[bytes], path: Path, num_bytes: int) -> str:
    digest, num_copied = hashlib.sha256(), 0
    with open(path, "wb") as out:
        while chunk := reader.read(COPY_CHUNK_BYTES):
            num_copied += len(chunk)
            if num_copied > num_bytes:
                raise ArchiveError(f"{path.name} holds more than its {num_bytes} bytes")
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _check_staged(staging: Path, manifest: Manifest, agent_id: AgentId, folder_name: str) -> None:
    """The checks the server reads these files with (checksum, layout, agent, token ids)."""
    cache = staging / f"{agent_id}{SUFFIX}"
    try:
        if cache.exists():
            check_cache_file(cache, agent_id, folder_name)
            if read_metadata(cache).get("model_fingerprint") != manifest.model_fingerprint:
                raise ValueError("its cache file names another model than the manifest")
            mark_imported(cache)  # its blocks serve only this agent (engine/cache_store/agent_cache.py)
        conversation = staging / f"{agent_id}{CONVERSATION_SUFFIX}"
        if conversation.exists():
            read_conversation(conversation)
    except ValueError as error:  # CacheFileError and ConversationFileError among them
        raise ArchiveError(f"{error}") from error
