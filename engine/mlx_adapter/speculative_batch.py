"""mlx-lm's decode batch, with drafted tokens verified in its forward pass (speculative decoding).

On a step where some sequences' drafts are worth verifying (`engine/speculation/drafting.py` weighs each
width against the step times this batch measures), every row is fed its pending token and its
drafts, right-padded to the longest: one forward pass of B x T tokens reads the
weights once, as a one-token step does. Each row then keeps the drafts its own logits confirm:
greedy rows the leading drafts that are the argmax, sampled rows by the standard rejection rule
(a draft x is kept with probability p(x), a rejected one replaced by a draw from p without x), so a
reply is what it would have been without drafts. Every row also gets its next token from the
position after its last kept one, as from a one-token step. A row with a grammar (its only logits
processor) drafts only what the grammar allows, and its logits at each position are masked as the
grammar masks them after the tokens before it; the drafts rejected are then taken back from the
grammar (`GrammarMatcher.mask_drafts`, `keep_drafts`).

mlx-lm's batch cache holds every row right-aligned at one shared write index, so rows that kept
different numbers of tokens cannot all end there: the cache is trimmed by what every row rejected
(free), and each row that rejected more has its history moved right by the difference, its left
padding growing by as much (`realign`: a copy of that row alone; where one row drafts, none moves).

Responses are mlx-lm's: one per token fed, in order, so a row that kept three drafts answers four
times in one step. Any step without drafts, or whose logits were computed elsewhere (the packed
pass of `mixed_step.py`), is mlx-lm's own step. Written against mlx-lm 0.32.2's `GenerationBatch`
(`_next_tokens`, `_next_logprobs`, `_token_context`, `_num_tokens`, `_matchers`, `tokens`).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

from semantic.engine.mlx_adapter.guided_batch import GuidedGenerationBatch
from semantic.engine.mlx_adapter.kv_seams import PLAIN_BATCH_CACHES
from semantic.engine.mlx_adapter.last_token_fold import GivenLogits
from semantic.engine.mlx_adapter.seam_check import require
from semantic.engine.speculation.drafting import Drafting, Speculation


def _ints(array: mx.array) -> list[int]:
    return [int(v) for v in array.tolist()]  # type: ignore[union-attr, arg-type]


def _floats(array: mx.array) -> list[float]:
    return [float(v) for v in array.tolist()]  # type: ignore[union-attr, arg-type]


class SpeculativeGenerationBatch(GuidedGenerationBatch):
    speculation: Speculation | None = None  # set by the engine's batch; None: mlx-lm's steps only
    _last_step: tuple[int, int, float] | None = None  # rows, width and start of the step being timed

    def next(self) -> list[GenerationBatch.Response]:
        self._time_last_step()
        drafts = self._plan()
        if drafts is None:
            responses = super().next()
            self._note_fed(responses)
            return responses
        return self._verify(drafts)

    def _time_last_step(self) -> None:
        """The last step's cost (`step_costs.py`): from its call to this one. Steps whose logits were
        computed elsewhere (the packed pass) are not timed."""
        now = time.perf_counter()
        if self._last_step is not None and self.speculation is not None:
            num_rows, width, started = self._last_step
            self.speculation.costs.observe(num_rows, width, now - started)
        timed = self.uids and not isinstance(self.model, GivenLogits)
        self._last_step = (len(self.uids), 1, now) if timed else None

    def _note_fed(self, responses: list[GenerationBatch.Response]) -> None:
        if self.speculation is not None:
            for response in responses:
                self.speculation.fed(response.uid, [response.token])

    def _plan(self) -> list[list[int]] | None:
        """Each row's drafts, where a step that verifies them pays (`Speculation.width_worth`); else
        None. The token each row gets from the last step is still being computed: drafts follow each
        drafter's guess at it, so planning never waits for that step (a wrong guess only costs its
        drafts, all rejected)."""
        speculation = self.speculation
        if speculation is None or not self.uids or isinstance(self.model, GivenLogits):
            return None
        if not all(type(layer) in PLAIN_BATCH_CACHES for layer in self.prompt_cache):
            return None  # a sliding window or a recurrent state cannot take back rejected tokens
        rows: list[tuple[Drafting, int, int] | None] = []  # each row's drafting, most drafts and guess
        for index, uid in enumerate(self.uids):
            drafting = speculation.get(uid)
            # Short of the generator's token limit (the engine's batch sets it one past the request's
            # and ends the sequence itself, keeping its cache): the step's own token is never a draft.
            room = self.max_tokens[index] - self._num_tokens[index] - 2
            k = 0 if drafting is None else min(drafting.length.wanted(), room)
            guess = drafting.drafter.guess_next() if drafting is not None and k > 0 else None
            if drafting is not None:
                drafting.guess = guess  # judged when the token is fed, unless a verify judges it
            rows.append(None if drafting is None or guess is None else (drafting, k, guess))
        offers = [(row[0].length, row[1]) for row in rows if row is not None]
        width = speculation.width_worth(len(self.uids), offers)
        if width == 1:
            return None
        most = width - 1
        drafts = [[] if row is None else _proposed(row[0], row[2], min(row[1], most)) for row in rows]
        offers = [(row[0].length, len(d)) for row, d in zip(rows, drafts, strict=True) if row is not None]
        width = speculation.width_worth(len(self.uids), offers)  # a lookup may find fewer than offered
        return None if width == 1 else [d[: width - 1] for d in drafts]

    def _verify(self, drafts: list[list[int]]) -> list[GenerationBatch.Response]:
        assert self.speculation is not None and self._last_step is not None
        width = 1 + max(len(d) for d in drafts)
        self._last_step = (len(self.uids), width, self._last_step[2])
        padded = mx.array([[*d, *[0] * (width - 1 - len(d))] for d in drafts], dtype=self._next_tokens.dtype)
        inputs = mx.concatenate([self._next_tokens[:, None], padded], axis=1)  # padding: never kept
        logits = self.model(inputs, cache=self.prompt_cache)  # (B, width, vocab)
        logits, guided = self._guide(logits, inputs, drafts)
        # Evaluated only where a request asks for log-probabilities: a logsumexp over the vocabulary
        # at every position is a large part of a wide verify's time on the CPU.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # Every greedy row's choice at each position, in one wait for the whole step. The argmax of
        # the logits: subtracting the logsumexp, one number per position, moves no maximum but for
        # a near-tie within rounding, such as a wider step's own matrix products already perturb.
        best = mx.argmax(logits, axis=-1)
        mx.eval(self._next_tokens, best)
        pending, best_by_row = _ints(self._next_tokens), best.tolist()
        kept, next_tokens, next_logprobs, kept_logprobs = [], [], [], []
        for index, row_drafts in enumerate(drafts):
            row_logprobs = logprobs[index]
            drafting = self.speculation.get(self.uids[index])
            if drafting is not None and drafting.temperature == 0.0:
                row_best: list[int] = best_by_row[index]  # type: ignore[assignment, index]
                num_kept = keep_greedy(row_drafts, row_best)
                token = row_best[num_kept]
            elif drafting is not None and row_drafts:
                scaled = row_logprobs * (1.0 / drafting.temperature)
                num_kept, token = keep_sampled(row_drafts, scaled)
            else:
                pending_token, processed = inputs[index, :1], index in guided
                token, row_logprobs = self._sample_alone(index, pending_token, logits[index, :1], processed)
                num_kept = 0
            kept.append(num_kept)
            next_tokens.append(token)
            next_logprobs.append(row_logprobs[num_kept])
            kept_logprobs.append(row_logprobs)
        realign(self.prompt_cache, [width - 1 - k for k in kept])

        fed = [[token, *d[:k]] for token, d, k in zip(pending, drafts, kept, strict=True)]
        fed_logprobs = [
            [self._next_logprobs[index], *[kept_logprobs[index][j] for j in range(k)]]
            for index, k in enumerate(kept)
        ]
        for uid, row_drafts, num_kept in zip(self.uids, drafts, kept, strict=True):
            if row_drafts:
                self.speculation.observe(uid, len(row_drafts), num_kept)
        self._current_tokens = self._next_tokens  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs
        self._next_tokens = mx.array(next_tokens, dtype=self._next_tokens.dtype)
        self._next_logprobs = next_logprobs
        return self._respond(fed, fed_logprobs)

    def _guide(
        self, logits: mx.array, inputs: mx.array, drafts: list[list[int]]
    ) -> tuple[mx.array, set[int]]:
        """Each drafting row with a grammar: its logits masked at every position as its grammar masks
        them, its drafts cut at the first the grammar refuses (`GrammarMatcher.mask_drafts`)."""
        assert self.speculation is not None
        masked: dict[int, mx.array] = {}
        for index, uid in enumerate(self.uids):
            drafting = self.speculation.get(uid)
            if drafting is None or drafting.grammar is None:
                continue
            if not masked:
                mx.async_eval(logits)  # the forward pass runs while the masks are computed
            context = self._token_context[index].update_and_fetch(inputs[index, :1])
            masked[index], num_allowed = drafting.grammar.mask_drafts(context, logits[index], drafts[index])
            del drafts[index][num_allowed:]
        if not masked:
            return logits, set()
        return mx.stack([masked.get(index, logits[index]) for index in range(len(self.uids))]), set(masked)

    def _keep_grammar_drafts(self, index: int, uid: int, drafts: list[int]) -> None:
        """A guided row's grammar and token context keep the drafts it answered, and only those."""
        assert self.speculation is not None
        drafting = self.speculation.get(uid)
        if drafting is None or drafting.grammar is None:
            return
        drafting.grammar.keep_drafts(len(drafts))
        if drafts:
            self._token_context[index].update_and_fetch(mx.array(drafts))

    def _sample_alone(
        self, index: int, token: mx.array, logits: mx.array, processed: bool = False
    ) -> tuple[int, mx.array]:
        """A row without drafts: its next token as mlx-lm's step samples it (its processors, unless
        the logits were `processed` already, then its sampler) from the logits at its pending token."""
        processors = (self.logits_processors[index] if self.logits_processors else None) or ()
        processors = () if processed else processors
        if processors:
            context = self._token_context[index].update_and_fetch(token)
            for processor in processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = (self.samplers[index] if self.samplers else None) or self.fallback_sampler
        return _ints(sampler(logprobs))[0], logprobs

    def _respond(
        self, fed: list[list[int]], fed_logprobs: list[list[mx.array]]
    ) -> list[GenerationBatch.Response]:
        """mlx-lm's responses, one per token fed; a row that ends part-way drops the rest of its tokens
        (its cache then holds more than it answered: trimmed where it is extracted)."""
        assert self.speculation is not None
        keep, responses = [], []
        for index, (uid, tokens) in enumerate(zip(self.uids, fed, strict=True)):
            self.speculation.fed(uid, tokens)
            finish_reason = None
            for position, token in enumerate(tokens):
                self._num_tokens[index] += 1
                if self._num_tokens[index] >= self.max_tokens[index]:
                    finish_reason = "length"
                if self._matchers[index].advance(token):
                    finish_reason = "stop"
                if finish_reason is None:
                    responses.append(
                        self.Response(uid, token, fed_logprobs[index][position], None, None, None)
                    )
                    continue
                unanswered = len(tokens) - 1 - position
                self._keep_grammar_drafts(index, uid, tokens[1 : position + 1])
                self.tokens[index].extend(tokens[: position + 1])
                cache = self.extract_cache(index)
                for layer in cache:
                    layer.trim(unanswered)
                responses.append(
                    self.Response(
                        uid, token, fed_logprobs[index][position], finish_reason, cache, self.tokens[index]
                    )
                )
                break
            if finish_reason is None:
                self._keep_grammar_drafts(index, uid, tokens[1:])
                self.tokens[index].extend(tokens)
                keep.append(index)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def _proposed(drafting: Drafting, guess: int, k: int) -> list[int]:
    """The drafter's k drafts after `guess` (its guess at the pending token), cut where the row's
    grammar refuses them."""
    drafts = drafting.drafter.propose(guess, k)
    if drafting.grammar is None or not drafts:
        return drafts
    return drafts[: max(drafting.grammar.num_allowed([guess, *drafts]) - 1, 0)]


