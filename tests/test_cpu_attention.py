"""The CPU attention path: same results as MLX's own attention for every mask mlx-lm passes."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask

from semantic.engine.cpu import cpu_attention, cpu_exp
from semantic.engine.mlx_adapter import model_hooks


def test_exp2_matches_numpy_over_the_range_it_is_used_on() -> None:
    t = np.linspace(-126.0, 0.0, 200_001, dtype=np.float32)
    ours = np.array(cpu_exp.exp2(mx.array(t)))
    relative = np.abs(ours - np.exp2(t.astype(np.float64))) / np.exp2(t.astype(np.float64))
    assert relative.max() < 5e-7


@st.composite
def attention_inputs(draw: st.DrawFn) -> tuple[mx.array, mx.array, mx.array, object]:
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    repeats = draw(st.sampled_from([1, 3]))
    length = draw(st.integers(1, 48))
    cached = draw(st.integers(0, 200))
    dims = draw(st.sampled_from([8, 64]))
    total = cached + length
    seed = draw(st.integers(0, 2**16))
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    queries = mx.random.normal((batch, kv_heads * repeats, length, dims), key=k1)
    keys = mx.random.normal((batch, kv_heads, total, dims), key=k2) * 3
    values = mx.random.normal((batch, kv_heads, total, dims), key=k3)
    kind = draw(st.sampled_from(["none", "causal", "bool", "additive", "padded causal"]))
    mask: object = None
    if kind == "causal":
        mask = "causal"
    elif kind == "padded causal":
        # A batch cache's mask as mlx-lm makes it, told apart as the engine thread's hook tells it.
        padding = [draw(st.integers(0, cached)) for _ in range(batch)]
        array = create_causal_mask(length, cached, left_padding=mx.array(padding))
        mask = cpu_attention.PaddedCausal(array, max(padding))
    elif kind in ("bool", "additive"):
        # What BatchKVCache passes: causal and left padding per sequence, shape [B, 1, L, S].
        padding = mx.array([draw(st.integers(0, cached)) for _ in range(batch)])
        causal = mx.arange(cached, total)[:, None] >= mx.arange(total)[None]
        keep = causal[None, None] & (mx.arange(total)[None, None, None] >= padding[:, None, None, None])
        mask = (
            keep if kind == "bool" else mx.where(keep, 0.0, -1e9) + 0.1 * mx.random.normal(keep.shape, key=k4)
        )
    return queries, keys, values, mask


@settings(max_examples=60, deadline=None)
@given(attention_inputs())
def test_attention_equals_mlx_scaled_dot_product_attention(
    inputs: tuple[mx.array, mx.array, mx.array, object],
) -> None:
    queries, keys, values, mask = inputs
    scale = queries.shape[-1] ** -0.5
    theirs = mask.array if isinstance(mask, cpu_attention.PaddedCausal) else mask
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=theirs)  # type: ignore[arg-type]
    ours = cpu_attention.attention(queries, keys, values, scale, mask)  # type: ignore[arg-type]
    np.testing.assert_allclose(np.array(ours), np.array(expected), rtol=1e-4, atol=2e-5)


SECOND_STREAM = mx.new_stream(mx.cpu)


@settings(max_examples=60, deadline=None)
@given(attention_inputs())
def test_attention_split_over_two_streams_agrees_to_float32_rounding(
    inputs: tuple[mx.array, mx.array, mx.array, object],
) -> None:
    """Half the query positions' weights on a second stream: each row's work is what it was, but
    for the rounding of BLAS products over fewer rows (one float32 ulp in about a third of these)."""
    queries, keys, values, mask = inputs
    scale = queries.shape[-1] ** -0.5
    alone = cpu_attention.attention(queries, keys, values, scale, mask)  # type: ignore[arg-type]
    split = cpu_attention.attention(queries, keys, values, scale, mask, SECOND_STREAM)  # type: ignore[arg-type]
    np.testing.assert_allclose(np.array(split), np.array(alone), rtol=1e-6, atol=1e-6)


def test_softmax_matches_mlx_for_wide_rows_of_any_scale() -> None:
    scores = mx.random.normal((1, 3, 3, 300, 700), key=mx.random.key(1)) * 40
    np.testing.assert_allclose(
        np.array(cpu_exp.softmax(scores)), np.array(mx.softmax(scores, axis=-1)), rtol=1e-5, atol=1e-7
    )


def test_softmax_gives_no_denormal_weights() -> None:
    """Masked scores (the dtype's minimum, as the tool model's training masks them) and scores far
    below the row's maximum weigh exactly zero, never a denormal that slows every matmul after."""
    scores = mx.random.normal((2, 64, 256), key=mx.random.key(5)) * 3
    causal = mx.arange(256)[None] <= mx.arange(192, 256)[:, None]
    scores = mx.where(causal, scores, mx.finfo(mx.float32).min)
    scores[:, :, 0] = 200.0  # a sink: the others ~200 nats below, past the exponential's floor
    weights = np.array(cpu_exp.softmax(scores))
    assert not ((weights > 0) & (weights < np.finfo(np.float32).tiny)).any()
    assert (weights[:, ~np.array(causal)] == 0).all()
    np.testing.assert_allclose(weights, np.array(mx.softmax(scores, axis=-1)), rtol=1e-5, atol=1e-7)


