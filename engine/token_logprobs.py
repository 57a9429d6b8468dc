"""A generated token's log-probability and its most likely alternatives, for requests that ask.

The log-probabilities are the ones the sampler drew from: the model's logits, after a grammar's
mask where the request has one, normalised, before temperature, top-p and top-k (the same as
mlx-lm's and vLLM's default). A token a grammar rules out has -inf and is never an alternative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...]  # most likely first, `top_logprobs` of them


class TokenTexts:
    """Each token's own text, decoded alone (a token that ends inside a UTF-8 character decodes to
    the replacement character, which is why the protocols also give a token's bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = lru_cache(maxsize=65536)(lambda token_id: str(tokenizer.decode([token_id])))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


def token_logprob(logprobs: mx.array, token_id: int, num_top: int, texts: TokenTexts) -> TokenLogprob:
    """`token_id`'s entry from one step's log-probabilities over the vocabulary (evaluated already).

    Read on the CPU stream: on a GPU the default stream has the next step queued by now, and work
    put behind it would wait for that step."""
    row = np.array(logprobs.reshape(-1, stream=mx.cpu).astype(mx.float32, stream=mx.cpu))
    top: tuple[TopLogprob, ...] = ()
    if num_top > 0:
        candidates = np.argpartition(-row, num_top - 1)[:num_top]
        ranked = candidates[np.argsort(-row[candidates], kind="stable")]
        top = tuple(
            TopLogprob(int(i), texts(int(i)), float(row[i])) for i in ranked if not math.isinf(row[i])
        )
    return TokenLogprob(token_id, texts(token_id), float(row[token_id]), top)
