"""Per-request sampling parameters and the MLX samplers built from them.

`SamplingParams` travels whole: from each API's wire struct to the engine's request and, encoded
with msgspec, to the other ranks of a group. Its numeric ranges are msgspec `Meta` bounds, checked
on construction here and by msgspec on decoding, and read by /openapi.json.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import mlx.core as mx
import msgspec
from msgspec import Meta

from semantic.engine.mlx_adapter.api import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

Sampler = Callable[[mx.array], mx.array]

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIASES = 300  # OpenAI's limit
MAX_SEED = 2**64 - 1  # beyond msgspec's int64 bounds: checked by hand
PENALTY_CONTEXT = 20  # the tokens penalties look back over (mlx-lm's default)
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): the sampler multiplies the logits by its
# inverse, and past float32's range every logit becomes -inf, so any token comes out.
MIN_TEMPERATURE = 1e-5
# A top_p below this keeps only the most likely token of any vocabulary under a million (whose
# probability is at least 1 / its size): greedy. Too small for float32, mlx-lm's top-p masks all.
MIN_TOP_P = 1e-6

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's range for its two additive penalties
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """A model's own sampling defaults (its generation_config.json), for requests that set none."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """None in `temperature`, `top_p` or `top_k`: the served model's default (`with_defaults`)."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, Meta(ge=0)] | None = 0  # 0: off
    max_tokens: Annotated[int, Meta(ge=1)] = 256
    stop: tuple[str, ...] = ()
    seed: Annotated[int, Meta(ge=0)] | None = None
    # None: no log-probabilities; else each token's and this many more
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    min_p: Probability = 0.0
    # Over the last PENALTY_CONTEXT tokens of prompt and reply (mlx-lm's): additive (OpenAI's two)
    # and multiplicative.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=10.0)] = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # XTC ("exclude top choices", mlx-lm's apply_xtc): with this probability per token, drop every
    # token likelier than xtc_threshold but the least likely of them. Above 0.5 none can be dropped.
    xtc_probability: Probability = 0.0
    xtc_threshold: Annotated[float, Meta(ge=0.0, le=0.5)] = 0.1

    def __post_init__(self) -> None:
        for name, bound in _BOUNDED:
            value = getattr(self, name)
            if value is not None and not _within(value, bound):
                raise ValueError(f"{name} must be {_range_words(bound)}, got {value}")
        if self.seed is not None and self.seed > MAX_SEED:
            raise ValueError(f"seed must be between 0 and 2**64 - 1, got {self.seed}")
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
            msgspec.structs.force_setattr(self, "temperature", 0.0)  # frozen: set once, while being made
            msgspec.structs.force_setattr(self, "top_p", 1.0)

    def check_token_ids(self, num_token_ids: int) -> None:
        """Raises ValueError where `logit_bias` names a token the model does not have."""
        if any(token_id >= num_token_ids for token_id, _ in self.logit_bias):
            raise ValueError(f"logit_bias: the model's token ids are below {num_token_ids}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def with_defaults(self, defaults: GenerationDefaults) -> SamplingParams:
        """The model's defaults where the request and the server set nothing."""
        return msgspec.structs.replace(
            self,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
        )


Bound = msgspec.inspect.IntType | msgspec.inspect.FloatType


def _bounded_fields() -> list[tuple[str, Bound]]:
    """Each field's `Meta` bounds, read once: the struct's annotations are their one statement."""
    bounded = []
    for field in msgspec.inspect.type_info(SamplingParams).fields:  # type: ignore[attr-defined]
        kind = field.type
        for bound in kind.types if isinstance(kind, msgspec.inspect.UnionType) else (kind,):
            if isinstance(bound, Bound) and (bound.ge, bound.gt, bound.le, bound.lt) != (None,) * 4:
                bounded.append((field.name, bound))
    return bounded


def _within(value: float, bound: Bound) -> bool:
    return (
        (bound.ge is None or value >= bound.ge)
        and (bound.gt is None or value > bound.gt)
        and (bound.le is None or value <= bound.le)
        and (bound.lt is None or value < bound.lt)
    )


def _range_words(bound: Bound) -> str:
    if bound.le is None and bound.lt is None:
        return f">= {bound.ge:g}" if bound.ge is not None else f"> {bound.gt:g}"
    left = f"[{bound.ge:g}" if bound.ge is not None else f"({bound.gt:g}"
    right = f"{bound.le:g}]" if bound.le is not None else f"{bound.lt:g})"
    return f"in {left}, {right}"


_BOUNDED = _bounded_fields()


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")


def make_sampler(
    params: SamplingParams, vocab_size: int, xtc_kept_token_ids: Sequence[int] = ()
) -> Sampler | None:
    """None means greedy: the batch then samples all greedy rows with one argmax.

    `xtc_kept_token_ids`: tokens XTC never drops (mlx_lm.server passes the newline and EOS ids)."""
    assert params.temperature is not None and params.top_p is not None and params.top_k is not None, (
        "sampling reached the engine without the model's defaults: caller bug"
    )
    if params.is_greedy:
        return None
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    top_p, min_p = params.top_p, params.min_p
    xtc_probability, xtc_threshold = params.xtc_probability, params.xtc_threshold
    kept = list(xtc_kept_token_ids)
    inverse_temperature = 1.0 / params.temperature
    key = [mx.random.key(params.seed)] if params.seed is not None else None

    def draw_key() -> mx.array | None:
        if key is None:
            return None
        key[0], step_key = mx.random.split(key[0])
        return step_key

    def sample(logprobs: mx.array) -> mx.array:
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        if top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if xtc_probability > 0.0:
            logprobs = _exclude_top_choices(logprobs, xtc_probability, xtc_threshold, kept, draw_key())
        return mx.random.categorical(logprobs * inverse_temperature, key=draw_key())

    return sample


def _exclude_top_choices(
    logprobs: mx.array, probability: float, threshold: float, kept: list[int], key: mx.array | None
) -> mx.array:
    """mlx-lm's apply_xtc, with the request's own random key: seeded ranks drop the same tokens."""
    probs = mx.softmax(logprobs, -1)
    least_likely_above = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    dropped = probs > least_likely_above
    if kept:
        dropped[..., kept] = False
    applies = mx.random.uniform(key=key) <= probability
    return mx.where(applies & dropped, -mx.inf, logprobs)


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
