"""A sequence's logits masked by its output grammar, and the compiler that makes the matchers.

A turn's grammar (llguidance's format, written by `actors/prompting/output_grammars.py`) is compiled
into a `GrammarMatcher` in the tokenizer workers (`GrammarCompiler`, one per loaded model, compiled
grammars cached by their text within the turn's cache salt, so a compile's speed never tells one
tenant another's schema; a follower rank compiles on its engine thread), which refuses what
llguidance cannot enforce with a `GrammarError` (a 400): never silent non-enforcement. The matcher
then travels in the `GenerationRequest` to the engine thread, which alone uses it from then on:
mlx-lm's BatchGenerator calls it as that sequence's logits processor, so sequences without a grammar
pay nothing. A reply the grammar ended unfinished is an error, not a stop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from loguru import logger

MAX_CACHED_GRAMMARS = 64


# Between the triggers of a lazy grammar that has several (no call marker holds a NUL).
TRIGGER_SEPARATOR = "\x00"


class GrammarError(ValueError):
    """A schema or tool definition that cannot be enforced (unsupported keyword, bad regex, ...)."""


class IncompleteOutputError(RuntimeError):
    """A constrained reply that ended before its format was complete: the grammar allowed nothing
    that continues it. A format we accepted and could not finish is our fault (500), never "stop"."""


class GrammarMatcher:
    """One sequence's logits processor: called by the generator with the sequence's tokens and the
    next logits, once per step. From the second call on, the last of `tokens` is the one sampled from
    the previous (masked) step, which the matcher consumes before masking again.

    With a `trigger` the grammar is lazy: text is free until the model writes the trigger (a tool
    call's opening), then the grammar holds until it allows nothing but the reply's end (the call
    closed; where its closer is optional, the reply may end instead), and so on. The trigger may be
    several, joined by TRIGGER_SEPARATOR (a call block and its inner block, which models also write
    bare): the grammar then starts with the one the reply wrote, so it knows which.
    """

    def __init__(
        self,
        template: LLMatcher,
        tokenizer: LLTokenizer,
        eos_token_ids: list[int],
        grammar: str,
        trigger: str | None,
    ) -> None:
        self.grammar = grammar  # the source, so another rank can compile the same matcher
        self.trigger = trigger
        self._template = template  # this sequence's own copy
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._triggers = [t.encode() for t in trigger.split(TRIGGER_SEPARATOR)] if trigger else []
        self._matcher: LLMatcher | None = None if trigger else template
        self._pending = b""  # free text since the last call, as far as it may still hold a trigger
        self._num_calls = 0
        self.failure: str | None = None  # why the grammar forced the reply's end unfinished
        # Speculative decoding: what each draft consumed since `mask_drafts` changed, to take it back.
        self._drafted: list[tuple[LLMatcher | None, bytes, str | None, bool]] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return _masked(logits, self._next_mask(tokens, logits.shape[-1]))

    def num_allowed(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the next token to be consumed on, the grammar allows: inside a
        call, as far as the call goes (llguidance's `validate_tokens`); in free text, all of them."""
        matcher = self._matcher
        if matcher is None or matcher.is_stopped():
            return len(tokens) if matcher is None else 0
        return matcher.validate_tokens(list(tokens))

    def mask_drafts(self, tokens: mx.array, logits: mx.array, drafts: Sequence[int]) -> tuple[mx.array, int]:
        """A speculative verify's call: `logits` (1 + len(drafts), vocab) after the pending token (the
        last of `tokens`) and after each draft. Each position is masked as a call after the tokens
        before it would mask it, up to the first draft its mask refuses; returns the logits and how
        many drafts were allowed (consumed). `keep_drafts` then takes back those the verify rejected."""
        assert not self._drafted, "drafts masked twice without keep_drafts: the verify step's bug"
        vocab_size = logits.shape[-1]
        allowed = self._next_mask(tokens, vocab_size)
        masked = [_masked(logits[:1], allowed)]
        for position, draft in enumerate(drafts, start=1):
            if allowed is not None and not (draft < vocab_size and allowed[draft]):
                break
            self._drafted.append((self._matcher, self._pending, self.failure, self._consume(draft)))
            allowed = self._allowed_now(vocab_size)
            masked.append(_masked(logits[position : position + 1], allowed))
        num_allowed = len(masked) - 1
        return mx.concatenate([*masked, logits[num_allowed + 1 :]]), num_allowed

    def keep_drafts(self, num_kept: int) -> None:
        """After `mask_drafts`: the first `num_kept` drafts stay consumed, the rest are taken back, so
        the matcher is as it would be had only the tokens kept been decoded."""
        assert num_kept <= len(self._drafted), "more drafts kept than the grammar allowed: the verify's bug"
        for matcher, pending, failure, consumed in reversed(self._drafted[num_kept:]):
            if consumed:
                assert matcher is not None, "a draft consumed without a matcher: GrammarMatcher bug"
                if not matcher.rollback(1):
                    raise RuntimeError(f"the grammar could not take a draft back: {matcher.get_error()}")
            self._matcher, self._pending, self.failure = matcher, pending, failure
        self._drafted.clear()

    def _next_mask(self, tokens: mx.array, vocab_size: int) -> np.ndarray | None:
        if self._num_calls:
            self._consume(int(tokens[-1].item()))  # type: ignore[arg-type]
        self._num_calls += 1
        return self._allowed_now(vocab_size)

    def _allowed_now(self, vocab_size: int) -> np.ndarray | None:
        """The mask of the next token (None: free text, anything goes); notes a failure."""
        matcher = self._matcher
        if matcher is None:
            return None
        if matcher.is_error():
            logger.error("grammar matcher failed ({}); ending the sequence", matcher.get_error())
            self.failure = f"the output format's matcher failed: {matcher.get_error()}"
            allowed = np.zeros(vocab_size, dtype=np.bool_)
            allowed[[t for t in self._eos_token_ids if t < vocab_size]] = True
        else:
            allowed = token_mask(matcher, vocab_size)
            if allows_only_end(allowed, self._eos_token_ids):
                if not matcher.is_accepting():
                    self.failure = "the output format allows no token that continues the reply"
                elif self._triggers:  # the call is closed: free text again
                    self._matcher = None
                    return None
        return allowed

    def check_complete(self) -> None:
        """Raises IncompleteOutputError where the reply ended because the grammar could not go on;
        read after the sequence finished (the engine thread is done with the matcher)."""
        if self.failure is not None:
            raise IncompleteOutputError(
                f"the reply stopped before its output format was complete: {self.failure}"
            )

    def _consume(self, token: int) -> bool:
        """Feeds `token` to the grammar; returns whether the matcher that was current consumed it."""
        matcher, triggers = self._matcher, self._triggers
        if matcher is not None:
            consumed = not matcher.is_stopped()
            if consumed:
                matcher.consume_token(token)
            return consumed
        assert triggers, "a matcher without a trigger is never idle: GrammarMatcher bug"
        self._pending += self._tokenizer.decode_bytes([token])
        found = [(at, trigger) for trigger in triggers if (at := self._pending.find(trigger)) >= 0]
        if not found:
            self._pending = self._pending[-max(map(len, triggers)) :]
            return False
        at, trigger = min(found)
        rest, self._pending = self._pending[at + len(trigger) :], b""
        if len(triggers) > 1:  # the grammar starts with the trigger, to tell which opened the call
            rest = trigger + rest
        self._matcher = self._template.deep_copy()
        if rest:  # the token that completed the trigger also began the call
            self._matcher.consume_tokens(self._tokenizer.tokenize_bytes(rest))
        return False  # a new matcher: taking the token back drops it


def _masked(logits: mx.array, allowed: np.ndarray | None) -> mx.array:
    if allowed is None:
        return logits
    return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))


