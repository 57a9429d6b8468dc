"""Per-request sampling parameters and the MLX samplers built from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

Sampler = Callable[[mx.array], mx.array]

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIASES = 300  # OpenAI's limit
PENALTY_CONTEXT = 20  # the tokens penalties look back over (mlx-lm's default)
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): the sampler multiplies the logits by its
# inverse, and past float32's range every logit becomes -inf, so any token comes out.
MIN_TEMPERATURE = 1e-5
# A top_p below this keeps only the most likely token of any vocabulary under a million (whose
# probability is at least 1 / its size): greedy. Too small for float32, mlx-lm's top-p masks all.
MIN_TOP_P = 1e-6


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """A model's own sampling defaults (its generation_config.json), for requests that set none."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """None in `temperature`, `top_p` or `top_k`: the served model's default (`with_defaults`)."""

    temperature: float | None = 0.0
    top_p: float | None = 1.0
    top_k: int | None = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int | None = None  # None: no log-probabilities; else each token's and this many more
    min_p: float = 0.0
    # Over the last PENALTY_CONTEXT tokens of prompt and reply (mlx-lm's): additive (OpenAI's two)
    # and multiplicative.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be between 0 and 2**64 - 1, got {self.seed}")
        if self.top_logprobs is not None:
            _check_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.01, 10.0)
        if len(self.logit_bias) > MAX_LOGIT_BIASES:
            raise ValueError(
                f"logit_bias takes at most {MAX_LOGIT_BIASES} tokens, got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias:
            _check_range("a logit_bias token id", token_id, 0, float("inf"))
            _check_range("a logit_bias bias", bias, -100.0, 100.0)
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)}"
            )
        is_tiny_temperature = self.temperature is not None and 0.0 < self.temperature < MIN_TEMPERATURE
        if is_tiny_temperature or (self.top_p is not None and self.top_p < MIN_TOP_P):
            object.__setattr__(self, "temperature", 0.0)  # frozen: set once, while being made
            object.__setattr__(self, "top_p", 1.0)

    def check_token_ids(self, num_token_ids: int) -> None:
        """Raises ValueError where `logit_bias` names a token the model does not have."""
        if any(token_id >= num_token_ids for token_id, _ in self.logit_bias):
            raise ValueError(f"logit_bias: the model's token ids are below {num_token_ids}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def with_defaults(self, defaults: GenerationDefaults) -> SamplingParams:
        """The model's defaults where the request and the server set nothing."""
        return replace(
            self,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
        )


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")


def make_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """None means greedy: the batch then samples all greedy rows with one argmax."""
    assert params.temperature is not None and params.top_p is not None and params.top_k is not None, (
        "sampling reached the engine without the model's defaults: caller bug"
    )
    if params.is_greedy:
        return None
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    top_p, min_p = params.top_p, params.min_p
    inverse_temperature = 1.0 / params.temperature
    key = [mx.random.key(params.seed)] if params.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if key is None:
            return mx.random.categorical(logprobs * inverse_temperature)
        key[0], step_key = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inverse_temperature, key=step_key)

    return sample


def make_processors(params: SamplingParams, num_token_ids: int) -> list[Any]:
    """mlx-lm's logits processors for the request's logit bias and penalties (none for most)."""
    params.check_token_ids(num_token_ids)
    return make_logits_processors(
        dict(params.logit_bias) or None,
        params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        PENALTY_CONTEXT,
        params.presence_penalty or None,
        PENALTY_CONTEXT,
        params.frequency_penalty or None,
        PENALTY_CONTEXT,
    )
