"""The model fingerprint covers every weight byte: a copy with one tensor changed in the middle of its
file is another model, its digests are kept so a restart reads no weight again, and a cache file
written under other weights is set aside, not used."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from loguru import logger

from semantic.engine.model import weights_digest
from semantic.engine.model.loading import fingerprint_model, legacy_fingerprint
from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import CONVERSATION_SUFFIX
from semantic.storage.cache_file import CacheIdentity, write_cache_file
from semantic.storage.conversation_file import ConversationRecord
from semantic.storage.persistence import PersistenceActor
from tests.test_cache_file import SPEC, a_cache
from tests.tiny_models import build_tiny_model

MIB = 1 << 20
AN_HOUR_NS = 3600 * 10**9
CHANGED_TENSOR = "model.layers.1."  # a middle layer's: any of its tensors that lies between the ends


def tensor_spans(weights: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The header's length and each tensor's byte range in the file."""
    with open(weights, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    start = 8 + header_len
    return header_len, {
        name: (start + info["data_offsets"][0], start + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }


def header_and_ends(model_dir: Path) -> bytes:
    """All that the fingerprint of earlier releases read: config, each file's size, header, first
    and last MiB after the header."""
    read = (model_dir / "config.json").read_bytes()
    weights = model_dir / "model.safetensors"
    header_len, _ = tensor_spans(weights)
    size = weights.stat().st_size
    with open(weights, "rb") as f:
        read += str(size).encode() + f.read(8 + header_len + MIB)
        f.seek(size - MIB)
        read += f.read()
    return read


def scale_one_tensor_in_place(model_dir: Path) -> str:
    """Double one middle layer's tensor that lies outside the file's first and last MiB: same
    shapes, dtype, header and size, as saving the scaled model again would leave them."""
    weights = model_dir / "model.safetensors"
    header_len, spans = tensor_spans(weights)
    size = weights.stat().st_size
    name, (start, end) = next(
        (name, (start, end))
        for name, (start, end) in sorted(spans.items())
        if name.startswith(CHANGED_TENSOR) and start >= 8 + header_len + MIB and end <= size - MIB
    )
    with open(weights, "r+b") as f:
        f.seek(start)
        doubled = np.frombuffer(f.read(end - start), dtype=np.float32) * 2
        f.seek(start)
        f.write(doubled.tobytes())
    return name


def set_mtime_back(weights: Path, by_ns: int = AN_HOUR_NS) -> None:
    mtime_ns = weights.stat().st_mtime_ns - by_ns
    os.utime(weights, ns=(mtime_ns, mtime_ns))


@pytest.fixture(scope="module")
def tiny_llama(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("fingerprint") / "llama", default_model_dir)
    assert (model_dir / "model.safetensors").stat().st_size > 4 * MIB  # room between the ends
    return model_dir


@pytest.fixture
def model_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "copy"))


@pytest.fixture
def file_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The weight files read, in order."""
    read: list[Path] = []
    digest = weights_digest.file_digest

    def counted(path: Path) -> str:
        read.append(path)
        return digest(path)

    monkeypatch.setattr(weights_digest, "file_digest", counted)
    return read


@pytest.fixture
def an_hour_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights written a while ago, as a downloaded model's are: a stamp (mtime or ctime) fresher
    than the racy window is not trusted, and its file is read on every load."""
    now_ns = time.time_ns
    monkeypatch.setattr(weights_digest, "time_ns", lambda: now_ns() + AN_HOUR_NS)


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    yield messages
    logger.remove(sink)


def test_a_copy_with_one_tensor_changed_mid_file_is_another_model(tiny_llama: Path, model_copy: Path) -> None:
    assert fingerprint_model(model_copy) == fingerprint_model(tiny_llama)  # where it lies is no part
    before = header_and_ends(model_copy)
    name = scale_one_tensor_in_place(model_copy)
    assert header_and_ends(model_copy) == before, f"{name}: the old fingerprint would have told them apart"
    assert fingerprint_model(model_copy) != fingerprint_model(tiny_llama)


@pytest.mark.usefixtures("an_hour_later")
def test_a_restart_reads_no_weight_byte_again(
    model_copy: Path, tmp_path: Path, file_reads: list[Path]
) -> None:
    digests = tmp_path / "state" / "weight-digests.json"
    first = fingerprint_model(model_copy, digests)
    assert len(file_reads) == 1 and digests.exists()
    assert fingerprint_model(model_copy, digests) == first
    assert len(file_reads) == 1, "the second fingerprint read the weights again"
    assert first == fingerprint_model(model_copy)  # what is kept is what reading gives