def token_mask(matcher: LLMatcher, vocab_size: int) -> np.ndarray:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, count=vocab_size, bitorder="little").astype(np.bool_)


def allows_only_end(allowed: np.ndarray, eos_token_ids: list[int]) -> bool:
    """Whether the mask allows nothing but the end (llguidance's answer where no text can follow)."""
    eos = [t for t in eos_token_ids if t < len(allowed)]
    return bool(allowed[eos].any()) and int(np.count_nonzero(allowed)) == int(np.count_nonzero(allowed[eos]))


class GrammarCompiler:
    """Grammars compiled for one model's tokenizer; used from the tokenizer workers only."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str | None, str], LLMatcher] = OrderedDict()  # by (scope, grammar)
        self.num_cache_hits = 0
        self.num_cache_misses = 0

    def matcher(self, grammar: str, trigger: str | None = None, scope: str | None = None) -> GrammarMatcher:
        """A fresh matcher for `grammar` (raises GrammarError if llguidance cannot enforce it),
        holding from the start or, with a `trigger`, each time the reply writes it; compiled ones
        are reused only within `scope` (the turn's cache salt)."""
        key = (scope, grammar)
        template = self._compiled.get(key)
        if template is None:
            self.num_cache_misses += 1
            template = LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
            if template.is_error():
                raise GrammarError(f"cannot enforce this output format: {template.get_error()}")
            vocab_size = self._llguidance_tokenizer().vocab_size
            if (
                allows_only_end(token_mask(template, vocab_size), self._eos_token_ids)
                and not template.is_accepting()
            ):
                raise GrammarError("cannot enforce this output format: no reply can satisfy it")
            self._compiled[key] = template
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self.num_cache_hits += 1
            self._compiled.move_to_end(key)
        return GrammarMatcher(
            template.deep_copy(),
            self._llguidance_tokenizer(),
            self._eos_token_ids,
            grammar,
            trigger or None,
        )

    def _llguidance_tokenizer(self) -> LLTokenizer:
        if self._ll_tokenizer is None:
            # mlx-lm's TokenizerWrapper hands attributes it lacks to the tokenizer it wraps.
            backend = getattr(self._tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise GrammarError(
                    "this model's tokenizer is not a fast (Rust) tokenizer: outputs cannot be constrained"
                )
            self._ll_tokenizer = LLTokenizer(backend.to_str(), eos_token=self._eos_token_ids)
        return self._ll_tokenizer
