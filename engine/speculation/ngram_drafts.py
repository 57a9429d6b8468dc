"""Drafts for speculative decoding, looked up in a sequence's own history (prompt lookup / n-grams).

An agent that edits or rewrites a file repeats long runs of its context, so the tokens that followed
an earlier occurrence of the sequence's last few tokens are likely to come next; the engine verifies
them in the batch's forward pass. Two pieces, one per sequence:
- `NgramDrafter` keeps a dict from each n-gram of the history to the position after its latest
  occurrence, so extending costs O(max_ngram) per token and proposing O(max_ngram + k), whatever the
  history's length. It follows a copy cursor while the fed tokens agree with it: a file being copied
  repeats snippets (`    return`) whose latest occurrence lies elsewhere in the file. A source
  that runs into the present (a loop, a rule of dashes, a table's rows) goes on repeating its period.
- `DraftLength` picks k from how well drafts did, turns drafting off (with probes that back off)
  where they keep failing, and estimates how many drafts a verify would keep, which the speculation
  weighs against what verifying costs (`speculation.py`), so free-form chat does not pay for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

GROWTH_TOKENS = 2  # grow k by this on a fully accepted draft: from the default 4 to 8 in two steps
NUM_FAILURES_TO_PAUSE = 3  # one poor verify is normal at an edit's boundary; three in a row: no repetition
FIRST_COOLDOWN_STEPS = 16  # short enough to catch a quoted block a line or so after it starts
MAX_COOLDOWN_STEPS = 512  # free-form text pays at most one failed 1-token probe per 512 steps
# A draft's chance of being kept: the first's, and each later one's given the one before it was
# (chat's guesses are often right but its runs are short; a copy's are both). A new
# sequence's (or a probe's) until its verifies and guesses say otherwise, worth this many of them,
# each counting less by a factor per one after it (a copy after a stretch of chat is believed soon).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
EVIDENCE_DECAY = 0.8


class NgramDrafter:
    """Drafts for one sequence from its own history: the tokens that followed the latest earlier
    occurrence of its last n tokens (n from max_ngram down to min_ngram)."""

    def __init__(self, tokens: Sequence[int], *, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self._max_ngram = max_ngram
        self._min_ngram = min_ngram
        self._tokens: list[int] = []
        # An n-gram is indexed only once a token follows it, so a suffix never finds itself.
        self._ngram_to_next: dict[tuple[int, ...], int] = {}
        # Where in the history the next token fed is expected to come from; None: no copy under way.
        self._cursor: int | None = None
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens now part of the sequence, in order (what was fed: pending and accepted drafts)."""
        history = self._tokens
        for token in tokens:
            position = len(history)
            if self._cursor is not None:
                assert self._cursor < position, "copy cursor ran into the present: NgramDrafter's bug"
                self._cursor = self._cursor + 1 if history[self._cursor] == token else None
            history.append(token)
            for n in range(self._min_ngram, min(self._max_ngram, position) + 1):
                self._ngram_to_next[tuple(history[position - n : position])] = position

    def guess_next(self) -> int | None:
        """The token expected to follow the history (the one the batch is computing as drafts are
        planned, so that planning never waits for it): the copy's next, or what followed the latest
        earlier occurrence of the history's last n tokens; None where nothing matches."""
        history = self._tokens
        if self._cursor is not None:
            return history[self._cursor]
        for n in range(min(self._max_ngram, len(history)), self._min_ngram - 1, -1):
            start = self._ngram_to_next.get(tuple(history[len(history) - n :]))
            if start is not None:
                return history[start]
        return None

    def propose(self, pending: int, k: int) -> list[int]:
        """Up to k tokens expected after the history and `pending` (the token about to be fed); []
        when k <= 0 or nothing matches."""
        if k <= 0:
            return []
        start = self._copy_start(pending)
        if start is None:
            start = self._lookup(pending)
            if start is None:
                return []
            self._cursor = start - 1  # aligned with pending, which extend() receives first
        history = self._tokens
        drafts = history[start : start + k]
        # A source that runs into the present goes on with what it predicts: a run that repeats
        # every few tokens (a loop, a rule of dashes, a table's rows) drafts k tokens, not one period.
        for position in range(start + len(drafts), start + k):
            drafts.append(pending if position == len(history) else drafts[position - len(history) - 1])
        return drafts

    def _copy_start(self, pending: int) -> int | None:
        """Where drafts continue a copy under way, if pending agrees with it."""
        cursor = self._cursor
        if cursor is None or self._tokens[cursor] != pending:
            return None
        return cursor + 1

    def _lookup(self, pending: int) -> int | None:
        """The position after the latest earlier occurrence of the longest n-gram ending in pending."""
        history = self._tokens
        for n in range(min(self._max_ngram, len(history) + 1), self._min_ngram - 1, -1):
            start = self._ngram_to_next.get((*history[len(history) - n + 1 :], pending))
            if start is not None:
                return start
        return None


