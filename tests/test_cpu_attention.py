"""The CPU attention path: same results as MLX's own attention for every mask mlx-lm passes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask

from semantic.engine import cpu_attention, cpu_exp, cpu_kernels


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


@pytest.fixture(scope="module")
def hooked_model(default_model_dir: Path) -> Any:
    """The default model with the CPU attention hook installed, as the engine installs it at load."""
    from semantic.engine.loading import load_model

    loaded = load_model(str(default_model_dir))
    assert mx.default_device() == mx.cpu
    assert cpu_kernels.install_kernel_hooks()
    return loaded.model


def test_installing_routes_a_cpu_model_s_attention_through_the_hook(hooked_model: Any) -> None:
    from mlx_lm.models import base, llama

    hook = llama.scaled_dot_product_attention
    assert hook is not base.scaled_dot_product_attention
    assert getattr(hook, "__wrapped__", None) is base.scaled_dot_product_attention


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
        with cpu_kernels.cpu_kernels_on_this_thread():
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
    with cpu_kernels.cpu_kernels_on_this_thread():
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
    with cpu_kernels.cpu_kernels_on_this_thread():
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
    with cpu_kernels.cpu_kernels_on_this_thread():
        hook(queries, keys, values, cache, scale=0.125, mask=mask & mask)
        hook(queries, keys, values, cache, scale=0.125, mask=elsewhere)
    assert [type(mask) for mask in seen] == [mx.array, mx.array]
