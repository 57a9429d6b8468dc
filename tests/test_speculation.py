"""Speculative decoding in the running batch: greedy replies equal those without drafts, token for
token, with several sequences in the batch (rows that keep different numbers of drafts realigned),
drafted from each reply's history or by a draft model, and the drafts verified and kept are
counted per request."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import mlx.core as mx
import pytest

from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.messages import EventChannel, Finished, GenerationRequest
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.scheduling.step_costs import StepCosts

CODE = "\n".join(f"def function_{i}(x, y):\n    total = x + y + {i}\n    return total\n" for i in range(6))
REQUESTS = [
    f"Here is a Python file:\n```python\n{CODE}```\nReturn the whole file, renaming function_3 to add_three.",
    "Write a short poem about the sea.",
    f"Repeat this code exactly:\n{CODE}",
]


class FlatCosts(StepCosts):
    """A machine where a step of any width costs what a one-token step does (about a GPU's case):
    with no margin, every draft offered is verified whatever this machine's step times, so that a
    test of what verifying does is not at the mercy of how busy the machine is (`test_verify_width.py`
    tests the weighing). Still records what the decode batch measures."""

    def __init__(self) -> None:
        super().__init__()
        self.num_observed = 0

    def observe(self, num_rows: int, width: int, seconds: float) -> None:
        super().observe(num_rows, width, seconds)
        self.num_observed += 1

    def seconds(self, num_rows: int, width: int) -> float | None:
        return 0.05


# Long enough for drafts from the replies' history to be offered and kept (the tests assert both).
MAX_TOKENS = 32


def _replies(model_dir: Path, speculate: str, max_tokens: int = MAX_TOKENS) -> list[Finished]:
    return _turns(model_dir, speculate, max_tokens)[0]


def _turns(model_dir: Path, speculate: str, max_tokens: int) -> tuple[list[Finished], list[list[int]]]:
    """Each request's end, and the tokens of the cache its agent keeps."""
    loop = asyncio.new_event_loop()
    try:
        outbox = Outbox(loop)
        config = EngineConfig(model=str(model_dir), cache_budget_mb=256, speculate=speculate)  # type: ignore[arg-type]
        served = ServedModel.load(
            config.model, None, config, mx.default_stream(mx.cpu), EngineStats(), outbox
        )
        costs = FlatCosts()
        if served.batch.speculation is not None:  # every draft offered is verified
            served.batch.speculation.costs = costs
            served.batch.speculation.margin = 0.0
        submits = []
        for text in REQUESTS:
            messages = [{"role": "user", "content": text}]
            prompt = list(served.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
            request = GenerationRequest(uuid.uuid4().hex, prompt, sampling, f"agent-{len(submits)}")
            submit = Submit(request, EventChannel(loop))
            served.batch.insert(
                submit, served.pool.allocate(served.loaded.spec.num_blocks_for(len(prompt) + max_tokens))
            )
            submits.append(submit)
        finished: dict[int, Finished] = {}
        for _ in range(20 * max_tokens):
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
        if served.batch.speculation is not None:
            assert costs.num_observed > 0, "the decode batch timed no step"
        kept = [served.store.agents[f"agent-{index}"].token_ids for index in range(len(submits))]
        return [finished[index] for index in range(len(submits))], kept
    finally:
        loop.close()


def _plain_replies(model_dir: Path) -> list[Finished]:
    if mx.default_device() != mx.cpu:
        pytest.skip("compares against the CPU's own replies")
    replies = _replies(model_dir, "off")
    assert all(f.num_drafted_tokens == 0 for f in replies)
    return replies


@pytest.fixture(scope="module")
def plain_replies(default_model_dir: Path) -> list[Finished]:
    return _plain_replies(default_model_dir)


@pytest.fixture(scope="module")
def tiny_plain_replies(tiny_llama_dir: Path) -> list[Finished]:
    return _plain_replies(tiny_llama_dir)


def test_greedy_replies_equal_without_drafts(default_model_dir: Path, plain_replies: list[Finished]) -> None:
    drafted = _replies(default_model_dir, "ngram")
    assert [f.generated_token_ids for f in drafted] == [f.generated_token_ids for f in plain_replies]
    assert sum(f.num_drafted_tokens for f in drafted) > 0, "nothing was drafted: the test checks nothing"
    assert sum(f.num_accepted_tokens for f in drafted) > 0
    for f in drafted:
        assert 0 <= f.num_accepted_tokens <= f.num_drafted_tokens


def test_drafts_that_reach_the_token_limit_leave_the_agent_s_cache_as_without_drafts(
    default_model_dir: Path,
) -> None:
    """Replies cut at a few tokens, where drafts run to the limit: each agent keeps the cache of
    exactly the tokens it keeps without drafts (a row the generator ended itself lost its cache)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("compares against the CPU's own replies")
    plain, plain_kept = _turns(default_model_dir, "off", max_tokens=6)
    drafted, drafted_kept = _turns(default_model_dir, "ngram", max_tokens=6)
    assert [f.generated_token_ids for f in drafted] == [f.generated_token_ids for f in plain]
    assert drafted_kept == plain_kept
    assert all(len(tokens) > 6 for tokens in plain_kept)  # each prompt and its reply, or most of it
    assert sum(f.num_drafted_tokens for f in drafted) > 0, "nothing was drafted: the test checks nothing"


def test_greedy_replies_with_a_draft_model_equal_without_drafts(
    tiny_llama_dir: Path, tiny_plain_replies: list[Finished]
) -> None:
    """A model drafting for itself: every reply as without drafts, and (its greedy drafts being the
    main model's own choices, up to batching's rounding) nearly every draft kept. The tiny random
    Llama: what is checked is the drafting and verifying, not the words, and its steps are cheap
    for main model and draft model alike."""
    drafted = _replies(tiny_llama_dir, str(tiny_llama_dir))
    assert [f.generated_token_ids for f in drafted] == [f.generated_token_ids for f in tiny_plain_replies]
    num_drafted = sum(f.num_drafted_tokens for f in drafted)
    num_accepted = sum(f.num_accepted_tokens for f in drafted)
    assert num_drafted > MAX_TOKENS, "too little was drafted: the test checks nothing"
    assert num_accepted >= 0.8 * num_drafted, (num_accepted, num_drafted)


def test_sampled_drafts_keep_the_distribution() -> None:
    """The rejection rule with a certain draft: the first token is distributed as a draw from p would
    be, whichever token was drafted (a fixed seed: the same draws every run)."""
    from semantic.engine.mlx_adapter.speculative_batch import keep_sampled

    mx.random.seed(7)
    probabilities = [0.5, 0.3, 0.15, 0.05]
    scaled = mx.log(mx.array([probabilities, probabilities]))  # two positions: one draft, then the next
    num_trials = 4000
    for draft in (0, 2, 3):
        counts = [0] * len(probabilities)
        for _ in range(num_trials):
            num_kept, after = keep_sampled([draft], scaled)
            counts[draft if num_kept == 1 else after] += 1
        for count, expected in zip(counts, probabilities, strict=True):
            assert abs(count / num_trials - expected) < 0.03, (draft, counts)
        assert counts[draft] > 0
