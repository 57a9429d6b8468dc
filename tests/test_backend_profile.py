"""One backend profile, chosen from the device (engine/loop/backend_profile.py): what it holds on each
device, how settings change it, and that a GPU's choices leave mlx-lm's own step and functions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from semantic.engine.loop.backend_profile import BackendChoices, choose_profile
from tests.server_process import ServerProcess

VARIANTS = ("cpu_kernels", "last_token_fold", "mixed_step", "joining_cache")


def test_the_cpu_runs_every_variant_and_a_gpu_none() -> None:
    cpu = choose_profile(device="cpu")
    assert all(getattr(cpu, name) for name in VARIANTS)
    assert (cpu.prefill_batch_size, cpu.prefill_step_size, cpu.short_turn_tokens) == (1, 512, 1024)
    for device in ("metal", "cuda"):
        gpu = choose_profile(device=device)
        assert not any(getattr(gpu, name) for name in VARIANTS), device
        assert (gpu.prefill_batch_size, gpu.prefill_step_size, gpu.short_turn_tokens) == (8, 2048, 2048)
        assert gpu.heap_reserve_mb == 0 and not gpu.forks_generator
        assert gpu.describe().startswith(f"backend {device}: mlx-lm only")


@given(
    device=st.sampled_from(["cpu", "metal", "cuda"]),
    exact=st.booleans(),
    chosen=st.fixed_dictionaries({name: st.none() | st.booleans() for name in VARIANTS}),
)
def test_settings_choose_each_part_and_exact_numerics_turns_all_off(
    device: str, exact: bool, chosen: dict[str, bool | None]
) -> None:
    profile = choose_profile(BackendChoices(exact_numerics=exact, **chosen), device=device)  # type: ignore[arg-type]
    for name in VARIANTS:
        wanted = chosen[name] if chosen[name] is not None else device == "cpu"
        if exact or (name == "cpu_kernels" and device != "cpu"):
            wanted = False  # exact numerics turns every variant off; the kernels are CPU kernels
        if name == "mixed_step" and not profile.last_token_fold:
            wanted = False  # the packed pass folds with the fold's head
        assert getattr(profile, name) is wanted, name


@pytest.mark.parametrize("device", ["cpu", "metal", "cuda"])
def test_speculation_is_ngram_on_the_cpu_off_on_a_gpu_by_default_and_follows_its_setting(device: str) -> None:
    default = choose_profile(device=device)  # type: ignore[arg-type]
    if device == "cpu":
        assert default.speculate == "ngram"  # measured faster there (bench/speculative_edit.py)
        assert "n-gram speculation" in default.describe()
    else:
        assert default.speculate == "off"  # unmeasured
        assert "speculation" not in default.describe()
    assert choose_profile(BackendChoices(exact_numerics=True), device=device).speculate == "off"  # type: ignore[arg-type]
    for chosen in ("off", "ngram", "mlx-community/Qwen3-0.6B-4bit"):
        profile = choose_profile(BackendChoices(speculate=chosen), device=device)  # type: ignore[arg-type]
        assert profile.speculate == chosen
        exact = choose_profile(BackendChoices(speculate=chosen, exact_numerics=True), device=device)  # type: ignore[arg-type]
        assert exact.speculate == "off"  # a verify pass computes a token's logits beside others'
    drafted = choose_profile(BackendChoices(speculate="/models/draft"), device=device)  # type: ignore[arg-type]
    assert "speculation with draft model /models/draft" in drafted.describe()


def test_sizes_follow_settings() -> None:
    profile = choose_profile(
        BackendChoices(prefill_batch_size=4, prefill_step_size=256, short_turn_tokens=0, heap_reserve_mb=0),
        device="cpu",
    )
    assert (profile.prefill_batch_size, profile.prefill_step_size, profile.short_turn_tokens) == (4, 256, 0)
    assert profile.heap_reserve_mb == 0
    assert choose_profile(BackendChoices(prefill_step_size=256), device="cpu").short_turn_tokens == 512


GPU_CHOICES_PROBE = textwrap.dedent(
    """
    import sys, json
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import activations, base
    from semantic.engine.loop.backend_profile import choose_profile
    from semantic.engine.loop.config import EngineConfig, EngineStats
    from semantic.engine.loop.outbox import Outbox
    from semantic.engine.loop.served_model import ServedModel
    import asyncio

    gpu = choose_profile(device="metal")
    config = EngineConfig(
        model=sys.argv[1], cache_budget_mb=64, cpu_kernels=gpu.cpu_kernels,
        last_token_fold=gpu.last_token_fold, mixed_step=gpu.mixed_step, joining_cache=gpu.joining_cache,
    )
    served = ServedModel.load(config.model, None, config, mx.default_stream(mx.cpu), EngineStats(),
                           Outbox(asyncio.new_event_loop()))
    model_module = sys.modules[type(served.loaded.model).__module__]
    print(json.dumps({
        "generator": type(served.batch._generator).__qualname__,
        "plain_generator": type(served.batch._generator) is BatchGenerator,
        "attention_is_mlx_lm": model_module.scaled_dot_product_attention is base.scaled_dot_product_attention,
        "masks_are_mlx_lm": getattr(model_module, "create_causal_mask", base.create_causal_mask)
            is base.create_causal_mask,
        "swiglu_is_mlx_lm": getattr(model_module, "swiglu", activations.swiglu) is activations.swiglu,
    }))
    """
)


def test_a_gpu_profile_runs_mlx_lms_own_generator_and_functions(default_model_dir: Path) -> None:
    """With a GPU's choices (run on the CPU here, in a fresh process: the hooks are process-wide),
    the batch is mlx-lm's BatchGenerator and the model's module keeps mlx-lm's functions."""
    probe = subprocess.run(
        [sys.executable, "-c", GPU_CHOICES_PROBE, str(default_model_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found == {
        "generator": "BatchGenerator",
        "plain_generator": True,
        "attention_is_mlx_lm": True,
        "masks_are_mlx_lm": True,
        "swiglu_is_mlx_lm": True,
    }


def test_semantic_config_prints_the_profile() -> None:
    shown = subprocess.run(
        [str(Path(sys.executable).with_name("semantic")), "config", "--exact-numerics"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "backend.exact_numerics = True  # command line" in shown
    assert (
        "# backend cpu, exact numerics: OpenBLAS" in shown
        or "# backend cpu, exact numerics: mlx-lm only" in shown
    )


def test_health_ready_reports_the_profile(tmp_path: Path, tiny_llama_dir: Path) -> None:
    server = ServerProcess(
        tmp_path, "--model", str(tiny_llama_dir), "--cache-budget-mb", "64", "--no-mixed-step"
    ).start()
    try:
        with urllib.request.urlopen(f"{server.base_url}/health/ready", timeout=30) as reply:
            backend = json.loads(reply.read())["backend"]
    finally:
        server.stop()
    assert backend["device"] == "cpu" and backend["cpu_kernels"] and backend["last_token_fold"]
    assert backend["mixed_step"] is False  # the flag's choice
