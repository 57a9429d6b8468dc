"""Drafts for speculative decoding from a small draft model with the main model's tokenizer.

Each drafting sequence keeps the draft model's KV cache of its own history. To propose k tokens
after the history and the pending token, the drafter brings that cache up to date (taking back what
it drafted last step past what the batch kept), then decodes greedily. Greedy drafts are a fixed
function of the history, so the batch's rules for certain drafts (`speculative_batch.py`) keep a
reply exactly what it would have been: greedy rows token for token, sampled rows in distribution.

A sequence that joins with a long prompt (a returning agent's whole history) catches up
`CATCH_UP_TOKENS` per step and drafts nothing until it has, so no step waits for a whole prompt's
prefill through the draft model. The draft caches live outside the block pool: they are as long as
the sequences drafting and dropped when a sequence leaves the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx

from semantic.engine.mlx_adapter.api import KVCache, make_prompt_cache

CATCH_UP_TOKENS = 512  # per step: a draft model's chunk costs a fraction of the main model's step


class ModelDrafter:
    """Drafts for one sequence from `model` (the draft model), greedy, below `num_token_ids`."""

    def __init__(self, model: Any, tokens: Sequence[int], num_token_ids: int) -> None:
        self._model = model
        self._num_token_ids = num_token_ids  # the main model's: a draft past them is not a token there
        self._history: list[int] = list(tokens)
        self._cache = make_prompt_cache(model)
        self._cached: list[int] = []  # the tokens in the draft cache, in order
        self._num_agreed = 0  # a prefix of `_cached` known equal to the history's

    def __len__(self) -> int:
        return len(self._history)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens now part of the sequence (what was fed: pending and accepted drafts)."""
        self._history.extend(tokens)

    def guess_next(self) -> int | None:
        """The draft model's greedy choice after the history (the token the batch is computing as
        drafts are planned); None while the draft cache is still catching up with a long history."""
        history = self._history
        if not history:
            return None
        self._take_back_to(min(self._agreement(history), len(history) - 1))  # the last one fed again
        logits = self._caught_up(history[len(self._cached) :])
        if logits is None:
            return None
        token = int(mx.argmax(logits, axis=-1))
        return token if token < self._num_token_ids else None

    def propose(self, pending: int, k: int) -> list[int]:
        """Up to k greedy draft tokens after the history and `pending`; [] when k <= 0 or while the
        draft cache is still catching up with a long history."""
        if k <= 0:
            return []
        self._take_back_to(self._agreement(self._history))
        # Pending's logits give the first draft.
        logits = self._caught_up([*self._history[len(self._cached) :], pending])
        if logits is None:
            return []
        drafts: list[int] = []
        while True:
            token = int(mx.argmax(logits, axis=-1))
            if token >= self._num_token_ids:
                break
            drafts.append(token)
            if len(drafts) == k:
                break
            logits = self._feed([token])
        return drafts

    def _agreement(self, history: list[int]) -> int:
        """How much of the draft cache is the start of the history (never the pending token: it is
        fed again, for its logits)."""
        cached, agreed = self._cached, self._num_agreed
        end = min(len(cached), len(history))
        while agreed < end and cached[agreed] == history[agreed]:
            agreed += 1
        self._num_agreed = agreed  # the history only grows: this much stays agreed
        return agreed

    def _take_back_to(self, length: int) -> None:
        excess = len(self._cached) - length
        if excess > 0:
            for layer in self._cache:
                layer.trim(excess)
            del self._cached[length:]

    def _caught_up(self, unfed: list[int]) -> mx.array | None:
        """Feed `unfed` and return the last position's logits; None after feeding one chunk of a
        longer run (the cache catches up a chunk a step)."""
        if len(unfed) > CATCH_UP_TOKENS:
            self._feed(unfed[:CATCH_UP_TOKENS])
            return None
        return self._feed(unfed)

    def _feed(self, tokens: list[int]) -> mx.array:
        """Run the draft model over `tokens` into its cache; the last position's logits."""
        logits = self._model(mx.array([tokens]), cache=self._cache)[0, -1]
        self._cached.extend(tokens)
        return logits


def check_draft_model(model: Any, tokenizer: Any, main_tokenizer: Any, source: str) -> None:
    """Refuse a draft model whose token ids mean other tokens than the main model's, or whose cache
    cannot take back rejected drafts (a sliding window, a recurrent state)."""
    draft_vocab, main_vocab = tokenizer.get_vocab(), main_tokenizer.get_vocab()
    if draft_vocab != main_vocab:
        differing = len(set(draft_vocab.items()) ^ set(main_vocab.items()))
        raise ValueError(
            f"draft model {source} has another tokenizer ({len(draft_vocab)} tokens against "
            f"{len(main_vocab)}, {differing} entries differ): its drafts would name other tokens"
        )
    kinds = {type(layer).__name__ for layer in make_prompt_cache(model) if type(layer) is not KVCache}
    if kinds:
        raise ValueError(
            f"draft model {source} keeps {', '.join(sorted(kinds))} layers, which cannot take back "
            "rejected drafts: use a draft model with full attention only"
        )