@pytest.mark.usefixtures("an_hour_later")
def test_a_changed_stamp_reads_the_file_again(
    model_copy: Path, tmp_path: Path, file_reads: list[Path]
) -> None:
    digests, weights = tmp_path / "weight-digests.json", model_copy / "model.safetensors"
    first = fingerprint_model(model_copy, digests)
    set_mtime_back(weights)  # another mtime, same bytes
    assert fingerprint_model(model_copy, digests) == first
    assert len(file_reads) == 2
    assert fingerprint_model(model_copy, digests) == first
    assert len(file_reads) == 2
    # bytes changed and the mtime set back (`cp -p`, `touch -r`): the ctime still tells
    mtime_ns = weights.stat().st_mtime_ns
    scale_one_tensor_in_place(model_copy)
    os.utime(weights, ns=(mtime_ns, mtime_ns))
    assert fingerprint_model(model_copy, digests) != first
    assert len(file_reads) == 3


def test_weights_written_just_now_are_read_on_every_load(
    model_copy: Path, tmp_path: Path, file_reads: list[Path]
) -> None:
    """A file rewritten within its stamp's granule (a second on HFS+) would keep its stamp."""
    digests = tmp_path / "weight-digests.json"
    fingerprint_model(model_copy, digests)
    fingerprint_model(model_copy, digests)
    assert len(file_reads) == 2


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\x17 not json",
        b"[]",
        b'{"version": 1, "path_to_digest": []}',
        b'{"version": 99, "path_to_digest": {}}',
        b'{"version": 1, "path_to_digest": {}, "extra": 1}',
        b'{"version": 1, "path_to_digest": {"/x": {"stamp": {"size": "big"}, "digest": "00"}}}',
    ],
)
@pytest.mark.usefixtures("an_hour_later")
def test_a_corrupt_or_foreign_digests_file_counts_as_empty(
    model_copy: Path, tmp_path: Path, file_reads: list[Path], warnings_logged: list[str], content: bytes
) -> None:
    digests = tmp_path / "weight-digests.json"
    digests.write_bytes(content)
    assert fingerprint_model(model_copy, digests) == fingerprint_model(model_copy)
    assert any("ignoring the weight digests" in message for message in warnings_logged)
    assert fingerprint_model(model_copy, digests) == fingerprint_model(model_copy)
    assert len(file_reads) == 3  # the first and the two unkept: the file was written again, whole


def identity(fingerprint: str) -> CacheIdentity:
    return CacheIdentity("tiny-llama", fingerprint, 256, SPEC, vocab_size=1000)  # a_cache()'s layout


def run_actor(
    cache_dir: Path, ident: CacheIdentity, use: Callable[[PersistenceActor], Awaitable[object]]
) -> object:
    async def run() -> object:
        actor = PersistenceActor(cache_dir, ident)
        await actor.start()
        try:
            return await use(actor)
        finally:
            await actor.stop()

    return asyncio.run(run())


def test_a_cache_file_of_other_weights_is_set_aside_naming_both(
    tiny_llama: Path, model_copy: Path, tmp_path: Path, warnings_logged: list[str]
) -> None:
    """A file copied by hand into the folder of a model that differs in one tensor: refused on
    its metadata's fingerprint, moved to quarantine/, the log naming both fingerprints."""
    scale_one_tensor_in_place(model_copy)
    written_under, loaded = fingerprint_model(tiny_llama), fingerprint_model(model_copy)
    cache_dir = tmp_path / "cache"
    folder = cache_dir / "agents" / loaded[:16]
    write_cache_file(folder / "agent-1.safetensors", a_cache(), identity(written_under))

    async def load(actor: PersistenceActor) -> object:
        return await actor.load(AgentId("agent-1"))

    assert run_actor(cache_dir, identity(loaded), load) is None
    assert not (folder / "agent-1.safetensors").exists()
    assert [path.name.split(".safetensors")[0] for path in (cache_dir / "quarantine").iterdir()] == [
        "agent-1"
    ]
    assert any(written_under in message and loaded in message for message in warnings_logged)

    async def save_and_load(actor: PersistenceActor) -> object:  # its own weights' file still reads
        await actor.save([a_cache()])
        return await actor.load(AgentId("agent-1"))

    assert run_actor(cache_dir, identity(loaded), save_and_load) is not None


def test_conversations_kept_under_the_old_fingerprint_move_to_the_new_folder(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """An upgrade must not lose a direct-API agent: its conversation record, kept in the folder the
    header-and-ends fingerprint named, moves to the new folder at the first start; the old cache
    file stays behind, unread."""
    old, new = legacy_fingerprint(tiny_llama), fingerprint_model(tiny_llama)
    cache_dir = tmp_path / "cache"
    old_folder = cache_dir / "agents" / old[:16]
    old_folder.mkdir(parents=True)
    record = ConversationRecord("You are terse.", [1, 2, 3], 1)
    (old_folder / f"ada{CONVERSATION_SUFFIX}").write_bytes(msgspec.json.encode(record))
    (old_folder / "ada.safetensors").write_bytes(b"a format 2 cache file")
    ident = dataclasses.replace(identity(new), legacy_fingerprint=old)

    async def read(actor: PersistenceActor) -> object:
        return await actor.load_conversation(AgentId("ada"))

    assert run_actor(cache_dir, ident, read) == record
    assert (old_folder / "ada.safetensors").exists() and not (
        old_folder / f"ada{CONVERSATION_SUFFIX}"
    ).exists()
