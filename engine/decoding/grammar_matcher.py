"""A sequence's logits masked by its output grammar, and the compiler that makes the matchers.

A turn's grammar (llguidance's format, written by `actors/prompting/output_grammars.py`) is compiled
into a `GrammarMatcher` in the tokenizer workers (`GrammarCompiler`, one per loaded model, compiled
grammars cached by their text within the turn's cache salt, so a compile's speed never tells one
tenant another's schema; a follower rank compiles on its engine thread), which refuses what
llguidance cannot enforce with a `GrammarError` (a 400): never silent non-enforcement. The matcher
then travels in the `GenerationRequest` to the engine thread, which alone uses it from then on: the
decode batch asks it for each step's mask (`next_mask`) and masks every guided row in one op
(`engine/mlx_adapter/guided_batch.py`), or mlx-lm's per-row path calls it as that sequence's logits
processor; sequences without a grammar pay nothing. A reply the grammar ended unfinished is an
error, not a stop.

A lazy grammar's matcher in free text never waits for the token just sampled (mlx-lm computes it
while the next step is queued): it reads each token one step late and masks the step on the device,
with the mask each token that could complete a trigger would bring (`TriggerLookahead`). Where it
must read the token at once (inside a call), it queues the step's forward pass first, so the mask
is computed while the device runs the model.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from loguru import logger

MAX_CACHED_GRAMMARS = 64
# A free-text state after which more tokens than this could complete a trigger (text ending with a
# trigger but its last character, where many tokens begin with that) is stepped synchronously: at
# most one step a call, and a state's masks stay this many rows.
MAX_LOOKAHEAD_TOKENS = 64


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

    In free text, with a `lookahead`, the token just sampled is left lagging (still being computed)
    and consumed at the next call, when it is ready; the step is masked on the device by what that
    token would open. Every step's mask is the one a matcher consuming each token at once applies.
    """

    def __init__(
        self,
        template: LLMatcher,
        tokenizer: LLTokenizer,
        eos_token_ids: list[int],
        grammar: str,
        trigger: str | None,
        lookahead: TriggerLookahead | None = None,
    ) -> None:
        self.grammar = grammar  # the source, so another rank can compile the same matcher
        self.trigger = trigger
        self._template = template  # this sequence's own copy
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._triggers = [t.encode() for t in trigger.split(TRIGGER_SEPARATOR)] if trigger else []
        self._lookahead = lookahead if trigger else None
        self.lags = self._lookahead is not None  # free text read a step late (False: every step at once)
        self._matcher: LLMatcher | None = None if trigger else template
        self._pending = b""  # free text since the last call, as far as it may still hold a trigger
        self._num_calls = 0
        # The token a free-text step left for the next call to consume, and that step's vocabulary.
        self._lagging: mx.array | None = None
        self._lagging_vocab_size = 0
        # Why the grammar forced the reply's end unfinished, as of the tokens consumed.
        self.failure: str | None = None
        # Speculative decoding: what each draft consumed since `mask_drafts` changed, to take it back.
        self._drafted: list[tuple[LLMatcher | None, bytes, str | None, bool]] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm's per-row logits-processor call: this row's `logits` masked after the last of `tokens`."""
        token = tokens[-1]
        allowed = self.next_mask(token, logits)
        if self._lagging is not None:
            # mlx-lm evaluates the row's token context after the step's forward pass: queued now, so
            # the next call's read waits for this token only.
            mx.async_eval(token)
        return masked_rows(logits, [allowed])

    def next_mask(self, token: mx.array, logits: mx.array) -> mx.array | None:
        """The mask (vocab,) of the step whose logits are `logits` (this row's, or its whole batch's),
        after `token`, the one sampled from the previous step: None where anything goes.

        In free text, with a lookahead, `token` is not read: it is left lagging, consumed at the
        next call, and the mask after it chosen on the device. Where the grammar must read it now,
        `logits` are queued first: the device computes them while this waits and computes the mask."""
        self._catch_up()
        vocab_size = logits.shape[-1]
        lookahead = self._lookahead
        if self.lags and self._num_calls and self._matcher is None and lookahead is not None:
            # None: more could open a call than it masks at once, or a token could lead to a state
            # whose mask bans openers the grammar refuses: stepped synchronously.
            completions = lookahead.completions(self._pending, vocab_size)
            if completions is not None:
                self._num_calls += 1
                self._lagging, self._lagging_vocab_size = token, vocab_size
                return completions.mask_after(token)
        mx.async_eval(logits)
        allowed = self._next_mask(token, vocab_size)
        return _on_device(allowed)

    def num_allowed(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the next token to be consumed on, the grammar allows: inside a
        call, as far as the call goes (llguidance's `validate_tokens`); in free text, all of them."""
        self._catch_up()
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
        mx.async_eval(logits)  # the verify's forward pass computes while the masks are
        vocab_size = logits.shape[-1]
        allowed = self._next_mask(tokens[-1], vocab_size)
        masked = [masked_rows(logits[:1], [_on_device(allowed)])]
        for position, draft in enumerate(drafts, start=1):
            if allowed is not None and not (draft < vocab_size and allowed[draft]):
                break
            self._drafted.append((self._matcher, self._pending, self.failure, self._consume(draft)))
            allowed = self._allowed_now(vocab_size)
            masked.append(masked_rows(logits[position : position + 1], [_on_device(allowed)]))
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

    def _next_mask(self, token: mx.array, vocab_size: int) -> np.ndarray | None:
        self._catch_up()
        if self._num_calls:
            self._consume(int(token.item()))  # type: ignore[arg-type]
        self._num_calls += 1
        return self._allowed_now(vocab_size)

    def _catch_up(self) -> None:
        """Consumes the token the last free-text step left lagging (ready by now: mlx-lm evaluates
        each step's input before it returns), then notes what that step's mask did (a failure, a
        call closed), as it would have."""
        if self._lagging is None:
            return
        token, self._lagging = int(self._lagging.item()), None  # type: ignore[arg-type]
        self._consume(token)
        if self._matcher is not None:  # free text's mask notes nothing
            self._allowed_now(self._lagging_vocab_size)

    def _allowed_now(self, vocab_size: int) -> np.ndarray | None:
        """The mask of the next token (None: free text, anything goes); notes a failure."""
        matcher = self._matcher
        if matcher is None:
            return self._lookahead.free_mask(self._pending, vocab_size) if self._lookahead else None
        allowed, failure = _next_allowed(matcher, vocab_size, self._eos_token_ids)
        if failure is not None:
            if matcher.is_error():
                logger.error("grammar matcher failed ({}); ending the sequence", matcher.get_error())
            self.failure = failure
        elif self._triggers and allows_only_end(allowed, self._eos_token_ids):
            self._matcher = None  # the call is closed: free text again
            return None
        return allowed

    def check_complete(self) -> None:
        """Raises IncompleteOutputError where the reply ended because the grammar could not go on;
        read after the sequence finished (the engine thread is done with the matcher, and the token
        its last free-text step left lagging is long evaluated)."""
        self._catch_up()
        if self.failure is not None:
            raise IncompleteOutputError(
                f"the reply stopped before its output format was complete: {self.failure}"
            )

    def _consume(self, token: int) -> bool:
        """Feeds `token` to the grammar; returns whether the matcher that was current consumed it."""
        matcher = self._matcher
        if matcher is not None:
            consumed = not matcher.is_stopped()
            if consumed:
                matcher.consume_token(token)
            return consumed
        assert self._triggers, "a matcher without a trigger is never idle: GrammarMatcher bug"
        text = self._pending + self._tokenizer.decode_bytes([token])
        self._matcher, self._pending = _open_call(text, self._triggers, self._template, self._tokenizer)
        return False  # a new matcher: taking the token back drops it


