"""Which running sequences draft tokens for speculative decoding, their drafts, and their counts.

A sequence drafts from its own history (`ngram_drafts.py`: an agent rewriting a file, a diff or a
tool's output repeats long runs of tokens already in its context) or with a small draft model of the
same tokenizer (`model_drafts.py`). A decode step that checks k drafted tokens reads the weights
once, so each accepted draft is a token nearly for free (`mlx_adapter/speculative_batch.py`
verifies them in the batch's forward pass). A sequence drafts
only where verifying keeps its reply exactly what it would have been: greedy, or sampled at a plain
temperature (the rejection rule keeps the distribution), without logits processors (penalties, a
grammar: they read every token's context as it is sampled) and without a seed (a seeded reply
draws the same random numbers as without drafts). The batch owns this and gives it to the
generator's decode batch; it is read and changed on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from semantic.engine.model_drafts import ModelDrafter
from semantic.engine.ngram_drafts import DraftLength, NgramDrafter
from semantic.engine.sampling import SamplingParams

MOST_DRAFTED = 8  # per step: on this CPU a 9-token verify of 3 rows costs ~2x a one-token step


def drafts_keep_reply(sampling: SamplingParams, has_processors: bool) -> bool:
    """Whether verifying drafts leaves a reply with these settings as it would be without them."""
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
    assert draft_model is not None, f"speculate = {speculate!r} without its draft model: the runtime's bug"
    return lambda tokens: ModelDrafter(draft_model, tokens, num_token_ids)


@dataclass(slots=True)
class Drafting:
    """One sequence's drafting: its drafter, how much to draft, and what came of it."""

    drafter: Drafter
    length: DraftLength
    temperature: float  # 0: greedy
    num_drafted: int = 0
    num_accepted: int = 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.length.observe(num_drafted, num_accepted)
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted


class Speculation:
    """The drafting sequences of one batch, by generator uid."""

    def __init__(self, make_drafter: MakeDrafter = NgramDrafter, most_drafted: int = MOST_DRAFTED) -> None:
        self._make_drafter = make_drafter
        self._by_uid: dict[int, Drafting] = {}
        self._most = most_drafted
        self.num_drafted = 0  # over the batch's life: verify steps' drafts and accepted drafts
        self.num_accepted = 0

    def add(self, uid: int, prompt: Sequence[int], sampling: SamplingParams, has_processors: bool) -> None:
        """A sequence joins the batch with `prompt` in its cache (all of it, once prefilled)."""
        if not drafts_keep_reply(sampling, has_processors):
            return
        assert sampling.temperature is not None
        length = DraftLength(start=min(4, self._most), most=self._most)
        self._by_uid[uid] = Drafting(self._make_drafter(prompt), length, sampling.temperature)

    def remove(self, uid: int) -> tuple[int, int]:
        """A sequence leaves; returns its drafted and accepted counts."""
        drafting = self._by_uid.pop(uid, None)
        return (0, 0) if drafting is None else (drafting.num_drafted, drafting.num_accepted)

    def clear(self) -> None:
        self._by_uid.clear()

    def get(self, uid: int) -> Drafting | None:
        return self._by_uid.get(uid)

    def fed(self, uid: int, tokens: Sequence[int]) -> None:
        """Tokens that went into the sequence's cache this step (its drafter's history)."""
        drafting = self._by_uid.get(uid)
        if drafting is not None:
            drafting.drafter.extend(tokens)

    def observe(self, uid: int, num_drafted: int, num_accepted: int) -> None:
        drafting = self._by_uid.get(uid)
        if drafting is not None:
            drafting.observe(num_drafted, num_accepted)
            self.num_drafted += num_drafted
            self.num_accepted += num_accepted