def keep_greedy(drafts: list[int], best: list[int]) -> int:
    """How many leading drafts a greedy row keeps: those that are its logits' choice at the position
    before them (`best`: the argmax at each position fed)."""
    num_kept = 0
    while num_kept < len(drafts) and drafts[num_kept] == best[num_kept]:
        num_kept += 1
    return num_kept


def keep_sampled(drafts: list[int], scaled: mx.array) -> tuple[int, int]:
    """Speculative sampling with drafts that are certain (n-gram lookups): draft j is kept with
    probability p_j(draft) and a rejected one is replaced by a draw from p_j without it, so the
    tokens are distributed as draws from p would be. `scaled`: (len(drafts) + 1, vocab) logits over
    the temperature. Returns how many were kept and the token after them."""
    probs = mx.softmax(scaled, axis=-1)
    chances = _floats(probs[mx.arange(len(drafts)), mx.array(drafts)])
    draws = _floats(mx.random.uniform(shape=(len(drafts),)))
    for position, (chance, draw) in enumerate(zip(chances, draws, strict=True)):
        if draw >= chance:
            without = mx.where(mx.arange(scaled.shape[-1]) == drafts[position], -mx.inf, scaled[position])
            return position, _ints(mx.random.categorical(without[None]))[0]
    return len(drafts), _ints(mx.random.categorical(scaled[len(drafts) :]))[0]