def _open_call(
    text: bytes, triggers: list[bytes], template: LLMatcher, tokenizer: LLTokenizer
) -> tuple[LLMatcher | None, bytes]:
    """Free `text` (the pending text and the newest token's): the matcher of the call its first
    trigger opened (a copy of `template`, fed what followed the trigger) and no pending text, or no
    matcher and the end of `text` that may still begin a trigger."""
    rest = _call_text(text, triggers)
    if rest is None:
        return None, text[-max(map(len, triggers)) :]
    # The token that completed the trigger may also have begun the call.
    return _fed(template, tokenizer.tokenize_bytes(rest) if rest else []), b""


def _fed(template: LLMatcher, tokens: list[int]) -> LLMatcher:
    """A call's matcher: a copy of `template` that has consumed the call's first `tokens`."""
    matcher = template.deep_copy()
    if tokens:
        matcher.consume_tokens(tokens)
    return matcher


def _call_text(text: bytes, triggers: list[bytes]) -> bytes | None:
    """What of free `text` its first trigger opened a call with (None: no trigger in it): what
    followed the trigger, and with several triggers the trigger too (the grammar starts with it, to
    tell which opened the call)."""
    found = [(at, trigger) for trigger in triggers if (at := text.find(trigger)) >= 0]
    if not found:
        return None
    at, trigger = min(found)
    rest = text[at + len(trigger) :]
    return trigger + rest if len(triggers) > 1 else rest


