"""The engine's settings, and the counters it keeps for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from semantic.engine.loop.backend_profile import BackendChoices, BackendProfile, Speculate, choose_profile


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"
    model_name: str | None = None  # served under this name; None: derived from `model`
    block_size: int = 256
    cache_budget_mb: int = 4096
    idle_kv_bits: int | None = None  # the pool (caches no sequence decodes from) quantized to 4 or 8 bits
    cache_pinned_share: float = 0.25  # of the pool, at most, that cache_control pins keep
    max_batch_size: int = 16
    # Backend choices (engine/loop/backend_profile.py); None: the device's default, which `profile` holds.
    prefill_batch_size: int | None = None  # prompts prefilled together: 1 on the CPU, 8 on a GPU
    prefill_step_size: int | None = None  # prefill chunk: 512 on the CPU, 2048 on a GPU
    # While others decode, a tick prefills what takes about this many of their decode steps
    # (engine/scheduling/prefill_budget.py); 0: always `prefill_step_size`.
    prefill_stall_ratio: float = 1.0
    # A short turn: a prompt with at most this many uncached tokens (a returning agent's new
    # messages). It is prefilled in whole chunks even while others decode (one longer than a chunk in
    # chunks of one size), and may overtake a long prompt part-way through its prefill. None: two
    # `prefill_step_size` chunks on the CPU (1,024 tokens), one on a GPU (2,048).
    short_turn_tokens: int | None = None
    mixed_step: bool | None = None
    last_token_fold: bool | None = None
    joining_cache: bool | None = None
    speculate: Speculate | None = None  # "off" or "ngram"; None: the device's default
    cpu_kernels: bool | None = None
    exact_numerics: bool = False
    heap_reserve_mb: int | None = None
    # Waiting prompts are admitted shortest uncached part first; one waiting this long goes first.
    shortest_first_max_wait_s: float = 60.0
    # The shortest tick under load. 0: back to back. A floor caps every stream's decode at 1/tick_s
    # tokens/s, which a small model's step on a GPU can run well past.
    tick_s: float = 0.0
    default_dtype: str = "float32"
    models_dir: Path | None = None  # where the default model is converted; None: the user cache
    # Under mlx.launch (engine/group/distributed.py): split layers rather than heads, and how long a rank
    # may go unheard (a collective waiting) before the group is given up.
    pipeline: bool = False
    rank_timeout_s: float = 120.0
    # What runs on this device, chosen once from MLX's default device and the choices above.
    profile: BackendProfile = field(init=False)

    def __post_init__(self) -> None:
        choices = BackendChoices(
            exact_numerics=self.exact_numerics,
            cpu_kernels=self.cpu_kernels,
            last_token_fold=self.last_token_fold,
            mixed_step=self.mixed_step,
            joining_cache=self.joining_cache,
            speculate=self.speculate,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
            short_turn_tokens=self.short_turn_tokens,
            heap_reserve_mb=self.heap_reserve_mb,
        )
        object.__setattr__(self, "profile", choose_profile(choices))

    @property
    def num_prefilled_together(self) -> int:
        return max(1, min(self.profile.prefill_batch_size, self.max_batch_size))

    @property
    def num_tokens_per_prefill_step(self) -> int:
        return self.profile.prefill_step_size

    @property
    def num_short_turn_tokens(self) -> int:
        return self.profile.short_turn_tokens


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    pool_used_bytes: int = 0
    pool_budget_bytes: int = 0
    num_agents_cached: int = 0
    num_evictions: int = 0
    # ticks that raised where nothing should; their requests failed, not the engine
    num_tick_failures: int = 0
    prefill_chunk_tokens: int = 0  # the last tick's prefill budget
    # The loaded model's prefill time per prompt token, as the prefill budget fits it (the slope of
    # chunk times: a chunk's fixed cost aside); 0 until measured. Restore by cost reads it.
    prefill_token_s: float = 0.0
    mlx_active_bytes: int = 0  # MLX's memory on this rank: in arrays, and freed but kept for reuse
    mlx_cache_bytes: int = 0
    rank_memory_bytes: list[int] = field(default_factory=list)  # in a group: each rank's MLX active memory
