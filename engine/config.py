"""The engine's settings, and the counters it keeps for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "default"
    model_name: str | None = None  # served under this name; None: derived from `model`
    block_size: int = 256
    cache_budget_mb: int = 4096
    idle_kv_bits: int | None = None  # the pool (caches no sequence decodes from) quantized to 4 or 8 bits
    max_batch_size: int = 16
    prefill_batch_size: int | None = None  # None: 1 on the CPU, 8 on a GPU
    prefill_step_size: int | None = None  # None: 512 on the CPU, 2048 on a GPU
    # While others decode, a tick prefills what takes about this many of their decode steps
    # (engine/prefill_budget.py); 0: always `prefill_step_size`.
    prefill_stall_ratio: float = 1.0
    # A short turn: a prompt with at most this many uncached tokens (a returning agent's new
    # messages). It is prefilled in whole chunks even while others decode (one longer than a chunk in
    # chunks of one size), and may overtake a long prompt part-way through its prefill. None: two
    # `prefill_step_size` chunks on the CPU (1,024 tokens), one on a GPU (2,048).
    short_turn_tokens: int | None = None
    # Decode rows and a prompt's chunk in one forward pass where the model allows (mlx_adapter/mixed_step.py).
    mixed_step: bool = True
    # Waiting prompts are admitted shortest uncached part first; one waiting this long goes first.
    shortest_first_max_wait_s: float = 60.0
    # The shortest tick under load. 0: back to back. A floor caps every stream's decode at 1/tick_s
    # tokens/s: 10 ms held SmolLM2-135M to 97 tok/s on an H200, whose step takes ~5 ms.
    tick_s: float = 0.0
    default_dtype: str = "float32"
    models_dir: Path | None = None  # where the default model is converted; None: the user cache
    # Under mlx.launch (engine/distributed.py): split layers rather than heads, and how long a rank
    # may go unheard (a collective waiting) before the group is given up.
    pipeline: bool = False
    rank_timeout_s: float = 120.0

    @property
    def num_prefilled_together(self) -> int:
        """Prompts prefilled together. On the CPU one at a time: prefill is compute-bound there, so a
        batch only makes every prompt in it wait for the slowest (and pads the shorter ones)."""
        size = self.prefill_batch_size or (1 if mx.default_device() == mx.cpu else 8)
        return max(1, min(size, self.max_batch_size))

    @property
    def num_tokens_per_prefill_step(self) -> int:
        return self.prefill_step_size or (512 if mx.default_device() == mx.cpu else 2048)

    @property
    def num_short_turn_tokens(self) -> int:
        """The CPU's default takes an agent's usual tool result (500-1,000 tokens) for a short turn:
        on the 8-agent replay its first token came at 0.11-0.13x mlx_lm.server's rather than
        0.20-0.25x, the replay took 12% less time, and the streams' longest gaps grew (README)."""
        if self.short_turn_tokens is not None:
            return self.short_turn_tokens
        chunk = self.num_tokens_per_prefill_step
        return 2 * chunk if mx.default_device() == mx.cpu else chunk


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
    mlx_active_bytes: int = 0  # MLX's memory on this rank: in arrays, and freed but kept for reuse
    mlx_cache_bytes: int = 0
    rank_memory_bytes: list[int] = field(default_factory=list)  # in a group: each rank's MLX active memory
