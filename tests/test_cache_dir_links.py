"""`semantic cache` and `semantic agents` never follow a link out of the cache dir: a link where a
folder or an agent's file should be is reported or removed as a link, and what it points at (here
a victim folder beside the cache dir) is neither read as the cache's, written nor removed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import move_aside, scan_folder, set_aside
from semantic.storage.persistence import PersistenceActor
from tests.test_agents_cli import semantic
from tests.test_cache_file import IDENTITY, a_cache

MODEL_FOLDER = "0123456789abcdef"


def victim_folder(tmp_path: Path, name: str) -> Path:
    """A folder outside the cache dir holding files whose names the cache's would have."""
    victim = tmp_path / "victim" / name
    victim.mkdir(parents=True)
    for file_name in ("old.safetensors.1000", ".ada.safetensors.7.tmp", "ada.safetensors"):
        (victim / file_name).write_bytes(b"precious " + file_name.encode())
    return victim


def untouched(victim: Path) -> bool:
    files = [p for p in victim.iterdir() if p.is_file()]
    return sorted(p.name for p in files) == [
        ".ada.safetensors.7.tmp",
        "ada.safetensors",
        "old.safetensors.1000",
    ] and all(p.read_bytes() == b"precious " + p.name.encode() for p in files)


@pytest.fixture
def linked_cache_dir(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A cache dir whose quarantine/, newer-format/, a model's folder, agents/ of a rank and a
    rank's folder are links to victims outside it."""
    cache_dir = tmp_path / "cache"
    (cache_dir / "agents").mkdir(parents=True)
    (cache_dir / "rank-1-of-3").mkdir()
    victims = []
    for link in (
        cache_dir / "quarantine",
        cache_dir / "newer-format",
        cache_dir / "agents" / MODEL_FOLDER,
        cache_dir / "rank-1-of-3" / "agents",
        cache_dir / "rank-2-of-3",
    ):
        victim = victim_folder(tmp_path, link.relative_to(cache_dir).as_posix().replace("/", "-"))
        link.symlink_to(victim, target_is_directory=True)
        victims.append(victim)
    for victim in victims[3:]:  # what a rank's folder holds, so that following them finds files
        (victim / MODEL_FOLDER).mkdir(exist_ok=True)
        (victim / MODEL_FOLDER / ".bob.safetensors.8.tmp").write_bytes(b"precious too")
    (victims[4] / "quarantine").mkdir()
    (victims[4] / "quarantine" / "old.safetensors.1000").write_bytes(b"precious too")
    return cache_dir, victims


def test_gc_removes_nothing_a_link_points_at(
    linked_cache_dir: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir, victims = linked_cache_dir
    code, _, err = semantic(capsys, cache_dir, "cache", "gc", "--older-than", "0", "--delete")
    assert code == 0, err
    assert all(untouched(victim) for victim in victims)
    assert (victims[3] / MODEL_FOLDER / ".bob.safetensors.8.tmp").read_bytes() == b"precious too"
    assert (victims[4] / "quarantine" / "old.safetensors.1000").read_bytes() == b"precious too"
    for link in ("quarantine", "newer-format", f"agents/{MODEL_FOLDER}", "rank-1-of-3/agents", "rank-2-of-3"):
        assert f"skipped {cache_dir / link}: a symbolic link" in err


def test_du_and_ls_count_and_read_nothing_a_link_points_at(
    linked_cache_dir: tuple[Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir, victims = linked_cache_dir
    code, out, err = semantic(capsys, cache_dir, "cache", "du", "--json")
    assert code == 0, err
    assert all(row["bytes"] == 0 for row in json.loads(out)), out
    assert f"skipped {cache_dir / 'quarantine'}: a symbolic link" in err
    code, out, err = semantic(capsys, cache_dir, "agents", "ls", "--json")
    assert code == 0 and json.loads(out) == [], out
    assert all(untouched(victim) for victim in victims)


def test_verify_fix_moves_a_linked_agent_file_aside_as_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir = tmp_path / "cache"
    folder = cache_dir / "agents" / MODEL_FOLDER
    folder.mkdir(parents=True)
    victim_file = tmp_path / "victim.safetensors"
    victim_file.write_bytes(b"precious")
    (folder / "ada.safetensors").symlink_to(victim_file)
    (folder / "bad.safetensors").write_bytes(b"not a cache file")
    quarantine_victim = victim_folder(tmp_path, "quarantine")
    (cache_dir / "quarantine").symlink_to(quarantine_victim, target_is_directory=True)

    code, out, _ = semantic(capsys, cache_dir, "agents", "verify")
    assert code == 1 and "ada.safetensors: a symbolic link" in out
    code, out, err = semantic(capsys, cache_dir, "agents", "verify", "--fix")
    assert code == 0, err
    assert victim_file.read_bytes() == b"precious" and untouched(quarantine_victim)
    assert not (cache_dir / "quarantine").is_symlink() and not list(folder.iterdir())
    moved = {p.name.rpartition(".")[0]: p for p in (cache_dir / "quarantine").iterdir()}
    assert set(moved) == {"ada.safetensors", "bad.safetensors"}
    assert moved["ada.safetensors"].is_symlink()  # the link itself, moved: its target stays put


def test_files_set_aside_never_land_where_a_link_points(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    for name, put in (("quarantine", move_aside), ("newer-format", set_aside)):
        victim = victim_folder(tmp_path, name)
        (root / name).symlink_to(victim, target_is_directory=True)
        (root / "bob.safetensors").write_bytes(b"bob's")
        assert put(root / "bob.safetensors", root / name)
        assert untouched(victim) and not (root / name).is_symlink()
        (moved,) = (root / name).iterdir()
        assert moved.read_bytes() == b"bob's"


def test_a_server_start_reads_and_removes_nothing_a_link_points_at(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "agents" / MODEL_FOLDER
    folder.mkdir(parents=True)
    victim = victim_folder(tmp_path, "files")
    (folder / "ada.safetensors").symlink_to(victim / "ada.safetensors")
    (folder / ".ada.safetensors.9.tmp").symlink_to(victim / ".ada.safetensors.7.tmp")
    index, uses = scan_folder(folder)
    assert index == {} and uses == {}
    assert untouched(victim) and not (folder / ".ada.safetensors.9.tmp").is_symlink()


def test_a_server_quarantines_a_damaged_file_into_a_folder_of_its_own(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    victim = victim_folder(tmp_path, "quarantine")
    (cache_dir / "quarantine").symlink_to(victim, target_is_directory=True)

    async def load_damaged() -> None:
        actor = PersistenceActor(cache_dir, IDENTITY)
        await actor.start()
        try:
            assert await actor.save([a_cache()]) == ["agent-1"]
            path = actor.agents_dir / "agent-1.safetensors"
            damaged = bytearray(path.read_bytes())
            damaged[-1] ^= 0xFF
            path.write_bytes(bytes(damaged))
            assert await actor.load(AgentId("agent-1")) is None
        finally:
            await actor.stop()

    asyncio.run(load_damaged())
    assert untouched(victim) and not (cache_dir / "quarantine").is_symlink()
    (quarantined,) = (cache_dir / "quarantine").iterdir()
    assert quarantined.name.startswith("agent-1.safetensors.")
