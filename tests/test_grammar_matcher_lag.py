"""A lazy grammar's matcher in free text reads each sampled token one step late, so mlx-lm's decode
step never waits for it (issue 80): driven with lazy tokens exactly as mlx-lm's `GenerationBatch`
and our speculative verify drive it, it masks every step as the same matcher consuming each token
at once does (`lookahead` None), with the default model's real tokenizer and tool-call grammars."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import TokenBuffer

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.prompting.output_grammars import strict_calls_grammar
from semantic.actors.prompting.tool_call_grammars import call_grammars
from semantic.engine.decoding.grammar_matcher import (
    MAX_LOOKAHEAD_TOKENS,
    TRIGGER_SEPARATOR,
    GrammarCompiler,
    GrammarMatcher,
    IncompleteOutputError,
)
from tests.tool_call_samples import tokenizer_for

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
PROMPT = [1, 2, 3]
# Free text made of the triggers' pieces, so that near-misses and triggers split across tokens in
# every way come up.
PIECES = ["<", ">", "<tool", "_call", "call>", "<tool_call", "<function", "=", "function=", "def", " ", "\n"]
PIECES += ["a", "Let me check.", "</tool_call>", "e"]
PENDING = (b"", b"abc <", b"<too", b"a <tool_ca", b"<tool_call", b"x<function", b"<functio", b"d", b"def")


@dataclass(frozen=True)
class Format:
    """A grammar as a guided turn gets it, and the calls (one a segment) that open and close it."""

    grammar: str
    trigger: str
    calls: tuple[str, ...]


@functools.cache
def setup() -> tuple[Any, GrammarCompiler, dict[str, Format]]:
    tokenizer = tokenizer_for("qwen3_coder")  # the default model's tokenizer, Qwen3-Coder's template
    grammars = call_grammars(ChatFormat(tokenizer).tool_format, tokenizer)
    assert grammars is not None
    xml_tools = [(tool, "exact") for tool in TOOLS]
    xml_call = (
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    )
    formats = {
        "hermes": Format(
            strict_calls_grammar(TOOLS, "arguments", "</tool_call>", "tools", "\n"),
            "<tool_call>",
            ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',),
        ),
        "qwen3_coder": Format(
            grammars.lazy(xml_tools, "tools"),
            grammars.trigger,
            (f"<tool_call>\n{xml_call}</function>\n</tool_call>", f"{xml_call}</function>"),
        ),
        # A trigger some tokens hold whole (" def"), and one that too many complete for a lookahead.
        "def": Format('start: NAME "(x, y):"\nNAME: /[a-z_0-9]+/\n', "def ", ("def f(x, y):",)),
        "e": Format('start: "x" /[a-z]+/ "."\n', "e", ("exyz.",)),
        # A call the token that completes its trigger may close (">."), or break (">>").
        "closing": Format('start: "."\n', "<tool_call>", ("<tool_call>.",)),
    }
    return tokenizer, GrammarCompiler(tokenizer, list(tokenizer.eos_token_ids)), formats


def matchers(name: str) -> tuple[GrammarMatcher, GrammarMatcher]:
    """The matcher a turn gets (lagging in free text), and the same one consuming each token at once."""
    _, compiler, formats = setup()
    f = formats[name]
    lagging, at_once = compiler.matcher(f.grammar, f.trigger), compiler.matcher(f.grammar, f.trigger)
    at_once.lags = False  # every step synchronous, from the same compiled template and its bans
    return lagging, at_once


class Stepper:
    """Calls a grammar as mlx-lm 0.32.2's `GenerationBatch._step` calls its logits processor: the
    token context a `TokenBuffer` fed the last sampled token, still lazy (queued with `async_eval`,
    evaluated only after this step's logits are processed); and as `speculative_batch.py`'s verify
    calls `num_allowed`, `mask_drafts` and `keep_drafts`."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher
        self.context = TokenBuffer(PROMPT[:-1])
        self.pending = mx.array(PROMPT[-1:], dtype=mx.int32)

    def step(self, logits: mx.array) -> np.ndarray:
        """The step's processed logits; its token is left lazy, as mlx-lm leaves it."""
        inputs = self.pending
        context = self.context.update_and_fetch(inputs)
        processed = self.matcher(context, logits)
        sampled = mx.argmax(processed, axis=-1).astype(mx.int32)
        self.pending = sampled
        mx.async_eval(sampled, context)
        mx.eval(inputs)
        return np.array(processed)

    def verify(self, logits: mx.array, guess: int, drafts: list[int]) -> tuple[Any, ...]:
        num_allowed = self.matcher.num_allowed([guess, *drafts])
        drafts = drafts[: max(num_allowed - 1, 0)]
        inputs = self.pending
        context = self.context.update_and_fetch(inputs)
        masked, num_masked = self.matcher.mask_drafts(context, logits[: 1 + len(drafts)], drafts)
        best = np.array(mx.argmax(masked, axis=-1)).tolist()
        num_kept = 0
        while num_kept < num_masked and drafts[num_kept] == best[num_kept]:
            num_kept += 1
        self.matcher.keep_drafts(num_kept)
        if num_kept:
            self.context.update_and_fetch(mx.array(drafts[:num_kept]))
        self.pending = mx.array([best[num_kept]], dtype=mx.int32)
        mx.eval(inputs)
        return np.array(masked), num_allowed, num_masked, num_kept, best[num_kept]


def encode(text: str, splits: list[int]) -> list[int]:
    """`text`'s tokens, encoded in pieces cut at `splits` (so a trigger may end up in any tokens)."""
    tokenizer = setup()[0]
    cuts = sorted({s % (len(text) + 1) for s in splits} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(cuts)]
    return [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]


def wanted_logits(rng: np.random.Generator, wanted: list[int], vocab_size: int) -> mx.array:
    """Random logits, each row's highest at its wanted token (which its mask may refuse)."""
    logits = rng.standard_normal((len(wanted), vocab_size)).astype(np.float32)
    logits[np.arange(len(wanted)), wanted] += 20.0
    return mx.array(logits)


def run_both(name: str, wanted: list[int], widths: list[int], seed: int) -> Iterator[GrammarMatcher]:
    """Steps both matchers through the same logits, one step a `widths` entry (0: a one-token step,
    k: a verify of k drafts, the wanted tokens), asserting each step masks and samples the same."""
    lagging, at_once = matchers(name)
    steppers = Stepper(lagging), Stepper(at_once)
    vocab_size = len(setup()[0].vocab)
    rng = np.random.default_rng(seed)
    at, num_steps = 0, 0
    while at < len(wanted):
        width = widths[num_steps % len(widths)]
        num_steps += 1
        ahead = [*wanted[at : at + width + 1]]
        logits = wanted_logits(rng, ahead, vocab_size)
        if width == 0 or len(ahead) == 1:
            masked, expected = (s.step(logits[:1]) for s in steppers)
            assert np.array_equal(masked, expected), f"step {num_steps}: the masks differ"
            at += 1
        else:
            got, expected = (s.verify(logits, wanted[at - 1] if at else 0, ahead[1:]) for s in steppers)
            assert np.array_equal(got[0], expected[0]), f"verify {num_steps}: the masks differ"
            assert got[1:] == expected[1:], f"verify {num_steps}: {got[1:]} != {expected[1:]}"
            at += 1 + got[3]
        yield lagging
    assert reason(failure_of(lagging)) == reason(failure_of(at_once))


def failure_of(matcher: GrammarMatcher) -> str | None:
    try:
        matcher.check_complete()
    except IncompleteOutputError as error:
        return str(error)
    return None


def reason(failure: str | None) -> str | None:
    """A failure's first line (llguidance's error goes on with its parser's timings)."""
    return None if failure is None else failure.splitlines()[0]


segments = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=6).map("".join),
    st.integers(0, 3).map(lambda i: ("call", i)),
    st.tuples(
        st.sampled_from(["<tool_call>", "<function=", "def ", "e"]), st.sampled_from(["x", "!", ">", ""])
    ).map("".join),  # a trigger and what may break its call
)


