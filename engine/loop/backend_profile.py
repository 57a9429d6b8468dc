"""What the engine runs on this device: one backend profile, chosen once at load.

Every choice that exists for one kind of device lives here: our CPU kernels (`cpu_attention`,
`cpu_swiglu`, the masks told apart), the step variants that replace parts of mlx-lm's batch
generator (the last-token fold, the packed decode-and-prefill step, the joining batch cache),
prefill sizes, the heap kept faulted in, and the launcher's OpenBLAS. Their reasons are CPU
measurements (docs/benchmarks.md, "Linux CPU speed"), so on Metal and CUDA every one of them is off
by default and mlx-lm's own step runs, with its fused kernels: nothing CPU-specific is installed
into a GPU process. Each part can be set either way (`[backend]` settings), and `exact_numerics`
turns every kernel, fold and step variant off at once.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

import msgspec

DeviceKind = Literal["cpu", "metal", "cuda"]
# Set in the environment by the launcher (semantic/launch.py) once OpenBLAS is preloaded.
FAST_BLAS_MARKER = "SEMANTIC_FAST_BLAS"
# "off", "ngram" (drafts from each reply's own history) or a draft model, named as `--model` is.
Speculate = str

# Prefill sizes by device: one prompt at a time in 512-token chunks on the CPU, where prefill is
# compute-bound and a batch only makes every prompt wait for the slowest; mlx-lm's own on a GPU.
_CPU_PREFILL = (1, 512)
_GPU_PREFILL = (8, 2048)
CPU_HEAP_RESERVE_MB = 512


class BackendChoices(msgspec.Struct, frozen=True, kw_only=True):
    """The settings' say on the profile (`[backend]`; None: the device's default)."""

    device: Literal["auto", "cpu", "gpu"] = "auto"
    exact_numerics: bool = False
    cpu_kernels: bool | None = None
    last_token_fold: bool | None = None
    mixed_step: bool | None = None
    joining_cache: bool | None = None
    speculate: Speculate | None = None
    prefill_batch_size: int | None = None
    prefill_step_size: int | None = None
    short_turn_tokens: int | None = None
    heap_reserve_mb: int | None = None


class BackendProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What runs on this device. Printed by `semantic config`, at start-up and in `/health/ready`."""

    device: DeviceKind
    exact_numerics: bool
    cpu_kernels: bool  # our attention and SwiGLU, and masks told apart (mlx_adapter/model_hooks.py)
    last_token_fold: bool  # a lone prompt's last token in its last chunk (mlx_adapter/last_token_fold.py)
    mixed_step: bool  # decode and a prompt's chunk in one pass (mlx_adapter/mixed_step.py)
    joining_cache: bool  # joins and leaves at one copy of each row (mlx_adapter/batch_joins.py)
    # Drafts verified in the batch's pass (engine/speculation/drafting.py): n-gram drafts on the CPU, where
    # code editing gains and free-form chat breaks even (bench/results/speculative_edit.json);
    # opt-in on a GPU, which has no such result yet.
    speculate: Speculate
    prefill_batch_size: int
    prefill_step_size: int
    short_turn_tokens: int
    heap_reserve_mb: int  # faulted in before the server listens (actors/heap.py); Linux CPU only
    fast_blas: bool  # OpenBLAS preloaded by the launcher (semantic/launch.py): read, not chosen here

    @property
    def forks_generator(self) -> bool:
        """Whether a step variant replaces part of mlx-lm's BatchGenerator."""
        return self.last_token_fold or self.mixed_step

    def describe(self) -> str:
        """One line: the device and what runs on it beside mlx-lm's own step."""
        variants = [
            name
            for name, on in (
                ("cpu kernels", self.cpu_kernels),
                ("last-token fold", self.last_token_fold),
                ("mixed step", self.mixed_step),
                ("joining cache", self.joining_cache),
                ("n-gram speculation", self.speculate == "ngram"),
                (f"speculation with draft model {self.speculate}", self.speculate not in ("off", "ngram")),
                ("OpenBLAS", self.fast_blas),
            )
            if on
        ]
        exact = ", exact numerics" if self.exact_numerics else ""
        return (
            f"backend {self.device}{exact}: {', '.join(variants) or 'mlx-lm only'}; prefill "
            f"{self.prefill_batch_size} x {self.prefill_step_size} tokens, short turns up to "
            f"{self.short_turn_tokens}, heap reserve {self.heap_reserve_mb} MiB"
        )


def apply_device_choice(choice: Literal["auto", "cpu", "gpu"]) -> None:
    """Make `choice` MLX's default device (auto: the GPU where MLX has one). Refuses a GPU that is
    not there, naming what is."""
    import mlx.core as mx

    if choice == "cpu":
        mx.set_default_device(mx.cpu)
    elif choice == "gpu":
        if not (mx.metal.is_available() or mx.cuda.is_available()):
            raise ValueError("backend.device = 'gpu', but this mlx has no GPU backend (metal or cuda)")
        mx.set_default_device(mx.gpu)


def current_device() -> DeviceKind:
    """The kind of MLX's default device."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def choose_profile(choices: BackendChoices | None = None, device: DeviceKind | None = None) -> BackendProfile:
    """The profile for `device` (MLX's default device if None), each part as `choices` set it."""
    choices = choices or BackendChoices()
    device = device or current_device()
    on_cpu = device == "cpu"
    exact = choices.exact_numerics

    def variant(chosen: bool | None) -> bool:
        if exact:
            return False  # exact numerics: mlx-lm's own kernels and steps, whatever else is set
        return on_cpu if chosen is None else chosen

    batch_size, step_size = _CPU_PREFILL if on_cpu else _GPU_PREFILL
    step_size = choices.prefill_step_size or step_size
    # A returning agent's usual tool result (500-1,000 tokens) is a short turn on the CPU
    # (bench/results/agent_replay_cpu_8_short_turn_1024_even.json against ..._512.json).
    short_turn = (
        choices.short_turn_tokens
        if choices.short_turn_tokens is not None
        else (2 * step_size if on_cpu else step_size)
    )
    linux_cpu = on_cpu and sys.platform.startswith("linux")
    heap = choices.heap_reserve_mb if choices.heap_reserve_mb is not None else CPU_HEAP_RESERVE_MB
    return BackendProfile(
        device=device,
        exact_numerics=exact,
        cpu_kernels=variant(choices.cpu_kernels) and on_cpu,  # the kernels are CPU kernels
        last_token_fold=variant(choices.last_token_fold),
        mixed_step=variant(choices.mixed_step)
        and variant(choices.last_token_fold),  # packs with the fold's head
        joining_cache=variant(choices.joining_cache),
        # exact numerics: a verify pass computes a token's logits beside others', not alone
        speculate="off" if exact else choices.speculate or ("ngram" if on_cpu else "off"),
        prefill_batch_size=choices.prefill_batch_size or batch_size,
        prefill_step_size=step_size,
        short_turn_tokens=short_turn,
        heap_reserve_mb=heap if linux_cpu else 0,
        fast_blas=on_cpu and bool(os.environ.get(FAST_BLAS_MARKER)),
    )
