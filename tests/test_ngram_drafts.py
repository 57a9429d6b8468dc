"""n-gram drafts: checked against a brute-force lookup, on file copies, and the draft length's back-off."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from semantic.engine.speculation.ngram_drafts import (
    FIRST_COOLDOWN_STEPS,
    MAX_COOLDOWN_STEPS,
    NUM_FAILURES_TO_PAUSE,
    DraftLength,
    NgramDrafter,
)

SNIPPET = [1, 2, 3, 4, 5]  # a run repeated all over a file, like `    return`
small_alphabet = st.integers(min_value=0, max_value=3)
ngram_bounds = st.tuples(st.integers(1, 5), st.integers(0, 3)).map(lambda b: (b[0] + b[1], b[0]))


def latest_match(history: list[int], pending: int, max_ngram: int, min_ngram: int) -> int | None:
    """Brute force: the position after the latest earlier occurrence of the longest matching n-gram
    that has a token of history after it."""
    sequence = [*history, pending]
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(sequence) < n:
            continue
        for start in range(len(history) - 1, n - 1, -1):
            if history[start - n : start] == sequence[-n:]:
                return start
    return None


def continued(history: list[int], pending: int, start: int, k: int) -> list[int]:
    """k drafts from `start` on: the history, then pending, then the drafts themselves, where the
    source runs into the present (a run that repeats itself every few tokens)."""
    sequence = [*history, pending]
    for offset in range(k):
        sequence.append(sequence[start + offset])
    return sequence[len(history) + 1 :]


def accepted_prefix(drafts: list[int], truth: list[int]) -> list[int]:
    """What a greedy verify keeps: the drafts up to the first that differs from the sequence."""
    pairs = itertools.takewhile(lambda pair: pair[0] == pair[1], zip(drafts, truth, strict=False))
    return [draft for draft, _ in pairs]


def file_with_snippets(num_lines: int) -> list[int]:
    """Lines of unique tokens, each with SNIPPET in its middle."""
    ids = itertools.count(100)
    return [token for _ in range(num_lines) for token in [*itertools.islice(ids, 3), *SNIPPET, next(ids)]]


@given(
    st.lists(small_alphabet, max_size=60),
    small_alphabet,
    st.integers(-1, 6),
    ngram_bounds,
    st.lists(st.integers(1, 10), max_size=8),
)
def test_a_fresh_drafter_proposes_what_followed_the_latest_longest_match(
    history: list[int], pending: int, k: int, bounds: tuple[int, int], chunk_sizes: list[int]
) -> None:
    max_ngram, min_ngram = bounds
    drafter = NgramDrafter([], max_ngram=max_ngram, min_ngram=min_ngram)
    fed = 0
    for size in chunk_sizes:  # built in chunks: extend must index the same as one go
        drafter.extend(history[fed : fed + size])
        fed += size
    drafter.extend(history[fed:])
    assert len(drafter) == len(history)
    start = latest_match(history, pending, max_ngram, min_ngram)
    expected = [] if start is None or k <= 0 else continued(history, pending, start, k)
    assert drafter.propose(pending, k) == expected


@given(st.lists(small_alphabet, max_size=60), ngram_bounds)
def test_a_fresh_drafter_guesses_what_followed_the_latest_longest_match_of_its_history(
    history: list[int], bounds: tuple[int, int]
) -> None:
    max_ngram, min_ngram = bounds
    expected = None
    for n in range(min(max_ngram, len(history)), min_ngram - 1, -1):
        starts = [p for p in range(len(history) - 1, n - 1, -1) if history[p - n : p] == history[-n:]]
        if starts:
            expected = history[starts[0]]
            break
    assert NgramDrafter(history, max_ngram=max_ngram, min_ngram=min_ngram).guess_next() == expected


@given(
    st.integers(1, 12).flatmap(lambda top: st.lists(st.integers(0, top), min_size=1, max_size=120)),
    st.integers(1, 6),
    ngram_bounds,
)
def test_drafts_always_follow_an_earlier_occurrence_of_the_current_suffix(
    sequence: list[int], k: int, bounds: tuple[int, int]
) -> None:
    """Fed as a verifying engine feeds it: pending, then the drafts that agree with the sequence."""
    max_ngram, min_ngram = bounds
    drafter = NgramDrafter(sequence[:1], max_ngram=max_ngram, min_ngram=min_ngram)
    position = 1
    while position < len(sequence):
        history, pending = sequence[:position], sequence[position]
        drafts = drafter.propose(pending, k)
        assert len(drafts) <= k
        if latest_match(history, pending, max_ngram, min_ngram) is None:
            assert drafts == []
        else:
            assert drafts, "a match exists, so there is something to draft"
            suffix = [*history, pending][-min_ngram:]
            assert any(
                history[start - min_ngram : start] == suffix
                and continued(history, pending, start, len(drafts)) == drafts
                for start in range(min_ngram, len(history) + 1)
            ), f"{drafts} never followed {suffix} in {history}"
        accepted = accepted_prefix(drafts, sequence[position + 1 :])
        drafter.extend([pending, *accepted])
        position += 1 + len(accepted)
        assert len(drafter) == position


@pytest.mark.parametrize("k", [1, 4, 8])
def test_a_file_being_copied_is_drafted_exactly_despite_repeated_snippets(k: int) -> None:
    source = file_with_snippets(40)
    copied = 3  # the copy has started: the first line's unique tokens place it
    drafter = NgramDrafter(source + source[:copied])
    plain_lookups_differ = False
    for step in itertools.count():
        if copied + 1 + k > len(source):
            break
        pending = source[copied]
        if step > 0:  # the copy under way guesses the token the batch is computing
            assert drafter.guess_next() == pending
        drafts = drafter.propose(pending, k)
        assert drafts == source[copied + 1 : copied + 1 + k], f"step {step} at {copied}"
        plain = NgramDrafter(source + source[:copied]).propose(pending, k)
        plain_lookups_differ |= plain != drafts
        num_accepted = step % (k + 1)  # drafting off, partial and full accepts all keep the copy
        drafter.extend([pending, *drafts[:num_accepted]])
        copied += 1 + num_accepted
    assert plain_lookups_differ, "the latest occurrence alone never jumped: the test shows no cursor"


def test_a_copy_that_departs_from_its_source_drafts_from_the_new_one() -> None:
    source = file_with_snippets(20)
    first, second = source[:90], source[90:]
    drafter = NgramDrafter(source + first[:40])
    assert drafter.propose(first[40], 4) == first[41:45]
    drafter.extend([first[40], *first[41:45]])
    assert drafter.propose(second[0], 4) == []  # the agent jumped: nothing ends in (first[44], second[0])
    drafter.extend([second[0]])
    assert drafter.propose(second[1], 4) == second[2:6]


def test_a_copy_resumes_only_where_every_token_since_agreed() -> None:
    drafter = NgramDrafter([10, 11, 12, 13, 14, 15, 16, 10, 11])
    assert drafter.propose(12, 2) == [13, 14]
    drafter.extend([12])
    assert drafter.propose(99, 2) == []  # a new token: the copy is off
    drafter.extend([99])
    assert drafter.propose(14, 2) == []  # 14 is where the copy would have been, but 13 never came


def test_drafts_that_reach_the_present_go_on_repeating_its_period() -> None:
    drafter = NgramDrafter([7, 8, 9, 7, 8])
    assert drafter.propose(9, 8) == [7, 8, 9, 7, 8, 9, 7, 8]  # after the first 7 8 9, every 3 tokens
    assert len(drafter) == 5
    assert NgramDrafter([7, 8]).propose(7, 4) == []  # its only 7 has no token after it yet
    assert NgramDrafter([3, 3, 3]).propose(3, 4) == [3, 3, 3, 3]
    looping = NgramDrafter([5, 6, 3, 3, 3])
    assert looping.propose(3, 2) == [3, 3]
    looping.extend([3, 3, 3])  # the copy, one token behind the present, stays on
    assert looping.guess_next() == 3
    assert looping.propose(3, 3) == [3, 3, 3]


def test_a_long_history_steps_without_rescanning() -> None:
    """50K tokens of history, then 2K decode steps: per-step work must not grow with the history."""
    rng = random.Random(0)
    history = [rng.randrange(1000) for _ in range(48_000)]
    history += history[1000:3000]
    drafter = NgramDrafter(history)
    sequence = history + history[3000:21_000]  # the copy goes on
    position = len(history)
    num_accepted = 0
    for _ in range(2000):
        pending = sequence[position]
        drafts = drafter.propose(pending, 8)
        accepted = accepted_prefix(drafts, sequence[position + 1 :])
        drafter.extend([pending, *accepted])
        position += 1 + len(accepted)
        num_accepted += len(accepted)
    assert len(drafter) == position
    assert num_accepted >= 8 * 1900  # copying: nearly every draft is accepted


def test_bad_ngram_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter([], max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter([], min_ngram=0)


def test_draft_length_grows_to_most_and_shrinks_halfway_to_what_sufficed() -> None:
    length = DraftLength(start=4, most=8)
    seen = []
    for _ in range(4):
        k = length.wanted()
        seen.append(k)
        length.observe(k, k)
    assert seen == [4, 6, 8, 8]
    length.observe(8, 4)
    assert length.wanted() == 6  # halfway from 8 to the 5 that would have sufficed
    length.observe(6, 1)  # less than half kept: a failure
    assert length.wanted() == 4
    length.observe(4, 0)
    assert length.wanted() == 2  # two failures in a row: still drafting
    length.observe(2, 1)  # half or more kept: the failures no longer count
    assert length.wanted() == 2
    length.observe(2, 0)
    length.observe(1, 0)
    assert length.wanted() == 1


def test_draft_length_pauses_after_failures_and_probes_with_a_doubling_cool_down() -> None:
    length = DraftLength()
    for _ in range(NUM_FAILURES_TO_PAUSE):
        length.observe(length.wanted(), 0)
    cooldowns = []
    for _ in range(7):
        num_off = 0
        while (k := length.wanted()) == 0:
            num_off += 1
        cooldowns.append(num_off)
        assert k == 1, "after a cool-down comes a 1-token probe"
        length.observe(1, 0)  # the probe fails: off again at once, for twice as long
    assert cooldowns == [16, 32, 64, 128, 256, 512, 512]
    assert cooldowns[0] == FIRST_COOLDOWN_STEPS and cooldowns[-1] == MAX_COOLDOWN_STEPS
    while length.wanted() == 0:
        pass
    length.observe(1, 1)  # an accepted probe: growth as normal, and the next cool-down short again
    assert [length.wanted() for _ in range(2)] == [3, 3]
    for _ in range(NUM_FAILURES_TO_PAUSE):
        length.observe(length.wanted(), 0)
    assert sum(1 for _ in itertools.takewhile(lambda k: k == 0, iter(length.wanted, None))) == 16


outcomes = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), max_size=200)


@given(outcomes, st.integers(1, 8), st.integers(0, 8))
def test_draft_length_stays_in_bounds_and_always_probes_again(
    verifies: list[tuple[int, int]], start: int, extra: int
) -> None:
    most = start + extra
    length = DraftLength(start=start, most=most)
    num_failures = 0
    for drafted, accepted in verifies:
        k = length.wanted()
        assert 0 <= k <= most
        if num_failures == NUM_FAILURES_TO_PAUSE:
            assert k == 0, "three verifies in a row accepted nothing: drafting must pause"
        if k == 0:
            num_failures = 0
            continue
        num_drafted = min(k, drafted)  # the history may hold fewer than k
        num_accepted = min(num_drafted, accepted)
        length.observe(num_drafted, num_accepted)
        num_failures = num_failures + 1 if num_accepted == 0 else 0
    assert any(length.wanted() > 0 for _ in range(MAX_COOLDOWN_STEPS + 1)), "a pause must end in a probe"


def test_draft_length_refuses_impossible_verifies() -> None:
    length = DraftLength()
    with pytest.raises(ValueError, match="drafted"):
        length.observe(0, 0)
    with pytest.raises(ValueError, match="drafted"):
        length.observe(2, 3)
    with pytest.raises(ValueError, match="most"):
        DraftLength(start=9, most=8)
