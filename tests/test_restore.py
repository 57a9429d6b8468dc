"""An agent's cache written to a real file and restored into a fresh pool holds what it held: the
same tokens and, block by block, the same keys and values (for every dtype and with idle bits)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache

from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.cache_store.cache_tensors import from_tensors, to_tensors
from semantic.engine.cache_store.layer_caches import BlockCodec, attention_kv_of
from semantic.engine.loop.errors import PoolExhaustedError
from semantic.engine.mlx_adapter.kv_seams import HistoryKVCache
from semantic.storage.cache_file import CacheIdentity, read_cache_file, write_cache_file

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 16


def a_store(dtype: str, bits: int | None, num_blocks: int = 32) -> AgentCacheStore:
    spec = ModelCacheSpec(LAYERS, HEADS, HEAD_DIM, dtype, (LayerKind.FULL,) * LAYERS, None, BLOCK)
    pool = BlockPool(num_blocks, BLOCK, spec.bytes_per_block)
    return AgentCacheStore(
        spec, pool, lambda: [KVCache() for _ in range(LAYERS)], BlockCodec.for_spec(spec, bits)
    )


def held_layers(store: AgentCacheStore, agent_id: str) -> list[tuple[mx.array, mx.array]]:
    agent = store.agents[agent_id]
    return attention_kv_of(store.pool, store.spec, agent.block_ids, store.codec, agent.num_tokens)


@settings(max_examples=20, deadline=None)
@given(
    num_tokens=st.integers(min_value=1, max_value=3 * BLOCK + 5),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    bits=st.sampled_from([None, 8]),
)
def test_a_cache_restored_from_its_file_holds_the_same_blocks(
    tmp_path_factory: pytest.TempPathFactory, num_tokens: int, dtype: str, bits: int | None
) -> None:
    path = tmp_path_factory.mktemp("restore") / "agent.safetensors"
    written = a_store(dtype, bits)
    tokens = list(range(7, 7 + num_tokens))
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        keys, values = (
            mx.random.normal((1, HEADS, num_tokens, HEAD_DIM)).astype(getattr(mx, dtype)) for _ in "kv"
        )
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    written.store("agent", tokens, caches, [])
    identity = CacheIdentity("tiny", "f" * 32, BLOCK, written.spec.to_dict(), vocab_size=1000)
    write_cache_file(path, to_tensors(written.snapshot("agent")), identity)

    restored = a_store(dtype, bits)
    restored.restore(from_tensors(read_cache_file(path, identity, "agent"), restored.spec))

    assert restored.agents["agent"].token_ids == tokens
    for (keys, values), (keys_back, values_back) in zip(
        held_layers(written, "agent"), held_layers(restored, "agent"), strict=True
    ):
        assert keys_back.dtype == keys.dtype and keys_back.shape == keys.shape == (
            1,
            HEADS,
            num_tokens,
            HEAD_DIM,
        )
        if bits is None:
            assert mx.array_equal(keys_back, keys).item() and mx.array_equal(values_back, values).item()
        else:  # quantized again from its dequantized values: within one step of what was held
            assert (
                mx.allclose(keys_back, keys, atol=0.1).item()
                and mx.allclose(values_back, values, atol=0.1).item()
            )


@settings(max_examples=20, deadline=None)
@given(
    num_tokens=st.integers(min_value=2, max_value=3 * BLOCK + 5),
    num_new=st.integers(min_value=1, max_value=2 * BLOCK),
    diverge_back=st.integers(min_value=0, max_value=BLOCK),
)
def test_a_returning_turn_s_cache_has_room_and_its_batch_takes_it_without_a_copy(
    num_tokens: int, num_new: int, diverge_back: int
) -> None:
    store = a_store("float32", None)
    tokens = list(range(7, 7 + num_tokens))
    caches, history = [], []
    for _ in range(LAYERS):
        cache = KVCache()
        keys, values = (mx.random.normal((1, HEADS, num_tokens, HEAD_DIM)) for _ in "kv")
        cache.update_and_fetch(keys, values)
        caches.append(cache)
        history.append((keys, values))
    store.store("agent", tokens, caches, [])
    # The new prompt keeps the first tokens of the history and then goes its own way.
    kept = max(1, num_tokens - diverge_back)
    prompt = tokens[:kept] + list(range(5000, 5000 + num_new))

    prepared = store.prepare("agent", prompt)

    num_reused = prepared.num_cached_tokens
    assert num_reused == min(kept, len(prompt) - 1)
    new_keys = mx.random.normal((1, HEADS, len(prompt) - num_reused, HEAD_DIM))
    for layer, (keys, values) in zip(prepared.caches, history, strict=True):
        assert isinstance(layer, HistoryKVCache) and layer.offset == num_reused
        assert layer.keys.shape[2] >= len(prompt) + 1  # the prefill and the first token fit
        held = layer.keys
        assert mx.array_equal(held[..., :num_reused, :], keys[..., :num_reused, :]).item()
        assert mx.array_equal(layer.values[..., :num_reused, :], values[..., :num_reused, :]).item()

        batch = HistoryKVCache.merge([layer])

        assert batch.keys is held and layer.keys is None  # handed over, not copied
        batch_keys, _ = batch.update_and_fetch(new_keys, new_keys)
        assert batch.keys.shape == held.shape  # the new tokens went into the room
        expected = mx.concatenate([keys[..., :num_reused, :], new_keys], axis=2)
        assert mx.array_equal(batch_keys, expected).item()


def kv_caches(num_tokens: int) -> list[KVCache]:
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        cache.update_and_fetch(*(mx.random.normal((1, HEADS, num_tokens, HEAD_DIM)) for _ in "kv"))
        caches.append(cache)
    return caches


@settings(max_examples=25, deadline=None)
@given(
    running_blocks=st.integers(min_value=0, max_value=30),
    shared_blocks=st.integers(min_value=0, max_value=4),
    snapshot_blocks=st.integers(min_value=1, max_value=40),
)
def test_a_restore_that_does_not_fit_takes_no_block(
    running_blocks: int, shared_blocks: int, snapshot_blocks: int
) -> None:
    """Running sequences hold most of the pool: a cache read from disk that does not fit raises
    PoolExhaustedError (not the file's fault: it is kept, not quarantined) and leaves every block's
    references as they were; one that fits is restored."""
    store = a_store("float32", None)
    shared = list(range(1, 1 + shared_blocks * BLOCK))
    store.store("sharer", shared, kv_caches(len(shared)), [])  # its full blocks are published
    store.pin("sharer")
    running = list(range(9000, 9000 + min(running_blocks, 32 - shared_blocks) * BLOCK))
    if running:
        store.store("runner", running, kv_caches(len(running)), [])
        store.pin("runner")
    tokens = shared + list(range(5000, 5000 + (snapshot_blocks - shared_blocks) * BLOCK + 3))
    writer = a_store("float32", None, num_blocks=64)
    writer.store("returning", tokens, kv_caches(len(tokens)), [])
    snapshot = from_tensors(to_tensors(writer.snapshot("returning")), writer.spec)
    ref_counts = [block.ref_count for block in store.pool.blocks]
    hashes = set(store.pool.hash_to_block_id)
    fits = store.spec.num_blocks_for(len(tokens)) - shared_blocks <= store.pool.num_free_blocks

    if fits:
        store.restore(snapshot)
        assert store.agents["returning"].token_ids == tokens
    else:
        with pytest.raises(PoolExhaustedError):
            store.restore(snapshot)
        assert "returning" not in store.agents
        assert [block.ref_count for block in store.pool.blocks] == ref_counts
        assert set(store.pool.hash_to_block_id) <= hashes  # nothing it filed stays published


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "evict", "drop", "restore", "turn"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(min_value=1, max_value=2 * BLOCK + 3),
        ),
        max_size=12,
    )
)
def test_the_held_ids_and_the_disk_tier_follow_every_change_of_the_store(
    operations: list[tuple[str, str, int]],
) -> None:
    """`held_agent_ids`, which an agent reads from the event loop rather than ask the engine thread
    whether its cache is in memory, names exactly the agents the store holds after each change; and
    the first turn over a cache restored from disk, only that one, reports the "disk" tier."""
    store = a_store("float32", None, num_blocks=64)
    restored_unused: dict[str, bool] = {}
    for operation, agent_id, num_tokens in operations:
        tokens = list(range(100 * ord(agent_id), 100 * ord(agent_id) + num_tokens))
        if operation == "store":  # a turn's cache filed, new or replacing the agent's last
            store.store(agent_id, tokens, kv_caches(num_tokens), [])
            restored_unused[agent_id] = False
        elif operation == "evict" and agent_id in store.agents:
            store.evict(agent_id)
            restored_unused.pop(agent_id)
        elif operation == "drop":
            store.drop(agent_id)
            restored_unused.pop(agent_id, None)
        elif operation == "restore":
            writer = a_store("float32", None)
            writer.store(agent_id, tokens, kv_caches(num_tokens), [])
            store.restore(from_tensors(to_tensors(writer.snapshot(agent_id)), store.spec))
            restored_unused[agent_id] = True
        elif operation == "turn" and agent_id in store.agents:  # the agent returns with one more token
            held = store.agents[agent_id].token_ids
            prepared = store.prepare(agent_id, [*held, 1])
            assert prepared.num_cached_tokens == len(held)
            assert prepared.tier == ("disk" if restored_unused[agent_id] else "memory")
            restored_unused[agent_id] = False
        assert store.held_agent_ids == frozenset(store.agents) == frozenset(restored_unused)


def test_two_rebuilt_caches_are_merged_as_mlx_lm_merges_them() -> None:
    store = a_store("float32", None)
    for agent, length in (("short", 5), ("long", 20)):
        cache = KVCache()
        cache.update_and_fetch(mx.ones((1, HEADS, length, HEAD_DIM)), mx.ones((1, HEADS, length, HEAD_DIM)))
        store.store(agent, list(range(length)), [cache] * LAYERS, [])
    short = store.prepare("short", [*range(5), 99])
    long = store.prepare("long", [*range(20), 99])

    merged = HistoryKVCache.merge([short.caches[0], long.caches[0]])

    assert isinstance(merged, BatchKVCache) and merged.left_padding.tolist() == [15, 0]
    keys, _ = merged.keys_and_values()
    assert keys.shape[2] == 20 and short.caches[0].keys is not None  # copied, as mlx-lm does


def test_a_file_whose_layers_have_other_widths_is_refused_before_it_reaches_the_pool() -> None:
    """Another writer's file (checksum and spec as stated, tensors of other heads or widths) must not
    become blocks the model would fail on: the engine refuses it and the actor quarantines it."""
    writer = a_store("float32", None)
    tokens = list(range(7, 7 + BLOCK + 3))
    writer.store("agent", tokens, kv_caches(len(tokens)), [])
    cache = to_tensors(writer.snapshot("agent"))
    keys = cache.tensors["attn.1.keys"]
    cache.tensors["attn.1.keys"] = keys[:, :, :, : HEAD_DIM // 2]
    with pytest.raises(ValueError, match="attention layer 1's keys have 2 heads of 16, the model 2 of 32"):
        from_tensors(cache, writer.spec)