def test_a_row_with_every_position_masked_comes_out_zero_not_nan() -> None:
    queries = mx.random.normal((1, 2, 3, 8), key=mx.random.key(2))
    keys = mx.random.normal((1, 2, 5, 8), key=mx.random.key(3))
    values = mx.random.normal((1, 2, 5, 8), key=mx.random.key(4))
    keep = mx.ones((1, 1, 3, 5), dtype=mx.bool_)
    keep[:, :, 0, :] = False  # a padding row
    out = np.array(cpu_attention.attention(queries, keys, values, 0.35, keep))
    assert np.isfinite(out).all() and not out[:, :, 0].any()
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.35, mask=keep)
    np.testing.assert_allclose(out[:, :, 1:], np.array(expected)[:, :, 1:], rtol=1e-4, atol=2e-5)


def test_one_query_over_a_long_history_equals_mlx() -> None:
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    queries = mx.random.normal((2, 9, 1, 64), key=k1)
    keys = mx.random.normal((2, 3, 5000, 64), key=k2) * 3
    values = mx.random.normal((2, 3, 5000, 64), key=k3)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=None)
    ours = cpu_attention.attention(queries, keys, values, 0.125, None)
    np.testing.assert_allclose(np.array(ours), np.array(expected), rtol=1e-4, atol=2e-5)


DEFAULT_MIN_SCORES = cpu_attention.MIN_SCORES


@pytest.fixture(autouse=True)
def _our_kernel_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check what our kernel computes and where the hook sends a call, on shapes small
    enough to run fast: below `MIN_SCORES` the hook would send them all to MLX's own."""
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)


@pytest.fixture(scope="module")
def hooked_model(default_model_dir: Path) -> Any:
    """The default model with the CPU attention hook installed, as the engine installs it at load."""
    from semantic.engine.model.loading import load_model

    loaded = load_model(str(default_model_dir))
    assert mx.default_device() == mx.cpu
    assert model_hooks.install_kernel_hooks()
    return loaded.model


def test_installing_routes_a_cpu_model_s_attention_through_the_hook(hooked_model: Any) -> None:
    from mlx_lm.models import base, llama

    hook = llama.scaled_dot_product_attention
    assert hook is not base.scaled_dot_product_attention
    assert getattr(hook, "__wrapped__", None) is base.scaled_dot_product_attention


def test_a_call_with_few_scores_goes_to_mlx_s_own_attention(
    hooked_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step over a short history: our kernel's new trace per key length costs more than
    MLX's scalar exponential over so few scores."""
    from mlx_lm.models import llama

    monkeypatch.setattr(cpu_attention, "MIN_SCORES", DEFAULT_MIN_SCORES)
    ours: list[tuple[int, ...]] = []
    attention = cpu_attention.attention

    def spy(queries: mx.array, keys: mx.array, *rest: Any) -> mx.array:
        ours.append(keys.shape)
        return attention(queries, keys, *rest)

    monkeypatch.setattr(cpu_attention, "attention", spy)
    hook = llama.scaled_dot_product_attention
    query = mx.random.normal((1, 9, 1, 64))
    num_long = DEFAULT_MIN_SCORES // 9 + 1
    with model_hooks.cpu_kernels_on_this_thread():
        for num_keys in (200, num_long):
            keys, values = mx.random.normal((1, 3, num_keys, 64)), mx.random.normal((1, 3, num_keys, 64))
            out = hook(query, keys, values, None, scale=0.125, mask=None)
            expected = mx.fast.scaled_dot_product_attention(query, keys, values, scale=0.125, mask=None)
            np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-4, atol=2e-5)
    assert ours == [(1, 3, num_long, 64)]