def _next_allowed(
    matcher: LLMatcher, vocab_size: int, eos_token_ids: list[int]
) -> tuple[np.ndarray, str | None]:
    """The mask after `matcher`'s tokens and, where it can only end the reply unfinished, why."""
    if matcher.is_error():
        allowed = np.zeros(vocab_size, dtype=np.bool_)
        allowed[[t for t in eos_token_ids if t < vocab_size]] = True
        return allowed, f"the output format's matcher failed: {matcher.get_error()}"
    allowed = token_mask(matcher, vocab_size)
    if allows_only_end(allowed, eos_token_ids) and not matcher.is_accepting():
        return allowed, "the output format allows no token that continues the reply"
    return allowed, None


class TriggerIndex:
    """A tokenizer's tokens that can complete a trigger set: those whose text holds a whole trigger,
    and, by bisection of the sorted texts, those that begin with what a trigger's prefix lacks."""

    def __init__(self, token_texts: list[bytes], triggers: list[bytes]) -> None:
        self.triggers = triggers
        self._sorted_ids = sorted(range(len(token_texts)), key=token_texts.__getitem__)
        self._sorted_texts = [token_texts[t] for t in self._sorted_ids]
        self._holding = {t for t, text in enumerate(token_texts) if any(tr in text for tr in triggers)}
        self._prefixes = {trigger[:length] for trigger in triggers for length in range(1, len(trigger))}
        self._prefix_ends = {prefix[-1:] for prefix in self._prefixes}
        self._max_prefix_len = max(map(len, triggers)) - 1
        self.trigger_prefixes = sorted(self._prefixes)
        self._ends: dict[bytes, bool] = {}  # by trigger prefix: whether a token's text ends with it
        self._texts = set(token_texts)

    def open_prefix(self, pending: bytes) -> bytes:
        """The longest end of trigger-free `pending` that some trigger begins with: all of
        `pending` that a next token's text can complete a trigger with."""
        if pending[-1:] not in self._prefix_ends:  # most text
            return b""
        for length in range(min(len(pending), self._max_prefix_len), 0, -1):
            if pending[-length:] in self._prefixes:
                return pending[-length:]
        return b""

    def completing(self, prefix: bytes) -> list[int]:
        """The tokens whose text after `prefix` (an `open_prefix`) holds a trigger, in id order."""
        found = set(self._holding)
        for length in range(1, len(prefix) + 1):
            end = prefix[-length:]
            for trigger in self.triggers:
                if len(trigger) > length and trigger.startswith(end):
                    found.update(self._starting_with(trigger[length:]))
        return sorted(found)

    def reaches(self, prefix: bytes, state: bytes) -> bool:
        """Whether one token's text after `prefix` (an `open_prefix`) ends with trigger prefix `state`
        (a state the pending text can then be in): a token ending with all of it, or one that is
        exactly the rest of it where `prefix` ends with its beginning."""
        if self._ending_with(state):
            return True
        return any(
            prefix.endswith(state[:cut]) and state[cut:] in self._texts for cut in range(1, len(state))
        )

    def _ending_with(self, text: bytes) -> bool:
        found = self._ends.get(text)
        if found is None:
            found = self._ends[text] = any(token.endswith(text) for token in self._sorted_texts)
        return found

    def _starting_with(self, text: bytes) -> list[int]:
        at = bisect_left(self._sorted_texts, text)
        found = []
        while at < len(self._sorted_texts) and self._sorted_texts[at].startswith(text):
            found.append(self._sorted_ids[at])
            at += 1
        return found