replies = {
    "name": st.sampled_from(["hermes", "qwen3_coder", "def", "e", "closing"]),
    "parts": st.lists(st.tuples(segments, st.lists(st.integers(0, 200), max_size=4)), min_size=1, max_size=6),
    "widths": st.lists(st.sampled_from([0, 0, 0, 1, 2, 4]), min_size=1, max_size=5),
    "seed": st.integers(0, 2**16),
}


def masks_every_step_as_one_consuming_at_once(
    name: str, parts: list[tuple[Any, list[int]]], widths: list[int], seed: int
) -> None:
    calls = setup()[2][name].calls
    wanted: list[int] = []
    for segment, splits in parts:
        if isinstance(segment, tuple):  # a whole call, its opening split anywhere, its body as one
            call = calls[segment[1] % len(calls)]
            wanted += encode(call[:12], splits) + encode(call[12:], [])
        else:
            wanted += encode(segment, splits)
    for _ in run_both(name, wanted, widths, seed):
        pass


# The default suite draws 25 replies; the slow tests (which CI also runs) draw 200.
test_lagging_matcher_masks_every_step_as_one_consuming_at_once = settings(max_examples=25, deadline=None)(
    given(**replies)(masks_every_step_as_one_consuming_at_once)
)
test_lagging_matcher_masks_many_more_replies_as_one_consuming_at_once = pytest.mark.slow(
    settings(max_examples=200, deadline=None)(given(**replies)(masks_every_step_as_one_consuming_at_once))
)


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "def"])
def test_calls_open_and_close_between_lagged_steps(name: str) -> None:
    calls = setup()[2][name].calls
    text = "Let me check. " + " Then ".join(calls) + " Done."
    for widths in ([0], [0, 2, 0, 0, 1]):
        states = [m._matcher is not None for m in run_both(name, encode(text, [3, 15, 40]), widths, 7)]
        assert any(states) and not states[-1], "no call opened and closed: the test checks less than it says"


