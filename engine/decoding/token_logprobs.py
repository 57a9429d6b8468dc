"""A generated token's log-probability and its most likely alternatives, for requests that ask.

The log-probabilities are the ones the sampler drew from: the model's logits, after a grammar's
mask where the request has one, normalised, before temperature, top-p and top-k (the same as
mlx-lm's and vLLM's default). A token a grammar rules out has -inf and is never an alternative.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from semantic.engine.mlx_adapter.tokenizers import byte_decoder


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    text: str
    raw: bytes  # the token's bytes (its text may end in a split character's replacement)
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    text: str
    raw: bytes
    logprob: float
    top: tuple[TopLogprob, ...]  # most likely first, `top_logprobs` of them


@dataclass(frozen=True, slots=True)
class TokenText:
    text: str
    raw: bytes


class TokenTexts:
    """Each token's text as it reads inside a text: decoded after a fixed anchor token, since some
    tokenizers (SentencePiece) drop a token's leading space at the start of a text. A token that
    ends inside a UTF-8 character reads as the replacement character; its bytes then come from the
    vocabulary's own piece (SentencePiece's <0xNN>, or byte-level BPE's byte map)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._anchor = list(tokenizer.encode("a", add_special_tokens=False))[-1:]
        self._anchor_text = str(tokenizer.decode(self._anchor))
        self._read = lru_cache(maxsize=65536)(self._text_of)

    def __call__(self, token_id: int) -> TokenText:
        return self._read(token_id)

    def _text_of(self, token_id: int) -> TokenText:
        text = str(self._tokenizer.decode([*self._anchor, token_id]))
        if self._anchor and text.startswith(self._anchor_text):
            text = text[len(self._anchor_text) :]
        else:
            text = str(self._tokenizer.decode([token_id]))
        raw = _piece_bytes(self._tokenizer, token_id) if "\ufffd" in text else None
        return TokenText(text, raw if raw is not None else text.encode())


def _piece_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    piece = str(tokenizer.convert_ids_to_tokens(token_id))
    if (byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:
        return bytes([int(byte.group(1), 16)])
    byte_map = byte_decoder()
    if piece and all(char in byte_map for char in piece):
        return bytes(byte_map[char] for char in piece)
    return None


def token_logprob(logprobs: mx.array, token_id: int, num_top: int, texts: TokenTexts) -> TokenLogprob:
    """`token_id`'s entry from one step's log-probabilities over the vocabulary (evaluated already).

    Read on the CPU stream: on a GPU the default stream has the next step queued by now, and work
    put behind it would wait for that step."""
    row = np.array(logprobs.reshape(-1, stream=mx.cpu).astype(mx.float32, stream=mx.cpu))
    top: list[TopLogprob] = []
    if num_top > 0:
        candidates = np.argpartition(-row, num_top - 1)[:num_top]
        for i in candidates[np.argsort(-row[candidates], kind="stable")]:
            if not math.isinf(row[i]):
                text = texts(int(i))
                top.append(TopLogprob(int(i), text.text, text.raw, float(row[i])))
    chosen = texts(token_id)
    return TokenLogprob(token_id, chosen.text, chosen.raw, float(row[token_id]), tuple(top))