def realign(caches: list[Any], rejected: list[int]) -> None:
    """After a verify step wrote `width` positions for every row, take back each row's `rejected`
    last ones: trim what every row rejected, then move each row that rejected more right by the
    difference (its left padding grows by as much), so every row ends at the shared write index."""
    common = min(rejected)
    moves = [r - common for r in rejected]
    for layer in caches:
        if common:
            layer.trim(common)
        if not any(moves):
            continue
        padding = layer.left_padding.tolist()
        end = layer._idx
        for name in ("keys", "values"):
            array = getattr(layer, name)
            # Copied out first, so that the write below can update the array in place.
            moved = {
                row: array[row : row + 1, :, padding[row] : end - move] * 1
                for row, move in enumerate(moves)
                if move
            }
            mx.eval(*moved.values())
            for row, history in moved.items():
                array[row : row + 1, :, padding[row] + moves[row] : end] = history
            del moved
        shift = mx.array(moves)
        layer.left_padding = layer.left_padding + shift
        layer.offset = layer.offset - shift


def speculative(generator: BatchGenerator, speculation: Speculation) -> BatchGenerator:
    """`generator` with a decode batch that verifies `speculation`'s drafts (before any sequence joins)."""
    assert len(generator._generation_batch) == 0
    batch = SpeculativeGenerationBatch.empty(generator.model, generator.sampler)
    batch.speculation = speculation
    generator._generation_batch = batch
    return generator