@pytest.mark.parametrize(("closer", "refused"), [(">.", False), (">>", True)])
def test_a_token_that_would_open_a_call_the_grammar_refuses_is_banned(closer: str, refused: bool) -> None:
    """`>.` completes the trigger and closes the call; `>>` would open a call that cannot go on, so
    free text after `<tool_call` bans it (as mlx-lm's own masks ban what a call cannot hold) and the
    reply never breaks. The token is the last the lagging matcher consumes: `check_complete`
    catches up on it."""
    (token,) = encode(closer, [])
    wanted = [*encode("Hi <tool_call", []), token, *encode(" and", [])]
    for widths in ([0], [0, 1]):
        lagging = list(run_both("closing", wanted, widths, 3))[-1]
        assert failure_of(lagging) is None
    lookahead = lagging._lookahead
    assert lookahead is not None
    banned = lookahead.free_mask(b"Hi <tool_call", len(setup()[0].vocab))
    assert (banned is not None and not banned[token]) == refused


def test_free_text_reads_each_token_one_step_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """No host read of the token just sampled: the matcher consumes each token at the call after the
    one whose `tokens` ended with it, when mlx-lm has evaluated it."""
    consumed: list[int] = []
    consume = GrammarMatcher._consume

    def counted(matcher: GrammarMatcher, token: int) -> bool:
        consumed.append(token)
        return consume(matcher, token)

    monkeypatch.setattr(GrammarMatcher, "_consume", counted)
    lagging, _ = matchers("hermes")
    stepper, vocab_size = Stepper(lagging), len(setup()[0].vocab)
    wanted = encode("Some free text, written with no call in it at all.", [])
    rng, sampled = np.random.default_rng(0), []
    for number, token in enumerate(wanted, start=1):
        stepper.step(wanted_logits(rng, [token], vocab_size))
        assert consumed == sampled[:-1], f"call {number} consumed {consumed}, sampled before it {sampled}"
        sampled.append(token)


def test_trigger_index_finds_exactly_the_tokens_that_complete_a_trigger() -> None:
    tokenizer, compiler, formats = setup()
    texts = [compiler._llguidance_tokenizer().decode_bytes([t]) for t in range(len(tokenizer.vocab))]
    for name in ("hermes", "qwen3_coder", "def"):
        trigger = formats[name].trigger
        index = compiler._trigger_index(trigger)
        triggers = [t.encode() for t in trigger.split(TRIGGER_SEPARATOR)]
        for pending in PENDING:
            expected = [t for t, text in enumerate(texts) if any(tr in pending + text for tr in triggers)]
            assert index.completing(index.open_prefix(pending)) == expected, (name, pending)
    assert len(compiler._trigger_index("e").completing(b"")) > MAX_LOOKAHEAD_TOKENS  # stepped at once


def test_refused_openers_are_those_whose_call_cannot_go_on_when_opened_and_fed() -> None:
    """`refused` judges a call its opener begins with one token by the grammar's first mask; each
    format's refused openers are those that, opened and fed as a turn would feed them, leave the
    call broken (an error, or stopped unfinished): every opener of the formats whose triggers few
    tokens complete, and a sample of the thousands that complete "def " and "e"."""
    rng = np.random.default_rng(0)
    for name in ("hermes", "qwen3_coder", "def", "e", "closing"):
        lookahead = matchers(name)[0]._lookahead
        assert lookahead is not None
        for prefix in [b"", *lookahead.index.trigger_prefixes]:
            openers = lookahead.index.completing(prefix)
            if len(openers) > 400:
                openers = sorted(rng.choice(openers, 400, replace=False).tolist())
            broken = []
            for token in openers:
                matcher = lookahead._opened(prefix, token)
                if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
                    broken.append(token)
            refused = set(lookahead.refused(prefix))
            assert [token for token in openers if token in refused] == broken, (name, prefix)
    assert len(matchers("e")[0]._lookahead.refused(b"")) > 1000  # the sample held some
