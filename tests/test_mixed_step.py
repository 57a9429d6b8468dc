"""Decode rows and a prompt chunk in one forward pass (engine/mlx_adapter/mixed_step.py, mixing_generator.py).

On the real model stepped by hand: a stream decodes while a cold prompt is prefilled beside it in
chunks; with packed passes and with mlx-lm's two passes alike, both replies equal mlx-lm's own
greedy output and every prompt token runs once. The packed pass itself equals the two passes'
logits and caches, on the real model and on tiny random-weight models of other architectures; a
sliding-window model keeps two passes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

from semantic.engine.cpu import cpu_attention
from semantic.engine.loop.messages import Finished, PromptProgress, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.mlx_adapter import generator_seams, model_hooks
from semantic.engine.mlx_adapter.batch_joins import JoiningBatchKVCache
from semantic.engine.mlx_adapter.last_token_fold import forked_sources_match, last_position_head
from semantic.engine.mlx_adapter.mixed_step import (
    MixedForward,
    PackedLayerCache,
    _batch_caches,
    chunk_mask,
    mixed_forward_for,
)
from semantic.engine.mlx_adapter.mixing_generator import MixingBatchGenerator
from tests.batch_driver import chat, deliver, drain, loop, outbox, served, submit

__all__ = ["loop", "outbox", "served"]  # fixtures

pytestmark = pytest.mark.skipif(
    not forked_sources_match(), reason="the installed mlx-lm is not the one `_next` was forked from"
)


@pytest.fixture(params=["one pass", "two passes"])
def passes(served: ServedModel, request: pytest.FixtureRequest) -> Iterator[str]:
    """The batch with the mixing generator, or with the folding one alone; put back after."""
    batch = served.batch
    mixed = batch._generators.mixed
    assert mixed is not None  # SmolLM2 packs
    if request.param == "two passes":
        batch._generators.mixed = None
        batch._generator = batch._generators()
    assert isinstance(batch._generator, MixingBatchGenerator) == (request.param == "one pass")
    yield request.param
    batch._generators.mixed = mixed
    batch._generator = batch._generators()


def test_a_prompt_prefilled_beside_a_decoding_stream_gives_mlx_lm_s_tokens(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, passes: str
) -> None:
    batch = served.batch
    generator = batch._generator
    streaming = chat(served, f"{uuid.uuid4().hex} Write a short poem about the sea.")
    cold = chat(served, f"{uuid.uuid4().hex} " + "Summarise these notes for me. " * 40)
    chunk = 64
    assert len(cold) > batch.prefill_budget.short_turn_tokens  # not a short turn: cut into the test's chunks
    stream = submit(served, loop, streaming, 24)
    steps = 0
    while not any(isinstance(e, TokenDelta) for e in drain(stream)):  # the stream is decoding
        batch.step(chunk)
        deliver(served, outbox, loop)
        steps += 1
        assert steps < 20
    processed_before = generator_seams.num_prompt_tokens_processed(generator)
    mixed_before = getattr(generator, "num_mixed_steps", 0)
    prompt = submit(served, loop, cold, 6)

    events: dict[str, list[object]] = {"stream": [], "prompt": []}
    decode_cache_types: set[type] = set()
    while not all(any(isinstance(e, Finished) for e in got) for got in events.values()):
        steps += 1
        assert steps < 100, "the requests did not finish"
        batch.step(chunk)
        decode_cache_types |= {type(c) for c in generator._generation_batch.prompt_cache}
        deliver(served, outbox, loop)
        events["stream"] += drain(stream)
        events["prompt"] += drain(prompt)

    eos = served.loaded.eos_token_ids

    def tokens(got: list[object]) -> list[int]:
        (finished,) = [e for e in got if isinstance(e, Finished)]
        return [t for t in finished.generated_token_ids if t not in eos]

    assert tokens(events["stream"]) == served.reference_generate(streaming, 24)
    assert tokens(events["prompt"]) == served.reference_generate(cold, 6)
    assert decode_cache_types == {JoiningBatchKVCache}  # the prompt joined the stream's batch at one copy
    # The cold prompt went in chunks while the stream decoded, each token once (the fold counts the last).
    assert generator_seams.num_prompt_tokens_processed(generator) - processed_before == len(cold)
    progress = [e.num_processed for e in events["prompt"] if isinstance(e, PromptProgress)]
    assert len(progress) >= 3 and progress == sorted(progress)
    num_mixed = getattr(generator, "num_mixed_steps", 0) - mixed_before
    if passes == "one pass":
        assert num_mixed >= len(cold) // chunk  # every chunk shared its pass with the stream's step
    else:
        assert num_mixed == 0


def packed_against_two_passes(model: object) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A packed pass and mlx-lm's two passes from the same caches: decode and last-chunk logits of each."""
    split = last_position_head(model)
    mixed = mixed_forward_for(model, split)
    assert mixed is not None
    decode_histories, prompt_history = [[5, 6, 7, 8, 9, 10], [11, 12]], [13, 14, 15, 16, 17]
    decode_tokens, chunk = [18, 19], [20, 21, 22, 23]
    decode = _batch_caches(model, decode_histories)
    prompt = _batch_caches(model, [prompt_history])
    ours, ours_last = mixed(mx.array(decode_tokens), decode, chunk, prompt, True)
    assert ours_last is not None
    decode_ref = _batch_caches(model, decode_histories)
    prompt_ref = _batch_caches(model, [prompt_history])
    theirs = model(mx.array(decode_tokens)[:, None], cache=decode_ref)  # type: ignore[operator]
    theirs_last = model(mx.array([chunk]), cache=prompt_ref)[:, -1:, :]  # type: ignore[operator]
    for packed, alone in zip([*decode, *prompt], [*decode_ref, *prompt_ref], strict=True):
        assert packed._idx == alone._idx
        assert mx.allclose(packed.keys[..., : packed._idx, :], alone.keys[..., : alone._idx, :], atol=1e-5)
    return ours, theirs, ours_last, theirs_last