def test_the_hook_uses_our_attention_only_on_the_thread_that_enables_it(hooked_model: Any) -> None:
    from mlx_lm.models import base, llama

    hook = llama.scaled_dot_product_attention
    k1, k2, k3 = mx.random.split(mx.random.key(3), 3)
    queries = mx.random.normal((1, 9, 40, 64), key=k1)
    keys = mx.random.normal((1, 3, 40, 64), key=k2) * 3
    values = mx.random.normal((1, 3, 40, 64), key=k3)

    def call(function: Any) -> np.ndarray:
        return np.array(function(queries, keys, values, None, scale=0.125, mask="causal"))

    original = call(base.scaled_dot_product_attention)
    ours = np.array(cpu_attention.attention(queries, keys, values, 0.125, "causal"))
    assert not np.array_equal(ours, original)  # the two paths are told apart by their bits
    enabled, release = threading.Event(), threading.Event()
    from_engine_thread: list[np.ndarray] = []

    def engine_thread() -> None:
        with model_hooks.cpu_kernels_on_this_thread():
            from_engine_thread.append(call(hook))
            enabled.set()
            release.wait(30)  # the flag stays set here while another thread calls the hook

    thread = threading.Thread(target=engine_thread)
    thread.start()
    try:
        assert enabled.wait(30)
        np.testing.assert_array_equal(call(hook), original)
    finally:
        release.set()
        thread.join()
    np.testing.assert_array_equal(from_engine_thread[0], ours)