@dataclass(frozen=True, slots=True)
class Completions:
    """The tokens that would open a call from one free-text state, and the mask each brings."""

    token_ids: mx.array  # (n,)
    # (n + 1, vocab): after each of `token_ids`, then still free (openers the grammar refuses banned)
    masks: mx.array
    bans: bool  # whether the still-free row bans any token

    def mask_after(self, token: mx.array) -> mx.array | None:
        """The mask (vocab,) after `token`, chosen on the device (`token` is never waited for); None
        where nothing is banned whatever `token` is."""
        if self.token_ids.size == 0:
            return self.masks[0] if self.bans else None
        row = mx.argmax(mx.concatenate([self.token_ids == token, mx.array([True])]))
        return self.masks[row]


@dataclass(slots=True)
class TriggerLookahead:
    """One lazy grammar's `Completions` by the free-text state they follow (the pending text's
    `open_prefix`), computed once on the engine thread and shared by that grammar's matchers.

    An opener the grammar refuses (a token that completes the trigger and carries on with what the
    call cannot begin with, `>,` after `<tool_call`) is banned in the state it would follow, as a
    call's masks ban what the call cannot hold. A state from which one token reaches a state with
    such bans is stepped synchronously: its mask depends on a token not yet read."""

    template: LLMatcher  # never fed: each completion feeds a copy
    tokenizer: LLTokenizer
    eos_token_ids: list[int]
    index: TriggerIndex
    # None: a state stepped synchronously (too many tokens complete a trigger from it, or risky).
    _by_prefix: dict[tuple[bytes, int], Completions | None] = field(default_factory=dict, init=False)
    _refused: dict[bytes, list[int]] = field(default_factory=dict, init=False)
    _risky: dict[bytes, bool] = field(default_factory=dict, init=False)
    _first_mask: np.ndarray | None = field(default=None, init=False)  # before any of a call

    def completions(self, pending: bytes, vocab_size: int) -> Completions | None:
        key = (self.index.open_prefix(pending), vocab_size)
        if key not in self._by_prefix:
            self._by_prefix[key] = self._completions(*key)
        return self._by_prefix[key]

    def free_mask(self, pending: bytes, vocab_size: int) -> np.ndarray | None:
        """Free text's mask after `pending`: None (anything goes) or the openers the grammar refuses
        banned."""
        refused = self.refused(self.index.open_prefix(pending))
        if not refused:
            return None
        allowed = np.ones(vocab_size, dtype=np.bool_)
        allowed[[token for token in refused if token < vocab_size]] = False
        return allowed

    def refused(self, prefix: bytes) -> list[int]:
        """The tokens that complete a trigger after `prefix` into a call the grammar cannot go on with.
        Thousands may complete a trigger such as "def " or "e": a call they begin with a token the
        grammar's first mask refuses is refused, one begun with a token it allows goes on (its masks
        allow exactly the tokens it can go on from), and only a call begun with more tokens than
        one is opened and fed them."""
        if prefix not in self._refused:
            if self._first_mask is None:
                self._first_mask = token_mask(self.template, self.tokenizer.vocab_size)
            refused = []
            for token in self.index.completing(prefix):
                rest = _call_text(prefix + self.tokenizer.decode_bytes([token]), self.index.triggers)
                assert rest is not None, "a completing token opened no call: TriggerIndex bug"
                begun = self.tokenizer.tokenize_bytes(rest) if rest else []
                if begun and not self._first_mask[begun[0]]:
                    refused.append(token)
                    continue
                if len(begun) <= 1:  # a call not begun, or begun with a token its first mask allows
                    continue
                matcher = _fed(self.template, begun)
                if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
                    refused.append(token)
            self._refused[prefix] = refused
        return self._refused[prefix]

    def _opened(self, prefix: bytes, token: int) -> LLMatcher:
        """The call `token` opens after `prefix` (one of `index.completing(prefix)`)."""
        text = prefix + self.tokenizer.decode_bytes([token])
        matcher, _ = _open_call(text, self.index.triggers, self.template, self.tokenizer)
        assert matcher is not None, "a completing token opened no call: TriggerIndex bug"
        return matcher

    def _is_risky(self, prefix: bytes) -> bool:
        """Whether one token after `prefix` can reach a trigger prefix with bans of its own (beyond
        those of every state: tokens holding a whole trigger and refused)."""
        if prefix not in self._risky:
            everywhere = set(self.refused(b""))
            self._risky[prefix] = any(
                self.index.reaches(prefix, state)
                for state in self.index.trigger_prefixes
                if set(self.refused(state)) - everywhere
            )
        return self._risky[prefix]

    def _completions(self, prefix: bytes, vocab_size: int) -> Completions | None:
        token_ids = self.index.completing(prefix)
        if len(token_ids) > MAX_LOOKAHEAD_TOKENS or self._is_risky(prefix):
            return None
        free = self.free_mask(b"", vocab_size)  # still free: bans that hold in every state
        free = np.ones(vocab_size, dtype=np.bool_) if free is None else free
        masks = []
        for token in token_ids:
            allowed, failure = _next_allowed(self._opened(prefix, token), vocab_size, self.eos_token_ids)
            closed = failure is None and allows_only_end(allowed, self.eos_token_ids)  # free text again
            masks.append(free if closed else allowed)
        masks.append(free)
        bans = not bool(free.all())
        return Completions(mx.array(token_ids, dtype=mx.int32), mx.array(np.stack(masks)), bans)


