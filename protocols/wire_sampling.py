"""The sampling fields the OpenAI-family requests share (chat and text completions, agent turns),
and the one function that makes a request's sampling fields a `SamplingParams`.

Each field is named as the `SamplingParams` field it sets, so a new sampling option is a field
here and one there; its bounds live there (checked there, shown by /openapi.json).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from semantic.actors.interface import SamplingParams
from semantic.protocols.answer_turn import sampling_params


class SamplingFields(msgspec.Struct, kw_only=True):
    """null or left out, as OpenAI allows in each: the server's or the model's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # this, min_p and repetition_penalty: vLLM's and mlx_lm.server's
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string key): added to its logit
    xtc_probability: float | None = None  # XTC, as mlx_lm.server takes it
    xtc_threshold: float | None = None


def sampling_of(
    request: web.Request, body: SamplingFields, max_tokens: int | None, top_logprobs: int | None = None
) -> SamplingParams:
    """`body`'s sampling; ValueError (a 400) names a field out of its range."""
    fields = {name: getattr(body, name) for name in SamplingFields.__struct_fields__}
    fields["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    fields["logit_bias"] = token_biases(body.logit_bias)
    return sampling_params(request, max_tokens=max_tokens, top_logprobs=top_logprobs, **fields)


def token_biases(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as the keys' text) as the engine takes it."""
    try:
        return tuple((int(token), float(value)) for token, value in (logit_bias or {}).items())
    except ValueError:
        raise ValueError("logit_bias: keys are token ids (integers)") from None
