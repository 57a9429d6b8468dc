"""Cache files on a real disk: what is written reads back, older files still read, damage is caught."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.storage.agent_id import AgentId
from semantic.storage.cache_file import CacheFileError, CacheIdentity, read_cache_file, write_cache_file
from semantic.storage.persistence import PersistenceActor

# One full-attention layer of 2 KV heads of 8, float32: the layout the tensors below are checked against.
SPEC = {"num_layers": 1, "layer_kinds": ["full"], "dtype": "float32", "kv_widths": [[2, 8, 8]]}
SPEC |= {"state_arrays": [], "block_size": 256}
IDENTITY = CacheIdentity("tiny", "f" * 32, 256, SPEC, vocab_size=1000)


def a_cache(num_tokens: int = 40, seed: int = 0) -> SerializedCache:
    rng = np.random.default_rng(seed)
    tensors = {
        "tokens": rng.integers(0, 1000, num_tokens, dtype=np.int32),
        "attn.0.keys": rng.standard_normal((1, 2, num_tokens, 8)).astype(np.float32).view(np.uint32),
        "attn.0.values": rng.standard_normal((1, 2, num_tokens, 8)).astype(np.float32).view(np.uint32),
    }
    return SerializedCache("agent-1", tensors, [], num_tokens)


def metadata_of(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="numpy") as f:
        return dict(f.metadata())


def assert_same(read: SerializedCache, written: SerializedCache) -> None:
    assert read.agent_id == written.agent_id and read.num_tokens == written.num_tokens
    assert read.tensors.keys() == written.tensors.keys()
    for name, array in written.tensors.items():
        np.testing.assert_array_equal(read.tensors[name], array)


def test_a_written_cache_reads_back(tmp_path: Path) -> None:
    cache = a_cache()
    write_cache_file(tmp_path / "a.safetensors", cache, IDENTITY)
    assert_same(read_cache_file(tmp_path / "a.safetensors", IDENTITY, "agent-1"), cache)


@pytest.mark.parametrize("version", ["1", "2"])
def test_a_cache_of_an_earlier_layout_is_refused(tmp_path: Path, version: str) -> None:
    """Versions 1 and 2 kept full and sliding layers apart, a sliding layer as its rotating buffer:
    such a file is set aside (its agent starts cold), never read as today's layout."""
    path = tmp_path / "old.safetensors"
    write_cache_file(path, a_cache(), IDENTITY)
    save_file(load_file(str(path)), str(path), metadata={**metadata_of(path), "format_version": version})
    with pytest.raises(CacheFileError, match=f"format version '{version}'"):
        read_cache_file(path, IDENTITY)


def test_an_unknown_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.safetensors"
    write_cache_file(path, a_cache(), IDENTITY)
    save_file(load_file(str(path)), str(path), metadata={**metadata_of(path), "format_version": "99"})
    with pytest.raises(CacheFileError, match="format version '99'"):
        read_cache_file(path, IDENTITY)


@settings(max_examples=40, deadline=None)
@given(position=st.floats(min_value=0.0, max_value=1.0, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_in_the_tensors_is_caught(
    tmp_path_factory: pytest.TempPathFactory, position: float, bit: int
) -> None:
    path = tmp_path_factory.mktemp("flip") / "a.safetensors"
    write_cache_file(path, a_cache(), IDENTITY)
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    offset = header_end + int(position * (len(data) - header_end))
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFileError):
        read_cache_file(path, IDENTITY)


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(
        [
            "format_version",
            "cache_spec",
            "num_tokens",
            "kv_starts",
            "state_points",
            "agent_id",
            "checksum",
            "layout",
        ]
    ),
    value=st.one_of(
        st.sampled_from(["", "null", "{", "[[1]]", "[[1, 2, 3, 4.5]]", '"x"', "-1", "1e9", "[" * 5000]),
        st.text(max_size=40),
    ),
    drop=st.booleans(),
)
def test_metadata_another_writer_made_is_refused_as_a_cache_file_error(
    tmp_path_factory: pytest.TempPathFactory, field: str, value: str, drop: bool
) -> None:
    """A file from another version, or another program, with any metadata field missing or holding
    anything: the reader says CacheFileError (the file is quarantined), never another exception
    (which would fail the agent's turns for as long as the file stays)."""
    path = tmp_path_factory.mktemp("metadata") / "a.safetensors"
    cache = a_cache()
    write_cache_file(path, cache, IDENTITY)
    metadata = metadata_of(path)
    if drop:
        del metadata[field]
    else:
        metadata[field] = value
    save_file(load_file(str(path)), str(path), metadata=metadata)
    try:
        read = read_cache_file(path, IDENTITY, "agent-1")
    except CacheFileError:
        return
    assert_same(read, cache)  # only a harmless change reads back, and then as written


def test_a_strided_tensor_is_written_as_its_elements(tmp_path: Path) -> None:
    """safetensors writes a strided array's memory as is; the writer must hand it elements."""
    cache = a_cache()
    cache.tensors["attn.0.keys"] = cache.tensors["attn.0.keys"][:, ::-1]  # a view, not contiguous
    write_cache_file(tmp_path / "strided.safetensors", cache, IDENTITY)
    assert_same(read_cache_file(tmp_path / "strided.safetensors", IDENTITY, "agent-1"), cache)


def test_a_layer_shorter_than_the_token_list_is_refused(tmp_path: Path) -> None:
    """A file whose checksum holds but whose keys cover fewer tokens than it lists (another
    version's bug): restoring it would file short blocks under the agent's tokens."""
    cache = a_cache()
    cache.tensors["attn.0.keys"] = cache.tensors["attn.0.keys"][:, :, :-1, :]
    write_cache_file(tmp_path / "short.safetensors", cache, IDENTITY)
    with pytest.raises(CacheFileError, match="attention layer 0 does not hold tokens 0 to 40"):
        read_cache_file(tmp_path / "short.safetensors", IDENTITY)


def test_the_persistence_actor_keeps_nothing_of_a_cache_once_it_has_answered(tmp_path: Path) -> None:
    """A cache is tens of MB: neither the one written nor the one read may stay referenced by the
    actor while it waits for its next message."""

    async def tensor_read_back(actor: PersistenceActor) -> np.ndarray:
        loaded = await actor.load(AgentId("agent-1"))
        assert loaded is not None
        return loaded.tensors["attn.0.keys"]

    async def settled() -> None:
        for _ in range(3):  # the loop's callbacks that woke this task up let go of their futures
            await asyncio.sleep(0)
        gc.collect()

    async def kept_while_waiting() -> tuple[bool, bool]:
        actor = PersistenceActor(tmp_path, IDENTITY)
        await actor.start()
        try:
            cache = a_cache()
            saved = weakref.ref(cache.tensors["attn.0.keys"])
            assert await actor.save([cache]) == ["agent-1"]
            del cache
            await settled()
            saved_kept = saved() is not None
            read = weakref.ref(await tensor_read_back(actor))
            await settled()
            assert actor._task is not None and not actor._task.done()  # waiting for its next message
            return saved_kept, read() is not None
        finally:
            await actor.stop()

    assert asyncio.run(kept_while_waiting()) == (False, False)