def masked_rows(logits: mx.array, allowed: Sequence[mx.array | None]) -> mx.array:
    """`logits` (rows, vocab) with each row's banned tokens at -inf: `allowed` holds a mask (vocab,)
    a row, or None where anything goes. One op for the rows, whatever their number."""
    if all(mask is None for mask in allowed):
        return logits
    vocab_size = logits.shape[-1]
    rows = [mx.ones(vocab_size, dtype=mx.bool_) if mask is None else mask for mask in allowed]
    stacked = rows[0] if len(rows) == 1 else mx.stack(rows)
    return mx.where(stacked, logits, mx.array(-np.inf, dtype=logits.dtype))


def _on_device(allowed: np.ndarray | None) -> mx.array | None:
    return None if allowed is None else mx.array(allowed)


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
        # By (scope, grammar): the compiled template and its lookahead by trigger.
        self._compiled: OrderedDict[tuple[str | None, str], _Compiled] = OrderedDict()
        self._trigger_indexes: dict[str, TriggerIndex] = {}
        self.num_cache_hits = 0
        self.num_cache_misses = 0

    def matcher(self, grammar: str, trigger: str | None = None, scope: str | None = None) -> GrammarMatcher:
        """A fresh matcher for `grammar` (raises GrammarError if llguidance cannot enforce it),
        holding from the start or, with a `trigger`, each time the reply writes it; compiled ones
        are reused only within `scope` (the turn's cache salt)."""
        key = (scope, grammar)
        compiled = self._compiled.get(key)
        if compiled is None:
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
            compiled = self._compiled[key] = _Compiled(template)
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self.num_cache_hits += 1
            self._compiled.move_to_end(key)
        lookahead = None
        if trigger:
            lookahead = compiled.lookaheads.get(trigger)
            if lookahead is None:
                lookahead = compiled.lookaheads[trigger] = TriggerLookahead(
                    compiled.template.deep_copy(),  # the engine thread's own
                    self._llguidance_tokenizer(),
                    self._eos_token_ids,
                    self._trigger_index(trigger),
                )
        return GrammarMatcher(
            compiled.template.deep_copy(),
            self._llguidance_tokenizer(),
            self._eos_token_ids,
            grammar,
            trigger or None,
            lookahead,
        )

    def _trigger_index(self, trigger: str) -> TriggerIndex:
        index = self._trigger_indexes.get(trigger)
        if index is None:
            tokenizer = self._llguidance_tokenizer()
            texts = [tokenizer.decode_bytes([token]) for token in range(tokenizer.vocab_size)]
            triggers = [t.encode() for t in trigger.split(TRIGGER_SEPARATOR)]
            index = self._trigger_indexes[trigger] = TriggerIndex(texts, triggers)
        return index

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


@dataclass(slots=True)
class _Compiled:
    template: LLMatcher  # never fed: each matcher gets a copy
    lookaheads: dict[str, TriggerLookahead] = field(default_factory=dict)  # by trigger
