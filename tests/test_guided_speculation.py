"""Speculative decoding on rows with a grammar (a lazy one, as a guided tool call's): drafts are cut
where the grammar refuses them and each verified position is masked as the grammar masks it there,
so a greedy reply is token for token the reply without drafts, and the row still drafts."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from semantic.engine.decoding.grammar_matcher import GrammarCompiler
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.messages import EventChannel, Finished, GenerationRequest
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from tests.test_speculation import CODE, FlatCosts

PROMPT = f"Repeat this code exactly:\n{CODE}"
# After each "def ": a name, then the parameters the model copies, or others it must write instead
# (its drafts, copied from the prompt, refused there).
FOLLOWED = 'start: NAME "(x, y):"\nNAME: /[a-z_0-9]+/\n'
FORCED = 'start: NAME "(a, b):"\nNAME: /[a-z_0-9]+/\n'
GRAMMARS = [FOLLOWED, FORCED, None]
# Room for two calls in each guided reply, closed then opened again with drafts running across
# both, and for the reply to end in free text between the second call and a third (a reply cut
# inside a call would not be complete).
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def compiler(default_model_dir: Path) -> GrammarCompiler:
    """One compiler for the module: its grammars' trigger lookaheads (filled as the matchers first
    mask, and costly for a trigger that ends in a space) are computed once."""
    tokenizer = load_tokenizer(default_model_dir)
    return GrammarCompiler(tokenizer, sorted(tokenizer.eos_token_ids))


def _replies(model_dir: Path, speculate: str, compiler: GrammarCompiler) -> tuple[list[Finished], list[str]]:
    loop = asyncio.new_event_loop()
    try:
        outbox = Outbox(loop)
        config = EngineConfig(model=str(model_dir), cache_budget_mb=256, speculate=speculate)
        served = ServedModel.load(
            config.model, None, config, mx.default_stream(mx.cpu), EngineStats(), outbox
        )
        if served.batch.speculation is not None:  # every draft offered is verified
            served.batch.speculation.costs = FlatCosts()
            served.batch.speculation.margin = 0.0
        tokenizer = served.loaded.tokenizer
        assert set(served.loaded.eos_token_ids) == set(tokenizer.eos_token_ids)
        prompt = list(
            tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        )
        submits: list[Submit] = []
        for grammar in GRAMMARS:
            matcher = None if grammar is None else compiler.matcher(grammar, trigger="def ")
            sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            request = GenerationRequest(
                uuid.uuid4().hex, prompt, sampling, f"agent-{len(submits)}", grammar=matcher
            )
            submit = Submit(request, EventChannel(loop))
            served.batch.insert(
                submit, served.pool.allocate(served.loaded.spec.num_blocks_for(len(prompt) + MAX_TOKENS))
            )
            submits.append(submit)
        finished: dict[int, Finished] = {}
        for _ in range(20 * MAX_TOKENS):
            if len(finished) == len(submits):
                break
            served.batch.step()
            served.batch.flush()
            served.batch.keep_caches()
            outbox.flush()
            loop.run_until_complete(asyncio.sleep(0))
            for index, submit in enumerate(submits):
                while not submit.events.queue.empty():
                    event = submit.events.queue.get_nowait()
                    assert not isinstance(event, BaseException), event
                    if isinstance(event, Finished):
                        finished[index] = event
        assert len(finished) == len(submits), "the requests did not finish"
        for submit in submits:
            if submit.request.grammar is not None:
                submit.request.grammar.check_complete()
        replies = [finished[index] for index in range(len(submits))]
        return replies, [tokenizer.decode(f.generated_token_ids) for f in replies]
    finally:
        loop.close()


def test_guided_greedy_replies_draft_and_equal_without_drafts(
    default_model_dir: Path, compiler: GrammarCompiler
) -> None:
    if mx.default_device() != mx.cpu:
        pytest.skip("compares against the CPU's own replies")
    plain, _ = _replies(default_model_dir, "off", compiler)
    drafted, texts = _replies(default_model_dir, "ngram", compiler)
    assert [f.generated_token_ids for f in drafted] == [f.generated_token_ids for f in plain]
    followed, forced, _ = drafted
    assert texts[0].count("(x, y):") >= 2 and texts[1].count("(a, b):") >= 2, texts  # two calls each
    for guided in (followed, forced):
        assert guided.num_drafted_tokens > 0, "a guided row drafted nothing"
        assert 0 < guided.num_accepted_tokens <= guided.num_drafted_tokens


def test_a_grammar_masks_drafts_and_takes_back_the_rejected_as_if_never_drafted(
    default_model_dir: Path, compiler: GrammarCompiler
) -> None:
    """A verify's masks at every drafted position are those of one call per token, and after taking
    back the rejected drafts (across a call's opening and its close) the matcher goes on as one that
    never saw them; a draft the grammar refuses ends what it masks."""
    tokenizer = load_tokenizer(default_model_dir)
    ids = tokenizer.encode(
        "Sure: def function_1(x, y):\n    return x\ndef add(x, y):\nok", add_special_tokens=False
    )
    vocab_size = len(tokenizer.vocab)
    prompt = [1, 2, 3]

    def allowed(masked: mx.array) -> list[bool]:
        return np.isfinite(np.array(masked)).tolist()

    plain = compiler.matcher(FOLLOWED, trigger="def ")
    zeros = mx.zeros((1, vocab_size))
    masks = [allowed(plain(mx.array(prompt), zeros)[0])]  # masks[i]: the mask ids[i] was sampled from
    masks += [allowed(plain(mx.array([*prompt, *ids[: i + 1]]), zeros)[0]) for i in range(len(ids))]
    assert not all(all(mask) for mask in masks), "the grammar never held: the test checks nothing"

    rng = random.Random(0)
    drafted = compiler.matcher(FOLLOWED, trigger="def ")
    assert allowed(drafted(mx.array(prompt), zeros)[0]) == masks[0]
    pending, num_refused = 0, 0  # ids[pending]: the token the verify feeds first
    while pending < len(ids):
        right = ids[pending + 1 : pending + 1 + rng.randint(0, 5)]
        # After the right drafts, maybe one the grammar refuses there, or any other token.
        refused = [token for token, ok in enumerate(masks[pending + 1 + len(right)]) if not ok]
        wrong = [rng.choice(refused or range(vocab_size))] if rng.random() < 0.5 else []
        if wrong and pending + 1 + len(right) < len(ids) and wrong[0] == ids[pending + 1 + len(right)]:
            wrong = []
        drafts = right + wrong
        context = mx.array([*prompt, *ids[: pending + 1]])
        masked, num_allowed = drafted.mask_drafts(context, mx.zeros((1 + len(drafts), vocab_size)), drafts)
        assert len(right) <= num_allowed <= len(drafts)
        num_refused += num_allowed < len(drafts)
        for position in range(len(right) + 1):
            assert allowed(masked[position]) == masks[pending + 1 + position], (pending, position)
        num_kept = rng.randint(0, len(right))  # the model's choices reject the rest
        drafted.keep_drafts(num_kept)
        pending += 1 + num_kept
    assert num_refused > 0, "no draft was refused: the test checks less than it says"
    assert drafted.failure is None