def test_the_packed_pass_gives_the_two_passes_logits_and_caches_on_the_real_model(
    default_model_dir: Path,
) -> None:
    model, _ = load(str(default_model_dir))
    model_hooks.install_kernel_hooks()
    ours, theirs, ours_last, theirs_last = packed_against_two_passes(model)
    assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert mx.allclose(ours_last, theirs_last, rtol=1e-4, atol=1e-4)
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))


def test_other_architectures_pack_where_their_layers_allow(tiny_model_dirs: dict[str, Path]) -> None:
    qwen2, _ = load(str(tiny_model_dirs["qwen2"]))  # attention biases, tied embeddings
    model_hooks.install_kernel_hooks()
    ours, theirs, ours_last, theirs_last = packed_against_two_passes(qwen2)
    assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert mx.allclose(ours_last, theirs_last, rtol=1e-4, atol=1e-4)
    gemma3, _ = load(str(tiny_model_dirs["gemma3"]))  # sliding-window layers keep rotating caches
    model_hooks.install_kernel_hooks()
    assert mixed_forward_for(gemma3, last_position_head(gemma3)) is None


def test_the_load_probe_turns_packing_down_when_it_changes_the_results(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    qwen2, _ = load(str(tiny_model_dirs["qwen2"]))
    model_hooks.install_kernel_hooks()
    assert mixed_forward_for(qwen2, last_position_head(qwen2)) is not None
    packed = MixedForward.__call__

    def off_by_a_little(self: MixedForward, *args: Any) -> tuple[mx.array, mx.array | None]:
        decode_logits, last_logits = packed(self, *args)
        return decode_logits + 1e-2, last_logits

    monkeypatch.setattr(MixedForward, "__call__", off_by_a_little)
    assert mixed_forward_for(qwen2, last_position_head(qwen2)) is None


def test_a_packed_layer_cache_splits_rows_between_the_two_caches() -> None:
    decode, prompt = BatchKVCache([1, 0]), BatchKVCache([0])
    decode.update_and_fetch(mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    offset = mx.array([2, 3, 0, 1, 2])
    packed = PackedLayerCache(decode, prompt, 2, offset, None, None)
    rows = mx.arange(5 * 4, dtype=mx.float32).reshape(5, 1, 1, 4)  # two decode rows, a chunk of three
    keys, values = packed.update_and_fetch(rows, rows + 100)
    assert keys.decode.shape == (2, 1, 4, 4) and keys.prompt.shape == (1, 1, 3, 4)
    assert mx.array_equal(keys.decode[:, :, -1], rows[:2, :, 0])
    assert mx.array_equal(keys.prompt[0, 0], rows[2:, 0, 0])
    assert mx.array_equal(values.prompt[0, 0], rows[2:, 0, 0] + 100)
    assert decode._idx == 4 and prompt._idx == 3 and packed.make_mask(1) is None


@pytest.mark.parametrize("padding", [[0], [2], [0, 1]])
def test_a_lone_unpadded_prompt_s_chunk_is_masked_causal_and_attends_as_the_cache_s_own_mask(
    padding: list[int],
) -> None:
    """The mask "causal" only where it is the one the cache would make: one prompt, no left padding."""
    cache = BatchKVCache(padding)
    batch, cached, chunk = len(padding), 70, 9
    cache.update_and_fetch(mx.zeros((batch, 3, cached, 64)), mx.zeros((batch, 3, cached, 64)))
    mask = chunk_mask(cache, chunk)
    own = cache.make_mask(chunk)
    assert (isinstance(mask, str) and mask == "causal") == (padding == [0])
    k1, k2, k3 = mx.random.split(mx.random.key(7), 3)
    queries = mx.random.normal((batch, 9, chunk, 64), key=k1)
    keys = mx.random.normal((batch, 3, cached + chunk, 64), key=k2) * 3
    values = mx.random.normal((batch, 3, cached + chunk, 64), key=k3)
    ours = cpu_attention.attention(queries, keys, values, 0.125, mask)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=own)
    assert mx.allclose(ours, expected, rtol=1e-4, atol=2e-5)
