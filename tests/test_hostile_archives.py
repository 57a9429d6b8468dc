"""Archives a hostile sender crafts from a real agent's export: members that would expand on disk
(sparse, links, devices, sizes beyond the archive) refused before a byte is written, and cache
tensors of another dtype or shape, with every checksum recomputed, refused by `agents import`,
reported by `agents verify` and quarantined at load, so the agent starts cold and others are served.
The agent is the tiny random-weight Llama's (3 layers, 6 KV heads of 16): what is tested is what the
server reads, not what the model says."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import resource
import signal
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from semantic.cli import main
from semantic.storage.agent_id import AgentId
from semantic.storage.cache_file import CacheIdentity, read_metadata
from semantic.storage.persistence import PersistenceActor
from tests.server_process import ServerProcess
from tests.test_agents_cli import call, semantic

AGENT = "ada"
CACHE = f"{AGENT}.safetensors"
CONVERSATION = f"{AGENT}.conversation.json"


@pytest.fixture(scope="module")
def exported(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An archive of an agent with one real turn on the tiny Llama."""
    source = tmp_path_factory.mktemp("source")
    server = ServerProcess(source, "--model", str(tiny_llama_dir)).start()
    try:
        call(server, "POST", "/v1/agents", {"id": AGENT, "system": "Be brief."})
        call(server, "POST", f"/v1/agents/{AGENT}/messages", {"content": "Hi", "max_tokens": 4})
    finally:
        server.stop()
    archive = tmp_path_factory.mktemp("archive") / f"{AGENT}.tar"
    with pytest.raises(SystemExit) as exited:
        main(["agents", "export", AGENT, "-o", str(archive), "--cache-dir", str(source)])
    assert not exited.value.code
    return archive


def members_of(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]


