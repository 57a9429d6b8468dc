"""Idle caches kept quantized (`--idle-kv-bits`): the codec's arithmetic, and the real engine."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import mlx.core as mx
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from semantic.actors.engine_client import Engine, EngineConfig
from semantic.engine.cache_store.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.cache_store.layer_caches import BlockCodec, block_payload
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool, RestoreCache, TakeCache
from semantic.engine.loop.messages import Finished, GenerationRequest, PromptStarted, TokenDelta


def spec_of(heads: int, head_dim: int, dtype: str, layers: int = 2, block_size: int = 32) -> ModelCacheSpec:
    kinds = (LayerKind.FULL,) * layers
    return ModelCacheSpec(layers, heads, head_dim, dtype, kinds, None, block_size)


@settings(max_examples=25, deadline=None)
@given(
    heads=st.integers(min_value=1, max_value=4),
    head_dim=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    bits=st.sampled_from([4, 8]),
)
def test_a_quantized_block_takes_the_bytes_the_budget_counts(
    heads: int, head_dim: int, dtype: str, bits: int
) -> None:
    spec = spec_of(heads, head_dim, dtype)
    codec = BlockCodec.for_spec(spec, bits)
    layer = mx.random.normal((1, heads, spec.block_size, head_dim)).astype(getattr(mx, dtype))
    payload = block_payload([(layer, layer, 0)] * spec.num_layers, 0, spec.block_size, codec.encode)
    held = sum(part.nbytes for keys, values in payload for part in (*keys, *values))
    assert held == codec.bytes_per_block(spec)
    assert codec.bytes_per_block(spec) < spec.bytes_per_block
    restored = codec.decode(payload[0][0])
    assert restored.dtype == layer.dtype and restored.shape == layer.shape
    # Group-wise affine quantization: each value within one step of the range, plus the rounding of
    # a half-precision scale, bias and result.
    original = layer.astype(mx.float32)
    step = (original.max() - original.min()) / (2**bits - 1)
    rounding = {"float32": 0.0, "float16": 2**-10, "bfloat16": 2**-7}[dtype] * 4 * mx.abs(original).max()
    assert mx.all(mx.abs(restored.astype(mx.float32) - original) <= step + rounding).item()


def test_full_precision_blocks_are_kept_as_computed() -> None:
    spec = spec_of(2, 64, "float32")
    codec = BlockCodec.for_spec(spec, None)
    layer = mx.random.normal((1, 2, spec.block_size, 64))
    payload = block_payload([(layer, layer, 0)], 0, spec.block_size, codec.encode)
    assert mx.array_equal(codec.decode(payload[0][0]), layer).item()
    assert codec.bytes_per_block(spec) == spec.bytes_per_block


def test_a_model_whose_head_dim_cannot_be_grouped_is_refused() -> None:
    with pytest.raises(ValueError, match="head dims divisible by 32"):
        BlockCodec.for_spec(spec_of(2, 80, "float32"), 8)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(default_model_dir: Path) -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model=str(default_model_dir), cache_budget_mb=256, idle_kv_bits=8))
    await engine.start()
    yield engine
    await engine.stop()


async def run(engine: Engine, prompt: list[int], agent_id: str) -> tuple[PromptStarted, list[int]]:
    stream = engine.submit(
        GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=8), agent_id=agent_id)
    )
    started, tokens = None, []
    async for event in stream:
        if isinstance(event, PromptStarted):
            started = event
        elif isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            assert event.reason.value in ("stop", "length")
    assert started is not None
    return started, tokens


@pytest.mark.asyncio(loop_scope="module")
async def test_the_same_budget_holds_more_blocks_and_a_returning_agent_reuses_its_cache(
    engine: Engine, default_model_dir: Path
) -> None:
    spec = engine.model.spec
    report = await engine.ask(InspectPool())
    full_precision_blocks = 256 * 2**20 // spec.bytes_per_block
    assert report.num_blocks >= 3 * full_precision_blocks  # fp32 KV at 8 bits: 3.6x

    tokenizer = engine.model.tokenizer
    history = [{"role": "user", "content": "Tell me about ships. " * 60}]
    first_prompt = list(tokenizer.apply_chat_template(history, add_generation_prompt=True))
    _, reply = await run(engine, first_prompt, "sailor")
    history += [
        {"role": "assistant", "content": tokenizer.decode(reply)},
        {"role": "user", "content": "And boats?"},
    ]
    second_prompt = list(tokenizer.apply_chat_template(history, add_generation_prompt=True))
    started, second_reply = await run(engine, second_prompt, "sailor")
    assert started.num_cached_tokens >= len(first_prompt) - 1  # started from its (quantized) cache
    assert second_reply

    # Out to a file's tensors (at the model's dtype) and back into quantized blocks.
    serialized = await engine.ask(TakeCache("sailor"))
    assert serialized is not None
    keys = serialized.tensors["attn.0.keys"]
    assert keys.shape[-1] == spec.head_dim and keys.itemsize == spec.dtype_size  # not the packed form
    assert await engine.ask(RestoreCache(serialized, engine.model.fingerprint))
    history += [
        {"role": "assistant", "content": tokenizer.decode(second_reply)},
        {"role": "user", "content": "Why?"},
    ]
    third_prompt = list(tokenizer.apply_chat_template(history, add_generation_prompt=True))
    started, third_reply = await run(engine, third_prompt, "sailor")
    assert started.num_cached_tokens >= len(second_prompt) - 1
    assert third_reply
