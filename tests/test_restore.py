"""An agent's cache written to a real file and restored into a fresh pool holds what it held: the
same tokens and, block by block, the same keys and values (for every dtype and with idle bits)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from semantic.engine.agent_cache import AgentCacheStore
from semantic.engine.block_pool import BlockPool
from semantic.engine.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.cache_tensors import from_tensors, to_tensors
from semantic.engine.layer_caches import BlockCodec, full_layers_of
from semantic.storage.cache_file import CacheIdentity, read_cache_file, write_cache_file

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 16


def a_store(dtype: str, bits: int | None) -> AgentCacheStore:
    spec = ModelCacheSpec(LAYERS, HEADS, HEAD_DIM, dtype, (LayerKind.FULL,) * LAYERS, None, BLOCK)
    pool = BlockPool(32, BLOCK, spec.bytes_per_block)
    return AgentCacheStore(
        spec, pool, lambda: [KVCache() for _ in range(LAYERS)], BlockCodec.for_spec(spec, bits)
    )


def held_layers(store: AgentCacheStore, agent_id: str) -> list[tuple[mx.array, mx.array]]:
    block_ids = store.agents[agent_id].block_ids
    return full_layers_of(store.pool, store.spec, block_ids, store.codec)


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
    restored.restore(from_tensors(read_cache_file(path, identity, "agent"), dtype, LAYERS, 0))

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