def tar_member(info: tarfile.TarInfo, data: bytes) -> bytes:
    """One member's header and data as a tar holds them, whatever size its header claims."""
    return info.tobuf(tarfile.PAX_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def restated(members: dict[str, bytes], claimed_bytes: dict[str, int] | None = None) -> bytes:
    """The manifest as a sender rewrites it: each member's size (or the one claimed) and sha256."""
    manifest = json.loads(members["manifest.json"])
    manifest["files"] = [
        {
            "name": name,
            "num_bytes": (claimed_bytes or {}).get(name, len(data)),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        for name, data in members.items()
        if name != "manifest.json"
    ]
    return json.dumps(manifest).encode()


def packed(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in {**members, "manifest.json": restated(members)}.items():  # the manifest first
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@contextmanager
def file_size_limit(num_bytes: int) -> Iterator[None]:
    """Writes past `num_bytes` in one file fail (EFBIG) instead of landing on the disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def refused(capsys: pytest.CaptureFixture[str], target: Path, archive: Path) -> str:
    """`agents import`'s error, after checking it placed no file."""
    with file_size_limit(16 << 20):
        code, _, err = semantic(capsys, target, "agents", "import", str(archive))
    assert code == 1 and "not imported" in err, err
    assert not [p for p in target.rglob("*") if p.is_file() and p.name != "semantic.lock"]
    return err


def test_a_sparse_member_is_refused_before_a_byte_is_written(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = members_of(exported)
    claimed, stored = 2 << 30, b"\x01" * 4096
    sparse = tarfile.TarInfo(CACHE)
    sparse.size = len(stored)
    # GNU sparse format 0.1 in PAX records: one 4 KiB run at the end of a 2 GiB file of holes.
    sparse.pax_headers = {
        "GNU.sparse.map": f"{claimed - len(stored)},{len(stored)}",
        "GNU.sparse.size": str(claimed),
    }
    manifest = tarfile.TarInfo("manifest.json")
    manifest_data = restated(members, {CACHE: claimed})
    manifest.size = len(manifest_data)
    archive = tmp_path / "sparse.tar"
    archive.write_bytes(
        tar_member(manifest, manifest_data) + tar_member(sparse, stored) + bytes(2 * tarfile.BLOCKSIZE)
    )
    with tarfile.open(archive) as tar:
        (member,) = [m for m in tar if m.name == CACHE]
    assert member.issparse() and member.size == claimed and archive.stat().st_size < 16 << 10

    err = refused(capsys, tmp_path / "target", archive)
    assert f"{CACHE!r} is a sparse file" in err


def test_a_member_claiming_more_than_its_archive_holds_is_refused(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = members_of(exported)
    claimed = 1 << 30
    manifest_data = restated(members, {CACHE: claimed})
    manifest, cache = tarfile.TarInfo("manifest.json"), tarfile.TarInfo(CACHE)
    manifest.size, cache.size = len(manifest_data), claimed
    archive = tmp_path / "short.tar"
    archive.write_bytes(tar_member(manifest, manifest_data) + tar_member(cache, members[CACHE]))

    err = refused(capsys, tmp_path / "target", archive)
    assert f"{CACHE}: {claimed} bytes, more than the archive's" in err


SPECIAL = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}
SPECIAL |= {"device": tarfile.CHRTYPE, "folder": tarfile.DIRTYPE}


@pytest.mark.parametrize("kind", SPECIAL.values(), ids=SPECIAL.keys())
def test_a_member_that_is_not_a_regular_file_is_refused(
    kind: bytes, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = members_of(exported)
    archive = tmp_path / "special.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        data = restated(members)
        manifest = tarfile.TarInfo("manifest.json")
        manifest.size = len(data)
        tar.addfile(manifest, io.BytesIO(data))
        special = tarfile.TarInfo(CACHE)
        special.type, special.linkname = kind, "/dev/zero"
        tar.addfile(special)

    err = refused(capsys, tmp_path / "target", archive)
    assert f"{CACHE!r} is not a regular file" in err


def sender_checksum(tensors: dict[str, np.ndarray]) -> str:
    """The checksum a cache file's header states, recomputed as its format defines it."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tensors[name]).tobytes())
    return digest.hexdigest()


def altered(cache: bytes, folder: Path, alter: Callable[[dict[str, np.ndarray]], None]) -> bytes:
    """The cache file with its tensors altered and its checksum restated."""
    path = folder / "altered.safetensors"
    path.write_bytes(cache)
    tensors, metadata = load_file(str(path)), read_metadata(path)
    alter(tensors)
    tensors = {name: np.ascontiguousarray(tensor) for name, tensor in tensors.items()}
    save_file(tensors, str(path), metadata={**metadata, "checksum": sender_checksum(tensors)})
    return path.read_bytes()


def as_uint8(tensors: dict[str, np.ndarray]) -> None:
    tensors["attn.0.keys"] = tensors["attn.0.keys"].astype(np.uint8)


def second_batch_row(tensors: dict[str, np.ndarray]) -> None:
    tensors["attn.2.values"] = np.concatenate([tensors["attn.2.values"]] * 2)


def fewer_heads(tensors: dict[str, np.ndarray]) -> None:
    tensors["attn.1.keys"] = tensors["attn.1.keys"][:, :1]


def narrower_heads(tensors: dict[str, np.ndarray]) -> None:
    tensors["attn.1.values"] = tensors["attn.1.values"][..., :8]


def more_tokens(tensors: dict[str, np.ndarray]) -> None:
    tensors["attn.2.keys"] = np.concatenate([tensors["attn.2.keys"]] * 300, axis=2)


def tokens_as_int64(tensors: dict[str, np.ndarray]) -> None:
    tensors["tokens"] = tensors["tokens"].astype(np.int64)


def an_extra_tensor(tensors: dict[str, np.ndarray]) -> None:
    tensors["attn.999.keys"] = tensors["attn.0.keys"]


CRAFTED = [
    (as_uint8, "attn.0.keys: elements of uint8"),
    (second_batch_row, "attn.2.values: axis 0 (batch rows) holds 2"),
    (fewer_heads, "attn.1.keys: axis 1 (KV heads) holds 1"),
    (narrower_heads, "attn.1.values: axis 3 (value width) holds 8"),
    (more_tokens, "attn.2.keys: axis 2 (tokens) holds"),
    (tokens_as_int64, "tokens: elements of int64"),
    (an_extra_tensor, "attn.999.keys is not a tensor of this model's cache"),
]


def identity_in(cache: bytes, folder: Path) -> CacheIdentity:
    """What the server that wrote `cache` read its files with: its model's name, fingerprint, spec."""
    path = folder / "original.safetensors"
    path.write_bytes(cache)
    header = read_metadata(path)
    spec = json.loads(header["cache_spec"])
    return CacheIdentity(header["model_name"], header["model_fingerprint"], spec["block_size"], spec)


def quarantined_at_load(cache_dir: Path, ident: CacheIdentity) -> tuple[object, int]:
    async def run() -> tuple[object, int]:
        actor = PersistenceActor(cache_dir, ident)
        await actor.start()
        try:
            return await actor.load(AgentId(AGENT)), actor.num_quarantined
        finally:
            await actor.stop()

    return asyncio.run(run())


def placed(cache_dir: Path, members: dict[str, bytes], fingerprint: str) -> Path:
    """The agent's files where its model's server reads them, as an earlier release's import left them."""
    folder = cache_dir / "agents" / fingerprint[:16]
    folder.mkdir(parents=True)
    for name in (CACHE, CONVERSATION):
        (folder / name).write_bytes(members[name])
    return folder


@pytest.mark.parametrize(("alter", "reason"), CRAFTED, ids=[alter.__name__ for alter, _ in CRAFTED])
def test_a_cache_of_another_shape_or_dtype_is_refused_reported_and_quarantined(
    alter: Callable[[dict[str, np.ndarray]], None],
    reason: str,
    exported: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    members = members_of(exported)
    ident = identity_in(members[CACHE], tmp_path)
    crafted = {**members, CACHE: altered(members[CACHE], tmp_path, alter)}

    err = refused(capsys, tmp_path / "target", packed(tmp_path / "crafted.tar", crafted))
    assert reason in err

    folder = placed(tmp_path / "placed", crafted, ident.fingerprint)
    code, out, _ = semantic(capsys, tmp_path / "placed", "agents", "verify")
    assert code == 1 and f"would quarantine: {folder / CACHE}: {reason}" in out, out

    cache, num_quarantined = quarantined_at_load(tmp_path / "placed", ident)
    assert cache is None and num_quarantined == 1
    assert not (folder / CACHE).exists() and (folder / CONVERSATION).exists()


@pytest.mark.parametrize("alter", [as_uint8, second_batch_row], ids=lambda alter: alter.__name__)
def test_a_crafted_cache_on_disk_starts_its_agent_cold_and_others_are_served(
    alter: Callable[[dict[str, np.ndarray]], None], tiny_llama_dir: Path, exported: Path, tmp_path: Path
) -> None:
    members = members_of(exported)
    ident = identity_in(members[CACHE], tmp_path)
    crafted = {**members, CACHE: altered(members[CACHE], tmp_path, alter)}
    placed(tmp_path / "cache", crafted, ident.fingerprint)

    server = ServerProcess(tmp_path / "cache", "--model", str(tiny_llama_dir)).start()
    try:
        call(server, "POST", "/v1/agents", {"id": "bystander"})
        turn = {"content": "Go on", "max_tokens": 3, "temperature": 0}
        resumed = call(server, "POST", f"/v1/agents/{AGENT}/messages", turn)
        other = call(server, "POST", "/v1/agents/bystander/messages", turn)
    finally:
        server.stop()
    assert resumed["usage"]["cached_tokens"] == 0 and resumed["content"]
    assert other["content"]
    (quarantined,) = (tmp_path / "cache" / "quarantine").iterdir()
    assert quarantined.name.startswith(CACHE)