class DraftLength:
    """How many tokens to draft for one sequence: grows while drafts are accepted, shrinks when they are
    not, and falls to 0 (drafting off, then a probe after a cool-down that doubles each time it fails
    again) where drafts keep failing, so free-form chat does not pay for verification. Also how many
    of n drafts a verify can expect to keep, from two chances: the first draft's (from verifies and
    the drafter's guesses) and each later one's, given the one before it was kept."""

    def __init__(self, *, start: int = 4, most: int = 8) -> None:
        if not 1 <= start <= most:
            raise ValueError(f"need 1 <= start <= most, got start={start}, most={most}")
        self._most = most
        self._num_tokens = start
        self._num_failures = 0  # verifies in a row that kept less than half their drafts
        self._cooldown_steps_left = 0
        self._next_cooldown_steps = FIRST_COOLDOWN_STEPS
        self._is_probing = False
        # Decayed counts of kept and missed drafts: first drafts (and guesses), and later ones.
        self._first = _Evidence()
        self._later = _Evidence()

    def expected_kept(self, num_drafts: int) -> float:
        """How many of `num_drafts` drafts a verify can expect to keep (each only if all before it are)."""
        later = self._later.chance
        return self._first.chance * sum(later**position for position in range(num_drafts))

    def observe_guess(self, was_right: bool) -> None:
        """Record whether the drafter's guess at a token it did not get to draft after was right: as
        good a sign of its first draft as a verify, and free (it counts toward the estimate of kept
        drafts only), so a copy is believed, and chat doubted, before anything is verified."""
        self._first.observe(int(was_right), int(not was_right))

    def wanted(self) -> int:
        """k for this decode step (0: do not draft); call once per step, as it counts a cool-down down."""
        if self._cooldown_steps_left > 0:
            self._cooldown_steps_left -= 1
            return 0
        return 1 if self._is_probing else self._num_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Record a verify of num_drafted > 0 drafts of which the first num_accepted were accepted."""
        if not 0 <= num_accepted <= num_drafted or num_drafted <= 0:
            raise ValueError(f"need 0 <= accepted <= drafted, drafted > 0; got {num_accepted}/{num_drafted}")
        self._first.observe(int(num_accepted > 0), int(num_accepted == 0))
        if num_accepted > 0 and num_drafted > 1:
            self._later.observe(num_accepted - 1, int(num_accepted < num_drafted))
        if self._is_probing:
            if num_accepted == 0:
                self._pause()
                return
            # Repetition is back: grow again from the probe's length, and back off from scratch later.
            self._is_probing = False
            self._num_tokens = 1
            self._next_cooldown_steps = FIRST_COOLDOWN_STEPS
        if num_accepted == num_drafted:
            self._num_failures = 0
            self._num_tokens = min(self._most, self._num_tokens + GROWTH_TOKENS)
            return
        # Halfway to what would have just sufficed: a copy's runs vary, one short run is no trend.
        shrunk = max(num_accepted + 1, (self._num_tokens + num_accepted + 1) // 2)
        self._num_tokens = min(self._most, shrunk)
        if 2 * num_accepted >= num_drafted:
            self._num_failures = 0
            return
        # A verify that kept less than half its drafts cost more than it gave (on the CPU a wide
        # verify costs more than a one-token step: bench/results/speculative_edit.json's chat).
        self._num_failures += 1
        if self._num_failures >= NUM_FAILURES_TO_PAUSE:
            self._pause()

    def _pause(self) -> None:
        self._num_failures = 0
        self._is_probing = True
        self._cooldown_steps_left = self._next_cooldown_steps
        self._next_cooldown_steps = min(MAX_COOLDOWN_STEPS, 2 * self._next_cooldown_steps)
        self._first, self._later = _Evidence(), _Evidence()  # a probe is judged as a new sequence's


class _Evidence:
    """A chance estimated from decayed counts of kept and missed drafts, from a prior."""

    def __init__(self) -> None:
        self._num_kept = PRIOR_WEIGHT * PRIOR_ACCEPTANCE
        self._num_missed = PRIOR_WEIGHT * (1.0 - PRIOR_ACCEPTANCE)

    @property
    def chance(self) -> float:
        return self._num_kept / (self._num_kept + self._num_missed)

    def observe(self, num_kept: int, num_missed: int) -> None:
        self._num_kept = EVIDENCE_DECAY * self._num_kept + num_kept
        self._num_missed = EVIDENCE_DECAY * self._num_missed + num_missed