def test_a_model_run_off_the_engine_thread_gives_mlx_lm_s_exact_logits(
    hooked_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.models import base, llama

    tokens = mx.array([list(range(100, 160))])
    hooked = np.array(hooked_model(tokens))
    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    np.testing.assert_array_equal(hooked, np.array(hooked_model(tokens)))


def test_a_batch_cache_s_mask_made_on_the_engine_thread_is_attended_as_a_padded_causal_mask(
    hooked_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache

    seen: list[object] = []

    def spy(
        queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, *rest: Any
    ) -> mx.array:
        seen.append(mask)
        return attention(queries, keys, values, scale, mask, *rest)

    attention = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", spy)
    hook = llama.scaled_dot_product_attention
    k1, k2, k3 = mx.random.split(mx.random.key(7), 3)
    cache = BatchKVCache(left_padding=[70, 0])
    cache.update_and_fetch(*(mx.random.normal((2, 3, 200, 64), key=k) for k in (k1, k2)))
    queries = mx.random.normal((2, 9, 12, 64), key=k3)
    with model_hooks.cpu_kernels_on_this_thread():
        mask = cache.make_mask(12)
        keys, values = cache.update_and_fetch(queries[:, :3] * 2, queries[:, 3:6])
        ours = hook(queries, keys, values, cache, scale=0.125, mask=mask)
    (padded,) = seen
    assert isinstance(padded, cpu_attention.PaddedCausal) and padded.array is mask
    assert padded.max_left_padding == 70
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(expected), rtol=1e-4, atol=2e-5)
    # A decode step's one-row mask is applied whole (reading its padding would wait on the step
    # before it).
    seen.clear()
    query = queries[:, :, :1]
    with model_hooks.cpu_kernels_on_this_thread():
        row = cache.make_mask(1)
        keys, values = cache.update_and_fetch(query[:, :3], query[:, 3:6])
        one = hook(query, keys, values, cache, scale=0.125, mask=row)
    assert len(seen) == 1 and seen[0] is row
    expected = mx.fast.scaled_dot_product_attention(query, keys, values, scale=0.125, mask=row)
    np.testing.assert_allclose(np.array(one), np.array(expected), rtol=1e-4, atol=2e-5)
    cache.offset -= 1
    cache._idx -= 1
    keys, values = keys[..., :-1, :], values[..., :-1, :]
    # Changed after it was made, or made off the engine thread: the array is applied whole.
    seen.clear()
    cache.offset -= 12
    cache._idx -= 12
    elsewhere = cache.make_mask(12)
    with model_hooks.cpu_kernels_on_this_thread():
        hook(queries, keys, values, cache, scale=0.125, mask=mask & mask)
        hook(queries, keys, values, cache, scale=0.125, mask=elsewhere)
    assert [type(mask) for mask in seen] == [mx.array, mx.array]


@st.composite
def mla_inputs(draw: st.DrawFn) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Inputs as MLA models (DeepSeek V3, GLM-4 MoE Lite, Kimi) and others hand MLX's attention: a
    mask per query head or broadcast over any axes, one latent KV head for every query head (MLA's
    decode), values of another head size than the keys (MLA's prefill)."""
    batch = draw(st.integers(1, 2))
    heads = draw(st.sampled_from([1, 2, 4, 6]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, heads) if heads % k == 0]))
    length = draw(st.integers(1, 24))
    cached = draw(st.integers(0, 150))
    key_dims, value_dims = draw(st.sampled_from([8, 24])), draw(st.sampled_from([8, 16, 40]))
    total = cached + length
    k1, k2, k3, k4 = mx.random.split(mx.random.key(draw(st.integers(0, 2**16))), 4)
    queries = mx.random.normal((batch, heads, length, key_dims), key=k1)
    keys = mx.random.normal((batch, kv_heads, total, key_dims), key=k2) * 3
    values = mx.random.normal((batch, kv_heads, total, value_dims), key=k3)
    full = (batch, heads, length, total)
    # Each axis of [B, heads, L, S] kept or broadcast (1), and leading broadcast axes dropped.
    kept = [draw(st.booleans()) for _ in full]
    shape = tuple(size if keep else 1 for size, keep in zip(full, kept, strict=True))
    num_dropped = draw(st.integers(0, [*kept, True].index(True)))
    shape = shape[min(num_dropped, 3) :]
    # Causal with holes, but the first column and each row's own position always visible: no row
    # is wholly masked, however the mask is broadcast.
    rows, columns = mx.arange(cached, total)[:, None], mx.arange(total)[None]
    holes = mx.random.uniform(shape=full, key=k4) < 0.8
    visible = (rows >= columns) & holes | (rows == columns) | (columns == 0)
    visible = visible[tuple(slice(None) if keep else slice(0, 1) for keep in kept)].reshape(shape)
    if draw(st.booleans()):
        return queries, keys, values, visible
    # MLA's mask: its RoPE scores where visible, the dtype's minimum elsewhere.
    rope_scores = mx.random.normal(shape, key=k4) * 2
    return queries, keys, values, mx.where(visible, rope_scores, mx.finfo(mx.float32).min)


@settings(max_examples=80, deadline=None)
@given(mla_inputs())
def test_attention_equals_mlx_for_per_head_and_broadcast_masks_and_other_value_sizes(
    inputs: tuple[mx.array, mx.array, mx.array, mx.array],
) -> None:
    queries, keys, values, mask = inputs
    assert cpu_attention.supports(queries, keys, values, mask)
    scale = queries.shape[-1] ** -0.5
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    ours = cpu_attention.attention(queries, keys, values, scale, mask)
    np.testing.assert_allclose(np.array(ours), np.array(expected), rtol=1e-4, atol=2e-5)


