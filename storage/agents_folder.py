"""A model's folder of agents' files: what it holds, read at start, and the file operations the
persistence actor's worker thread runs on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from semantic.engine.cache_store.cache_tensors import SerializedCache, tokens_digest
from semantic.storage.agent_id import AgentId, InvalidAgentIdError
from semantic.storage.cache_file import CacheIdentity, is_temp_name, read_cache_file, read_stated_tokens
from semantic.storage.disk_budget import CacheFileUse

SUFFIX = ".safetensors"
CONVERSATION_SUFFIX = ".conversation.json"
MAX_QUARANTINED = 64  # files kept in quarantine/, newest first


@dataclass(slots=True)
class DiskEntry:
    """What the agents' folder holds for one agent."""

    num_cached_tokens: int = 0  # 0 when there is no cache file
    has_cache: bool = False
    has_conversation: bool = False
    tokens_digest: str = ""  # of the token ids its cache file holds ("" when unknown or none)

    def holds_cache(self, num_tokens: int, digest: str) -> None:
        self.has_cache, self.num_cached_tokens, self.tokens_digest = True, num_tokens, digest

    def lose_cache(self) -> None:
        self.has_cache, self.num_cached_tokens, self.tokens_digest = False, 0, ""


def adopt_conversations(legacy_dir: Path, agents_dir: Path) -> int:
    """Worker thread, at start: move the conversation records a release before format 3 kept in the
    folder it named by its weaker fingerprint into this model's folder, once (where that folder does
    not exist yet), so no agent of the direct API is lost. Its cache files stay behind, unread: made
    in format 2 and under a fingerprint that could not tell apart weights that differ mid-file."""
    if os.path.lexists(agents_dir) or not is_real_dir(legacy_dir):
        return 0
    agents_dir.mkdir(parents=True, exist_ok=True)
    moved = 0
    for path in legacy_dir.iterdir():
        if path.name.endswith(CONVERSATION_SUFFIX) and not is_temp_name(path.name) and not path.is_symlink():
            os.replace(path, agents_dir / path.name)
            moved += 1
    if moved:
        logger.info(
            "moved {} conversation records from {} (named by the fingerprint before format 3) to {}; "
            "the cache files left there are not read",
            moved,
            legacy_dir,
            agents_dir,
        )
    return moved


def agent_file_named(name: str) -> tuple[AgentId, bool] | None:
    """The agent a file in an agents folder belongs to, and whether it is its cache (else its
    conversation); None for any other name (a temp file, a name no agent id can spell)."""
    if is_temp_name(name):
        return None
    for suffix, is_cache in ((SUFFIX, True), (CONVERSATION_SUFFIX, False)):
        if name.endswith(suffix):
            try:
                return AgentId(name.removesuffix(suffix)), is_cache
            except InvalidAgentIdError:
                return None
    return None


def scan_folder(agents_dir: Path) -> tuple[dict[AgentId, DiskEntry], dict[AgentId, CacheFileUse]]:
    """Worker thread, at start: index the folder (and its cache files' sizes and last uses) and
    remove the temp files and staging folders a crash left behind, which the disk budget counts
    only while their write runs. A link is never followed: one with a temp name is removed as a
    link, any other passed by."""
    index: dict[AgentId, DiskEntry] = {}
    uses: dict[AgentId, CacheFileUse] = {}
    if not is_real_dir(agents_dir):
        return index, uses
    num_freed_bytes, num_removed = 0, 0
    for path in agents_dir.iterdir():
        name = path.name
        if is_temp_name(name):
            num_freed_bytes += remove_temp(path)
            num_removed += 1
            continue
        named = agent_file_named(name)
        if named is None:
            continue
        if path.is_symlink():
            logger.warning("skipping {}: a symbolic link, not followed", path)
            continue
        agent_id, is_cache = named
        entry = index.setdefault(agent_id, DiskEntry())
        if is_cache:
            entry.holds_cache(*read_stated_tokens(path))
            stat = path.stat()
            uses[agent_id] = CacheFileUse(stat.st_size, stat.st_mtime)
        else:
            entry.has_conversation = True
    if num_removed:
        logger.info(
            "removed {} temp files left by interrupted writes: {:.1f} MiB freed",
            num_removed,
            num_freed_bytes / 2**20,
        )
    return index, uses