# What a decode batch holds and what `_verify` and `_respond` read and replace of it.
BATCH_STATE = (
    "uids", "prompt_cache", "tokens", "samplers", "fallback_sampler", "logits_processors", "max_tokens",
    "_current_tokens", "_current_logprobs", "_next_tokens", "_next_logprobs", "_token_context",
    "_num_tokens", "_matchers",
)  # fmt: skip


def check_speculative_batch() -> None:
    """The parts of mlx-lm's `GenerationBatch` a verify step reads and replaces."""
    require(
        "GenerationBatch.empty(model, fallback_sampler) builds an empty decode batch (speculative() "
        "installs its subclass so)",
        lambda: list(inspect.signature(GenerationBatch.empty).parameters) == ["model", "fallback_sampler"],
    )
    init = inspect.getsource(GenerationBatch.__init__)
    for name in BATCH_STATE:
        require(
            f"GenerationBatch keeps `self.{name}` (a verify step reads or replaces it)",
            lambda attribute: f"self.{attribute} =" in init,
            name,
        )
    fields = ("uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens")
    require(
        f"GenerationBatch.Response is ({', '.join(fields)}) (a verify step answers with it)",
        lambda: tuple(GenerationBatch.Response.__dataclass_fields__) == fields,
    )
    require(
        "GenerationBatch has `extract_cache(index)` and `filter(keep)` (a row ending part-way)",
        lambda: all(callable(getattr(GenerationBatch, name, None)) for name in ("extract_cache", "filter")),
    )
