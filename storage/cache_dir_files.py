"""A cache dir's agents' files as the `agents` and `cache` commands see them, read without a model:
each model's folder (`agents/<fingerprint[:16]>/`, and a group's `rank-r-of-n/agents/...`), the
agents in it, checks of every file by its own header, and the sizes and leftovers it holds.

The commands run these while they hold the cache dir's lock (no server writes meanwhile), except
the read-only ones a running server's files allow (`du`, `verify` without `--fix`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from semantic.storage.agent_id import AgentId, InvalidAgentIdError
from semantic.storage.agents_folder import (
    CONVERSATION_SUFFIX,
    NEWER_FORMAT_DIR,
    SUFFIX,
    agent_file_named,
    is_real_dir,
    move_aside,
    quarantined_at,
    remove_temp,
    set_aside,
)
from semantic.storage.cache_file import (
    CacheFileError,
    CacheIdentity,
    NewerCacheFileError,
    is_temp_name,
    read_cache_file,
    read_metadata,
)
from semantic.storage.conversation_file import (
    ConversationFileError,
    NewerConversationFileError,
    read_conversation,
)

MODEL_FOLDER = re.compile(r"[0-9a-f]{16}")
RANK_FOLDER = re.compile(r"rank-\d+-of-\d+")


@dataclass(slots=True)
class AgentFiles:
    """One agent's files in one model's folder."""

    agent_id: AgentId
    folder: Path  # the model's folder, named by its fingerprint's first 16 hex digits
    has_cache: bool = False
    has_conversation: bool = False

    @property
    def cache_path(self) -> Path:
        return self.folder / f"{self.agent_id}{SUFFIX}"

    @property
    def conversation_path(self) -> Path:
        return self.folder / f"{self.agent_id}{CONVERSATION_SUFFIX}"

    @property
    def paths(self) -> list[Path]:
        return [
            p
            for p, has in ((self.cache_path, self.has_cache), (self.conversation_path, self.has_conversation))
            if has
        ]

    @property
    def num_bytes(self) -> int:
        return sum(path.lstat().st_size for path in self.paths)

    def header(self) -> dict[str, str]:
        """Its cache file's header ({} when it has none or it is unreadable)."""
        try:
            return read_metadata(self.cache_path) if self.has_cache else {}
        except (OSError, ValueError, struct.error, AttributeError):
            return {}


def roots(cache_dir: Path) -> list[Path]:
    """The folders that hold `agents/` and `quarantine/`: the cache dir and a group's rank folders
    (every folder found here is one of its own: links are passed by, see `linked_folders`)."""
    ranks = sorted(
        p for p in cache_dir.glob("rank-*-of-*") if RANK_FOLDER.fullmatch(p.name) and is_real_dir(p)
    )
    return [cache_dir, *ranks]


def model_folders(cache_dir: Path) -> Iterator[Path]:
    for root in roots(cache_dir):
        agents = root / "agents"
        if is_real_dir(agents):
            yield from sorted(
                p for p in agents.iterdir() if is_real_dir(p) and MODEL_FOLDER.fullmatch(p.name)
            )


def linked_folders(cache_dir: Path) -> list[Path]:
    """The links where the cache dir's own folders would be (a rank's, `agents/`, a model's,
    `quarantine/`, `newer-format/`), which every command passes by, unfollowed."""
    found = [p for p in cache_dir.glob("rank-*-of-*") if RANK_FOLDER.fullmatch(p.name) and p.is_symlink()]
    for root in roots(cache_dir):
        found += [
            root / name for name in ("agents", "quarantine", NEWER_FORMAT_DIR) if (root / name).is_symlink()
        ]
        if is_real_dir(root / "agents"):
            found += [
                p for p in (root / "agents").iterdir() if MODEL_FOLDER.fullmatch(p.name) and p.is_symlink()
            ]
    return sorted(found)


def agents_in(folder: Path) -> dict[AgentId, AgentFiles]:
    """The agents whose files the folder holds; a link is not an agent's file (`verify` says so)."""
    found: dict[AgentId, AgentFiles] = {}
    for path in sorted(folder.iterdir()):
        named = agent_file_named(path.name)
        if named is None or path.is_symlink():
            continue
        agent_id, is_cache = named
        files = found.setdefault(agent_id, AgentFiles(agent_id, folder))
        if is_cache:
            files.has_cache = True
        else:
            files.has_conversation = True
    return found