def remove_temp(path: Path) -> int:
    """Remove what an interrupted write left (a staging folder and the files in it, or a file);
    the bytes it held on the disk (safetensors sizes its temp file in full before it writes)."""
    if path.is_symlink() or not path.is_dir():
        num_bytes = path.lstat().st_blocks * 512
        path.unlink(missing_ok=True)
        return num_bytes
    num_bytes = sum(inner.lstat().st_blocks * 512 for inner in path.iterdir())
    shutil.rmtree(path, ignore_errors=True)
    return num_bytes


def is_real_dir(path: Path) -> bool:
    """A folder itself, not a link to one: nothing here goes through a link out of the cache dir."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def own_folder(folder: Path) -> None:
    """Make `folder` a folder of its own before moving files into it: a link in its place is
    removed as a link (what it points at stays as it was), so nothing lands outside the cache dir."""
    if folder.is_symlink():
        logger.warning("replacing the link {} with a folder: semantic never writes through links", folder)
        folder.unlink()
    folder.mkdir(parents=True, exist_ok=True)


def ignores_case(folder: Path) -> bool:
    """Whether the file system under `folder` (created if missing) takes names differing only in
    case for one name, as macOS's and Windows' do by default: agent ids `Bob` and `bob` would then
    share files."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".Case-Probe-{os.getpid()}-{time.time_ns()}.tmp"
    probe.touch()
    try:
        return (folder / probe.name.lower()).exists()
    finally:
        probe.unlink(missing_ok=True)


class AgentIdCollisionError(ValueError):
    """On a disk that ignores case, an agent id that differs only in case from one with files."""


def case_twin(
    agent_id: AgentId, ids_with_files: Iterable[AgentId], disk_ignores_case: bool
) -> AgentId | None:
    """On a disk that ignores case, the agent with files whose id differs from `agent_id` only in
    case (its files are `agent_id`'s files there)."""
    if not disk_ignores_case:
        return None
    folded = agent_id.casefold()
    return next((other for other in ids_with_files if other != agent_id and other.casefold() == folded), None)


def refuse_case_twin(agent_id: AgentId, ids_with_files: Iterable[AgentId], disk_ignores_case: bool) -> None:
    other = case_twin(agent_id, ids_with_files, disk_ignores_case)
    if other is not None:
        raise AgentIdCollisionError(
            f"agent id {agent_id.local_id!r} names the same files as agent {other.local_id!r} on this "
            "server's disk, which ignores case; use another id"
        )


def read_and_touch(path: Path, identity: CacheIdentity, agent_id: str) -> tuple[SerializedCache, str]:
    """Read an agent's cache file and mark it used now (its mtime), so that its recency survives a
    restart of the disk budget's bookkeeping; the cache and the digest of its (checked) token ids."""
    cache = read_cache_file(path, identity, agent_id)
    with contextlib.suppress(FileNotFoundError):
        os.utime(path)
    return cache, tokens_digest(cache.tensors["tokens"])


def unlink(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def quarantined_at(path: Path) -> int:
    """When a file was moved aside: the number its name ends with (nanoseconds; milliseconds in
    older names, which sort before; 0 for a name without one)."""
    suffix = path.name.rpartition(".")[2]
    return int(suffix) if suffix.isdigit() else 0


def move_aside(path: Path, quarantine_dir: Path) -> bool:
    """Move a file that cannot be used into `quarantine_dir` (for a person to look at), which keeps
    the newest MAX_QUARANTINED: a disk that keeps damaging files must not fill up with them."""
    own_folder(quarantine_dir)
    target = quarantine_dir / f"{path.name}.{time.time_ns()}"
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return False
    kept = sorted(quarantine_dir.iterdir(), key=quarantined_at, reverse=True)
    for old in kept[MAX_QUARANTINED:]:
        logger.info("removing {} from the quarantine, which keeps the newest {}", old.name, MAX_QUARANTINED)
        old.unlink(missing_ok=True)
    return True


NEWER_FORMAT_DIR = "newer-format"  # beside quarantine/: files a later release wrote, kept for it


def set_aside(path: Path, folder: Path) -> bool:
    """Move a file of a newer format than this release reads into `folder`, under its own name
    (a later release, or a person, can move it back); False when it is gone."""
    own_folder(folder)
    try:
        os.replace(path, folder / path.name)
    except FileNotFoundError:
        return False
    return True
