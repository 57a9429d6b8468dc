"""How wide a step verifies drafts: each width's expected tokens over its measured cost, so drafts that
are usually kept are verified where a wide step costs what a one-token step does (a GPU) or more (a
2-core CPU), and drafts that are seldom kept wait, with the step costs and the draft length's estimate
of kept drafts checked on their own."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.scheduling.step_costs import StepCosts
from semantic.engine.speculation.drafting import MARGIN, Speculation
from semantic.engine.speculation.ngram_drafts import PRIOR_ACCEPTANCE, DraftLength


def measured(num_rows: int, seconds_by_width: dict[int, float]) -> Speculation:
    speculation = Speculation()
    for width, seconds in seconds_by_width.items():
        speculation.costs.observe(num_rows, width, seconds)
    return speculation


def length_kept(acceptance_evidence: list[tuple[int, int]]) -> DraftLength:
    """A draft length that has seen these verifies (drafted, kept)."""
    length = DraftLength(start=4, most=8)
    for drafted, kept in acceptance_evidence:
        length.observe(drafted, kept)
    return length


COPYING = [(8, 8)] * 6  # a file being copied: every draft kept
CHATTING = [(4, 0), (2, 1), (4, 0)]  # free-form text: a draft kept now and then


def test_nothing_is_verified_until_a_one_token_step_of_these_rows_was_measured() -> None:
    speculation = measured(2, {1: 0.05})
    assert speculation.width_worth(3, [(length_kept(COPYING), 8)]) == 1
    assert speculation.width_worth(2, [(length_kept(COPYING), 8)]) == 9


def test_where_wide_steps_cost_what_one_token_steps_do_every_draft_is_verified() -> None:
    gpu = measured(3, {1: 0.010, 5: 0.010, 9: 0.0105})
    assert gpu.width_worth(3, [(DraftLength(), 4), (length_kept(COPYING), 8)]) == 9
    assert gpu.width_worth(3, [(length_kept(CHATTING), 4), (length_kept(CHATTING), 4)]) == 1
    new_rows = [(DraftLength(), 4)] * 3
    assert gpu.width_worth(3, new_rows) == 5, "new sequences' drafts are tried where all three offer them"
    guessing = DraftLength()
    for _ in range(3):
        guessing.observe_guess(True)  # its guesses at the tokens being computed were right
    assert gpu.width_worth(3, [(guessing, 4)]) == 5
    assert gpu.width_worth(3, [(DraftLength(), 4)]) == 1, "one new row's drafts wait for its guesses"


def test_on_a_cpu_copies_are_verified_and_free_form_text_waits() -> None:
    cpu = measured(3, {1: 0.074, 2: 0.118, 3: 0.105, 5: 0.114, 9: 0.183})  # 2 cores, SmolLM2-135M
    copies = [(length_kept(COPYING), 8)] * 2
    # Width 9 (3 + 15.5 tokens in 183 ms) gives more tokens per second than 5 (3 + 7.9 in 114 ms).
    assert cpu.width_worth(3, copies) == 9
    # One copy beside two rows that draft nothing would slow them 1.5x for its own 4.9x: under the margin.
    assert cpu.width_worth(3, copies[:1]) == 1
    assert cpu.width_worth(3, [(length_kept(CHATTING), 4)] * 3) == 1
    assert cpu.width_worth(3, [(length_kept(CHATTING), 1)]) == 1, "a probe waits for a step that verifies"
    # ...and rides one: within the width the copies pay for, its draft costs nothing more.
    assert cpu.width_worth(3, [*copies, (length_kept(CHATTING), 1)]) == 9


def test_a_width_not_yet_measured_costs_the_measured_slope() -> None:
    costs = StepCosts()
    assert costs.seconds(3, 1) is None
    costs.observe(3, 1, 0.1)
    assert costs.seconds(3, 5) == pytest.approx(0.1), "no verify measured: tried at a one-token step's cost"
    costs.observe(3, 3, 0.2)
    assert costs.seconds(3, 3) == pytest.approx(0.2)
    assert costs.seconds(3, 5) == pytest.approx(0.3)
    assert costs.seconds(2, 1) is None, "sizes are kept by rows: a 1 x 3 step is not a 3 x 1 one"


def test_a_step_cost_is_the_median_of_the_last_few() -> None:
    costs = StepCosts(num_recent=5)
    for seconds in (0.1, 0.1, 2.0, 0.1, 0.1):  # a prompt's chunk in one interval
        costs.observe(1, 1, seconds)
    assert costs.seconds(1, 1) == pytest.approx(0.1)
    for _ in range(5):
        costs.observe(1, 1, 0.3)  # the machine slowed down: the old figures go
    assert costs.seconds(1, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="rows"):
        costs.observe(0, 1, 0.1)


def test_the_estimate_of_kept_drafts_follows_the_verifies_and_is_forgotten_at_a_pause() -> None:
    length = DraftLength()
    assert length.expected_kept(1) == pytest.approx(PRIOR_ACCEPTANCE)
    assert length.expected_kept(0) == 0
    copying = length_kept(COPYING)
    assert copying.expected_kept(8) > 6.5
    chatting = length_kept(CHATTING)
    assert chatting.expected_kept(1) < 0.4 and chatting.expected_kept(4) < 0.6
    while chatting.wanted() > 0:  # three failures in a row paused it
        chatting.observe(chatting.wanted(), 0)
    assert chatting.expected_kept(1) == pytest.approx(PRIOR_ACCEPTANCE), "a probe is judged as a new one"


seconds = st.floats(0.001, 1.0)
wider = st.dictionaries(st.integers(2, 9), seconds)
costs_by_width = st.tuples(seconds, wider).map(lambda c: {1: c[0]} | c[1])
offers = st.lists(
    st.tuples(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), max_size=6), st.integers(0, 8)),
    max_size=4,
)


TIE = 1e-12


@example(num_rows=1, seconds_by_width={1: 0.916584460119346}, row_offers=[([], 1)])  # a tie, found
@given(st.integers(1, 4), costs_by_width, offers)
def test_the_width_chosen_gives_the_most_tokens_per_second(
    num_rows: int, seconds_by_width: dict[int, float], row_offers: list[tuple[list[tuple[int, int]], int]]
) -> None:
    speculation = measured(num_rows, seconds_by_width)
    lengths = [(length_kept([(d, min(d, k)) for d, k in evidence]), n) for evidence, n in row_offers]
    width = speculation.width_worth(num_rows, lengths)
    longest = max((n for _, n in lengths), default=0)
    assert 1 <= width <= longest + 1

    def rate(w: int) -> float:
        seconds = speculation.costs.seconds(num_rows, w)
        assert seconds is not None
        expected = num_rows + sum(length.expected_kept(min(n, w - 1)) for length, n in lengths)
        return expected / seconds

    # Rates within rounding of each other are a tie, which either width may win (the two sides
    # multiply and divide in other orders).
    plain_bar = (1 + MARGIN) * rate(1) * (1 + TIE)
    if width == 1:
        assert all(rate(w) <= plain_bar for w in range(2, longest + 2))
    else:
        assert rate(width) * (1 + 2 * TIE) > plain_bar
        assert all(rate(w) <= rate(width) * (1 + TIE) for w in range(2, longest + 2))


def test_a_guess_is_judged_once_by_the_token_fed_unless_a_verify_judged_it() -> None:
    speculation = Speculation()
    speculation.add(7, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0), has_processors=False)
    drafting = speculation.get(7)
    assert drafting is not None
    before = drafting.length.expected_kept(1)
    drafting.guess = 3
    speculation.fed(7, [3])
    assert drafting.length.expected_kept(1) > before and drafting.guess is None
    right = drafting.length.expected_kept(1)
    speculation.fed(7, [4])  # no guess pending: nothing judged
    assert drafting.length.expected_kept(1) == right
    drafting.guess = 9
    speculation.fed(7, [4, 5])
    assert drafting.length.expected_kept(1) < right
    wrong = drafting.length.expected_kept(1)
    drafting.guess = 6
    speculation.observe(7, 2, 2)  # the verify judged the guess and its drafts
    kept = drafting.length.expected_kept(1)
    speculation.fed(7, [6, 1, 2])
    assert drafting.length.expected_kept(1) == kept > wrong