def test_the_hook_gives_what_ours_does_not_support_to_mlx_s_own(hooked_model: Any) -> None:
    from mlx_lm.models import llama

    hook = llama.scaled_dot_product_attention
    k1, k2, k3 = mx.random.split(mx.random.key(11), 3)
    queries = mx.random.normal((1, 4, 9, 16), key=k1)
    keys = mx.random.normal((1, 2, 6, 16), key=k2)
    values = mx.random.normal((1, 2, 6, 16), key=k3)
    integer_bias = mx.arange(54).reshape(9, 6) % 3 - 1
    for mask in (integer_bias, "causal"):  # an integer mask; more queries than keys under "causal"
        assert not cpu_attention.supports(queries, keys, values, mask)
        expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
        with model_hooks.cpu_kernels_on_this_thread():
            ours = hook(queries, keys, values, None, scale=0.25, mask=mask)  # type: ignore[arg-type]
        np.testing.assert_array_equal(np.array(ours), np.array(expected))
    wrong_heads = mx.zeros((1, 2, 9, 6))  # neither one mask for all heads nor one per query head
    assert not cpu_attention.supports(queries, keys, values, wrong_heads)
    with model_hooks.cpu_kernels_on_this_thread(), pytest.raises(ValueError, match="broadcast"):
        mx.eval(hook(queries, keys, values, None, scale=0.25, mask=wrong_heads))


# DeepSeek V3 at a tiny size: multi-head latent attention (values of another head size than the keys'
# nope part), a dense first layer, then routed and shared experts.
TINY_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}


async def _reply(system: Any, agent_id: str, prompt: list[int], max_tokens: int) -> tuple[list[int], Any]:
    from semantic.actors.turns import TurnRequest
    from semantic.engine.decoding.sampling import SamplingParams
    from semantic.engine.loop.messages import PromptStarted, TokenDelta
    from semantic.storage.agent_id import AgentId

    turn = TurnRequest(
        uuid.uuid4().hex,
        AgentId(agent_id),
        [],
        SamplingParams(max_tokens=max_tokens),
        prompt_token_ids=prompt,
    )
    started, tokens = None, []
    async for event in (await system.start_turn(turn)).stream:
        if isinstance(event, PromptStarted):
            started = event
        elif isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
    eos = system.engine.model.eos_token_ids
    return [token for token in tokens if token not in eos], started


@pytest.mark.asyncio
async def test_a_tiny_deepseek_v3_through_the_engine_gives_mlx_lm_s_tokens(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold turn and the agent's next turn from its cache, token for token against mlx-lm's own
    generation (run here, off the engine thread, so with MLX's attention); MLA's decode steps hand
    the hook a mask per query head over one latent KV head."""
    from semantic.actors.engine_client import EngineConfig
    from semantic.actors.system import AgentSystem, SystemConfig
    from tests.agent_api_client import cold_continuation
    from tests.tiny_models import write_random_model

    model_dir = write_random_model(dict(TINY_DEEPSEEK_V3), tmp_path / "model", default_model_dir)
    calls: list[tuple[int, int, tuple[int, ...]]] = []
    attention = cpu_attention.attention

    def spy(
        queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any, *rest: Any
    ) -> mx.array:
        mask_shape = tuple(mask.shape) if isinstance(mask, mx.array) else ()
        calls.append((queries.shape[1], keys.shape[1], mask_shape))
        return attention(queries, keys, values, scale, mask, *rest)

    monkeypatch.setattr(cpu_attention, "attention", spy)
    config = SystemConfig(engine=EngineConfig(model=str(model_dir)), cache_dir=tmp_path / "cache")
    async with AgentSystem(config) as system:
        tokenizer = system.engine.model.tokenizer
        first = [{"role": "user", "content": "Hello there! Who are you, and where do you live?"}]
        prompt = list(tokenizer.apply_chat_template(first, add_generation_prompt=True))
        tokens, started = await _reply(system, "mla", prompt, 12)
        assert tokens == cold_continuation(model_dir, prompt, 12)
        assert len(set(tokens)) > 3  # a reply that varies, not one repeated token
        follow_up = "\n<|im_start|>user\nTell me about the moon.<|im_end|>\n<|im_start|>assistant\n"
        prompt = prompt + tokens + tokenizer.encode(follow_up, add_special_tokens=False)
        tokens, started = await _reply(system, "mla", prompt, 12)
        assert started.num_cached_tokens > 0
        assert tokens == cold_continuation(model_dir, prompt, 12)
        assert len(set(tokens)) > 3
    heads = TINY_DEEPSEEK_V3["num_attention_heads"]
    assert (heads, 1, (1, heads, 1)) in {(q, k, shape[:3]) for q, k, shape in calls}
