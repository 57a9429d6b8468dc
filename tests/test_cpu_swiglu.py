"""SwiGLU with the polynomial exponential (engine/cpu/cpu_swiglu.py): as exact as mlx-lm's own, and
hooked into mlx-lm's models only on the engine thread and only for float32."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations

from semantic.engine.cpu import cpu_swiglu
from semantic.engine.mlx_adapter import model_hooks


def test_swiglu_is_as_exact_as_mlx_lm_s_over_the_float_range() -> None:
    gate = np.linspace(-120, 120, 400_001, dtype=np.float32)
    x = np.linspace(-3, 3, gate.size, dtype=np.float32)
    exact = gate.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64))) * x
    ours = np.array(cpu_swiglu.swiglu(mx.array(gate), mx.array(x)), dtype=np.float64)
    theirs = np.array(activations.swiglu(mx.array(gate), mx.array(x)), dtype=np.float64)
    visible = np.abs(exact) > 1e-6
    error = np.abs(ours - exact)[visible] / np.abs(exact)[visible]
    their_error = np.abs(theirs - exact)[visible] / np.abs(exact)[visible]
    assert error.max() < max(2 * their_error.max(), 2e-6)
    assert np.all(np.abs(ours[~visible]) < 1e-5)  # far negative gates give ~0, never NaN or inf
    assert np.isfinite(ours).all()


@pytest.fixture(scope="module")
def hooked(default_model_dir: Path) -> Any:
    from mlx_lm.models import llama

    from semantic.engine.model.loading import load_model

    load_model(str(default_model_dir))  # imports the llama module the hook goes into
    assert model_hooks.install_kernel_hooks()
    return llama.swiglu


def test_the_hook_uses_our_swiglu_for_float32_on_the_engine_thread_only(hooked: Any) -> None:
    assert getattr(hooked, "__wrapped__", None) is activations.swiglu
    gate, x = mx.random.normal((2, 7, 96)) * 4, mx.random.normal((2, 7, 96))
    original = np.array(activations.swiglu(gate, x))
    ours = np.array(cpu_swiglu.swiglu(gate, x))
    assert not np.array_equal(ours, original)  # the two paths are told apart by their bits
    results: dict[str, np.ndarray] = {}

    def engine_thread() -> None:
        with model_hooks.cpu_kernels_on_this_thread():
            results["float32"] = np.array(hooked(gate, x))
            half = hooked(gate.astype(mx.float16), x.astype(mx.float16))
            results["float16"] = np.array(half.astype(mx.float32))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(60)
    np.testing.assert_array_equal(results["float32"], ours)
    expected_half = activations.swiglu(gate.astype(mx.float16), x.astype(mx.float16)).astype(mx.float32)
    np.testing.assert_array_equal(results["float16"], np.array(expected_half))  # mlx-lm's, bit for bit
    np.testing.assert_array_equal(np.array(hooked(gate, x)), original)  # this thread never enabled it
