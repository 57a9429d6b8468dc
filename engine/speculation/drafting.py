"""Which running sequences draft tokens for speculative decoding, their drafts, and their counts.

A sequence drafts from its own history (`ngram_drafts.py`: an agent rewriting a file, a diff or a
tool's output repeats long runs of tokens already in its context) or with a small draft model of the
same tokenizer (`model_drafts.py`). A decode step that checks k drafted tokens reads the weights
once, so each accepted draft is a token nearly for free (`mlx_adapter/speculative_batch.py` verifies
them in the batch's forward pass). A sequence drafts only where verifying keeps its reply exactly
what it would have been: greedy, or sampled at a plain temperature (the rejection rule keeps the
distribution), without logits processors (penalties: they read every token's context as it is
sampled) but a grammar (each drafted position is masked as its grammar would mask it there, and the
drafts rejected are taken back from the grammar), and without a seed (a seeded reply draws the same
random numbers as without drafts). A step verifies only as wide as it pays: each width's expected
tokens (every row's own, and the drafts each row can expect to keep, estimated from its verifies and
from its drafter's guesses at the tokens being computed) over what a step of that width costs as the
engine times it (`step_costs.py`), by a margin. On a GPU a wider step costs about what a one-token
step does, so drafts are nearly always verified; on a CPU a wide verify costs more than a one-token
step, so copies' drafts (most of them kept) are verified and free-form chat's wait, or ride a step
that verifies anyway. The batch owns this and gives it to the generator's decode batch; it is read
and changed on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.scheduling.step_costs import StepCosts
from semantic.engine.speculation.model_drafts import ModelDrafter
from semantic.engine.speculation.ngram_drafts import DraftLength, NgramDrafter

if TYPE_CHECKING:
    from semantic.engine.decoding.grammar_matcher import GrammarMatcher

# A verify must promise (1 + MARGIN) times a one-token step's tokens per second. Every row pays for
# a verify but keeps only its own drafts, and rows that started together finish with the one that
# kept fewest: with a smaller margin free-form chat decoded slower than without drafts, while a
# copy's verifies clear this one easily (bench/results/speculative_edit.json). On a GPU, where a
# wide step costs about what a one-token step does, it asks only that drafts keep half a token a row.
MARGIN = 0.5
MOST_DRAFTED = 8  # per row and step: the widest verify a copy's drafts (nine in ten kept) pay for on the CPU


def drafts_keep_reply(sampling: SamplingParams, has_processors: bool) -> bool:
    """Whether verifying drafts leaves a reply with these settings as it would be without them
    (`has_processors`: logits processors other than a grammar, which masks each draft's position)."""
    if has_processors or sampling.seed is not None:
        return False
    if sampling.is_greedy:
        return True
    plain = sampling.top_k in (None, 0) and sampling.top_p in (None, 1.0)
    return plain and sampling.min_p == 0.0 and sampling.xtc_probability == 0.0


class Drafter(Protocol):
    """One sequence's source of drafts, fed every token that goes into the sequence's cache."""

    def extend(self, tokens: Iterable[int]) -> None: ...

    def guess_next(self) -> int | None: ...

    def propose(self, pending: int, k: int) -> list[int]: ...


MakeDrafter = Callable[[Sequence[int]], Drafter]  # from the tokens a sequence joins with


def drafter_maker(speculate: str, draft_model: Any = None, num_token_ids: int = 0) -> MakeDrafter:
    """Each joining sequence's drafter: n-gram lookups, or the draft model loaded for `speculate`."""
    if speculate == "ngram":
        return NgramDrafter
    assert draft_model is not None, f"speculate = {speculate!r} without its draft model: a bug"
    return lambda tokens: ModelDrafter(draft_model, tokens, num_token_ids)


@dataclass(slots=True)
class Drafting:
    """One sequence's drafting: its drafter, how much to draft, and what came of it."""

    drafter: Drafter
    length: DraftLength
    temperature: float  # 0: greedy
    grammar: GrammarMatcher | None = None  # its logits' mask, applied at every position verified
    guess: int | None = None  # the drafter's guess at the token being computed, until it is fed
    num_drafted: int = 0
    num_accepted: int = 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.guess = None  # the verify judged it
        self.length.observe(num_drafted, num_accepted)
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted


class Speculation:
    """The drafting sequences of one batch, by generator uid."""

    def __init__(
        self,
        make_drafter: MakeDrafter = NgramDrafter,
        most_drafted: int = MOST_DRAFTED,
        *,
        margin: float = MARGIN,  # a verify promises (1 + margin) x a one-token step's tokens/s
    ) -> None:
        self._make_drafter = make_drafter
        self.margin = margin
        self._by_uid: dict[int, Drafting] = {}
        self._most = most_drafted
        self.costs = StepCosts()  # measured by the decode batch
        self.num_drafted = 0  # over the batch's life: verify steps' drafts and accepted drafts
        self.num_accepted = 0

    def add(
        self,
        uid: int,
        prompt: Sequence[int],
        sampling: SamplingParams,
        has_processors: bool,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """A sequence joins the batch with `prompt` in its cache (all of it, once prefilled);
        `has_processors`: logits processors besides its `grammar`."""
        if not drafts_keep_reply(sampling, has_processors):
            return
        assert sampling.temperature is not None
        length = DraftLength(start=min(4, self._most), most=self._most)
        self._by_uid[uid] = Drafting(self._make_drafter(prompt), length, sampling.temperature, grammar)

    def remove(self, uid: int) -> tuple[int, int]:
        """A sequence leaves; returns its drafted and accepted counts."""
        drafting = self._by_uid.pop(uid, None)
        return (0, 0) if drafting is None else (drafting.num_drafted, drafting.num_accepted)

    def clear(self) -> None:
        self._by_uid.clear()

    def get(self, uid: int) -> Drafting | None:
        return self._by_uid.get(uid)

    def width_worth(self, num_rows: int, offers: Sequence[tuple[DraftLength, int]]) -> int:
        """The step's width (1: a one-token step) that gives the most tokens per second: a step of
        `num_rows` rows where some offer drafts (each a row's draft length and how many it would
        draft), weighed against the measured cost of each width. Until a one-token step of these
        rows was measured, 1."""
        plain_seconds = self.costs.seconds(num_rows, 1)
        longest = max((num_drafts for _, num_drafts in offers), default=0)
        if plain_seconds is None or longest == 0:
            return 1
        best_width, best_rate = 1, (1.0 + self.margin) * num_rows / plain_seconds
        for width in range(2, longest + 2):
            seconds = self.costs.seconds(num_rows, width)
            assert seconds is not None, "a width without a cost, its one-token step with one: StepCosts' bug"
            expected = num_rows + sum(length.expected_kept(min(n, width - 1)) for length, n in offers)
            rate = expected / max(seconds, 1e-9)
            if rate > best_rate:
                best_width, best_rate = width, rate
        return best_width

    def fed(self, uid: int, tokens: Sequence[int]) -> None:
        """Tokens that went into the sequence's cache this step (its drafter's history)."""
        drafting = self._by_uid.get(uid)
        if drafting is None:
            return
        if drafting.guess is not None and tokens:  # a guess without drafts verified after it
            drafting.length.observe_guess(tokens[0] == drafting.guess)
            drafting.guess = None
        drafting.drafter.extend(tokens)

    def observe(self, uid: int, num_drafted: int, num_accepted: int) -> None:
        drafting = self._by_uid.get(uid)
        if drafting is not None:
            drafting.observe(num_drafted, num_accepted)
            self.num_drafted += num_drafted
            self.num_accepted += num_accepted