def all_agents(cache_dir: Path) -> list[AgentFiles]:
    return [files for folder in model_folders(cache_dir) for files in agents_in(folder).values()]


def find_agent(cache_dir: Path, agent_id: AgentId) -> list[AgentFiles]:
    """The agent's files in every model's folder that has some."""
    return [files for files in all_agents(cache_dir) if files.agent_id == agent_id]


@dataclass(slots=True)
class Finding:
    path: Path
    problem: str
    is_newer: bool  # a later release's file: set aside, not quarantined


def check_cache_file(path: Path, agent_id: AgentId, folder_name: str) -> None:
    """Read and verify a cache file by the identity its own header states (no model at hand):
    checksum, layout, token counts, and that it belongs in this folder under this name."""
    try:
        metadata = read_metadata(path)
        identity = CacheIdentity(
            str(metadata.get("model_name", "")),
            str(metadata.get("model_fingerprint", "")),
            int(metadata.get("block_size", 0)),
            _spec(metadata),
            layout=str(metadata.get("layout", "")),
        )
    except (OSError, ValueError, struct.error, AttributeError) as error:
        raise CacheFileError(f"unreadable header: {error}") from error
    read_cache_file(path, identity, agent_id)
    if not identity.fingerprint.startswith(folder_name):
        raise CacheFileError(f"written by model {identity.fingerprint[:16]}, in the folder of {folder_name}")


def _spec(metadata: dict[str, str]) -> dict[str, object]:
    spec = json.loads(metadata.get("cache_spec", "{}"))
    if not isinstance(spec, dict):
        raise ValueError("cache_spec is not an object")
    return spec


def verify(cache_dir: Path) -> tuple[int, list[Finding]]:
    """Every agent file's checks; the number of files checked and what is wrong with the others."""
    num_checked, findings = 0, []
    for folder in model_folders(cache_dir):
        for path in sorted(folder.iterdir()):
            if is_temp_name(path.name):
                continue  # an interrupted write's leftovers: `cache gc` removes them
            num_checked += 1
            if path.is_symlink():  # moved aside as a link: what it points at is not the cache's
                findings.append(Finding(path, "a symbolic link, not followed", is_newer=False))
                continue
            try:
                _check(path, folder.name)
            except (CacheFileError, ConversationFileError, InvalidAgentIdError) as error:
                is_newer = isinstance(error, NewerCacheFileError | NewerConversationFileError)
                findings.append(Finding(path, str(error), is_newer))
    return num_checked, findings


def _check(path: Path, folder_name: str) -> None:
    if path.name.endswith(SUFFIX):
        check_cache_file(path, AgentId(path.name.removesuffix(SUFFIX)), folder_name)
    elif path.name.endswith(CONVERSATION_SUFFIX):
        AgentId(path.name.removesuffix(CONVERSATION_SUFFIX))
        read_conversation(path)
    else:
        raise InvalidAgentIdError("not an agent's file (no agent id and known suffix)")


def put_aside(finding: Finding) -> None:
    """What the server does with such a file on use: quarantine it, or keep a newer one whole."""
    root = finding.path.parent.parent.parent
    if finding.is_newer:
        set_aside(finding.path, root / NEWER_FORMAT_DIR)
    else:
        move_aside(finding.path, root / "quarantine")


def leftovers(cache_dir: Path, older_than_s: float, now: float) -> list[Path]:
    """Interrupted writes' temp files and quarantined files older than `older_than_s`."""
    found: list[Path] = []
    for folder in model_folders(cache_dir):
        found += [
            p for p in folder.iterdir() if is_temp_name(p.name) and now - p.lstat().st_mtime > older_than_s
        ]
    for root in roots(cache_dir):
        quarantine = root / "quarantine"
        if is_real_dir(quarantine):
            found += [p for p in sorted(quarantine.iterdir()) if now - _moved_at(p) > older_than_s]
    return found


def _moved_at(path: Path) -> float:
    """When a file was quarantined (its name's nanoseconds or, in older names, milliseconds)."""
    stamp = quarantined_at(path)
    if stamp > 10**15:
        return stamp / 1e9
    return stamp / 1e3 if stamp else path.lstat().st_mtime


def remove(path: Path) -> int:
    """Remove a leftover (a file or a staging folder); the bytes it held on the disk."""
    return remove_temp(path)
