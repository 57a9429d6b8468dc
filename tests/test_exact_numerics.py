"""256-token greedy replies of the default model on five prompts, three ways: mlx-lm's own loop
(`generate_step`, which `generate` and `stream_generate` run), our engine with `exact_numerics`, and
our engine with the device's default profile (on the CPU: our kernels, the fold, the mixed step, the
joining cache, n-gram drafts). The five run concurrently, as users send them, and one prompt also runs alone.

What holds, measured on this CPU (docs/benchmarks.md, "Exact numerics"): every reply is mlx-lm's token
for token in both profiles; a lone stream with exact numerics is mlx-lm's to the last bit of every logprob;
otherwise logprobs move by up to ~2e-5 (OpenBLAS rounds a row differently with the number of rows
multiplied with it, and our kernels reorder sums), ~200 times less than the smallest top-2 gap met
on these replies (3.8e-3), so greedy choices cannot flip here. A near-tie below that bound could
flip a token in a batch whatever the profile: the gap is checked so such a case reads as a tie.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from semantic.actors.engine_client import Engine, EngineConfig
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import GenerationRequest, TokenDelta
from semantic.engine.mlx_adapter.api import load

# Three 256-token runs of five prompts (mlx-lm's loop one prompt at a time, the engine twice): a
# soak, run with the slow tests (`just test-slow`, which CI runs too).
pytestmark = pytest.mark.slow

NUM_TOKENS = 256
# Logprobs of the same token moved by at most 1.7e-5 here (batching or kernels); a bug moves more.
LOGPROB_TOLERANCE = 1e-4

TRAVEL_RULES = (
    "You are Atlas, a careful travel assistant for a small agency. Answer in plain English. Always "
    "give prices in euros, name the neighbourhood of every place you suggest, and prefer public "
    "transport over taxis. If the traveller has children, suggest places with step-free access and "
    "somewhere to rest every two hours. Never invent opening hours: say they should be checked. Keep "
    "each day to at most four activities, and end with a short packing list suited to the season."
)
CONVERSATIONS = {
    "code": [
        {
            "role": "user",
            "content": "Write a Python function that reads a CSV file and returns the average of each "
            "numeric column. Include a docstring and error handling.",
        }
    ],
    "prose": [
        {
            "role": "user",
            "content": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        }
    ],
    "list": [{"role": "user", "content": "List twenty ideas for a weekend with children, one per line."}],
    "number": [
        {
            "role": "user",
            "content": "A train leaves at 3:15 pm and travels 247 km at 82 km/h. When does it arrive? "
            "Explain step by step.",
        }
    ],
    "system": [
        {"role": "system", "content": TRAVEL_RULES},
        {"role": "user", "content": "Plan three days in Lisbon for a family of four in April."},
    ],
}
ALONE = "number"  # the shortest reply (~107 tokens): the one also run as a batch of one


@dataclass(frozen=True, slots=True)
class Reply:
    token_ids: list[int]  # without the end token
    logprobs: list[float]  # each token's


@dataclass(frozen=True, slots=True)
class Oracle:
    prompts: dict[str, list[int]]
    replies: dict[str, Reply]
    top2_gaps: dict[str, list[float]]  # at each token, its logprob less the runner-up's


@dataclass(frozen=True, slots=True)
class EngineRun:
    concurrent: dict[str, Reply]
    alone: Reply
    profile_variants: tuple[bool, bool, bool, bool]  # cpu kernels, fold, mixed step, joining cache


@pytest.fixture(scope="module")
def oracle(default_model_dir: Path) -> Oracle:
    """mlx-lm's own single-sequence loop on this thread, where no hook uses our kernels."""
    model, tokenizer = load(str(default_model_dir))  # type: ignore[misc]
    eos = set(tokenizer.eos_token_ids)
    prompts, replies, gaps = {}, {}, {}
    for name, conversation in CONVERSATIONS.items():
        prompt = list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True))
        token_ids: list[int] = []
        logprobs: list[float] = []
        top2_gaps: list[float] = []
        for token, token_logprobs in generate_step(mx.array(prompt), model, max_tokens=NUM_TOKENS):
            token_id = int(token)  # an int already: mlx-lm yields `y.item()`
            top2 = mx.topk(token_logprobs, 2)
            top2_gaps.append(abs(cast(float, (top2[0] - top2[1]).item())))
            if token_id in eos:
                break
            token_ids.append(token_id)
            logprobs.append(cast(float, token_logprobs[token_id].item()))
        prompts[name], replies[name], gaps[name] = prompt, Reply(token_ids, logprobs), top2_gaps
    return Oracle(prompts, replies, gaps)


async def _reply(engine: Engine, prompt: list[int]) -> Reply:
    sampling = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, top_logprobs=0)
    # A salt of its own: the prompt is computed from scratch as mlx-lm's is, never from a cache.
    request = GenerationRequest(uuid.uuid4().hex, prompt, sampling, cache_salt=uuid.uuid4().hex)
    stream = engine.submit(request)
    token_ids, logprobs = [], []
    async for event in stream:
        if isinstance(event, TokenDelta):
            token_ids += event.token_ids
            logprobs += [each.logprob for each in event.logprobs]
    eos = engine.model.eos_token_ids  # delivered, without a logprob
    return Reply([t for t in token_ids if t not in eos], logprobs)


async def _run_engine(config: EngineConfig, prompts: dict[str, list[int]]) -> EngineRun:
    engine = Engine(config)
    await engine.start()
    try:
        # All five queued before the first is read: they share the batch as concurrent users' do.
        replies = await asyncio.gather(*(_reply(engine, prompt) for prompt in prompts.values()))
        alone = await _reply(engine, prompts[ALONE])
    finally:
        await engine.stop()
    profile = engine.config.profile
    variants = (profile.cpu_kernels, profile.last_token_fold, profile.mixed_step, profile.joining_cache)
    return EngineRun(dict(zip(prompts, replies, strict=True)), alone, variants)


@pytest.fixture(scope="module")
def exact(default_model_dir: Path, oracle: Oracle) -> EngineRun:
    config = EngineConfig(model=str(default_model_dir), cache_budget_mb=256, exact_numerics=True)
    return asyncio.run(_run_engine(config, oracle.prompts))


@pytest.fixture(scope="module")
def default(default_model_dir: Path, oracle: Oracle) -> EngineRun:
    config = EngineConfig(model=str(default_model_dir), cache_budget_mb=256)
    return asyncio.run(_run_engine(config, oracle.prompts))


def _assert_same_tokens(name: str, ours: Reply, oracle: Oracle) -> None:
    expected = oracle.replies[name].token_ids
    if ours.token_ids == expected:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours.token_ids, expected, strict=False)) if a != b), None)
    if at is None:
        at = min(len(ours.token_ids), len(expected))
    gap = oracle.top2_gaps[name][at] if at < len(oracle.top2_gaps[name]) else float("nan")
    pytest.fail(
        f"{name}: token {at} differs from mlx-lm's ({ours.token_ids[at : at + 1]} against "
        f"{expected[at : at + 1]}); mlx-lm's top-2 gap there: {gap:.2e}"
        + (" (a near-tie)" if gap < LOGPROB_TOLERANCE else "")
    )


def _max_logprob_change(ours: Reply, expected: Reply) -> float:
    assert len(ours.logprobs) == len(expected.logprobs), "a logprob for every token"
    return max(abs(a - b) for a, b in zip(ours.logprobs, expected.logprobs, strict=True))


def test_replies_are_long_and_never_near_a_tie(oracle: Oracle) -> None:
    """The comparison means something: long replies, none near a tie our tolerance could flip."""
    assert sum(len(reply.token_ids) for reply in oracle.replies.values()) >= 4 * NUM_TOKENS
    assert min(min(gaps) for gaps in oracle.top2_gaps.values()) > 10 * LOGPROB_TOLERANCE


def test_exact_numerics_runs_mlx_lm_s_own_step(exact: EngineRun) -> None:
    assert exact.profile_variants == (False, False, False, False)


def test_exact_numerics_equals_mlx_lm_token_for_token(exact: EngineRun, oracle: Oracle) -> None:
    for name, reply in exact.concurrent.items():
        _assert_same_tokens(name, reply, oracle)
        assert _max_logprob_change(reply, oracle.replies[name]) < LOGPROB_TOLERANCE, name


def test_exact_numerics_alone_is_mlx_lm_to_the_last_bit(exact: EngineRun, oracle: Oracle) -> None:
    """A batch of one runs mlx-lm's batched step on the same shapes as its single-sequence loop."""
    assert exact.alone == oracle.replies[ALONE]


def test_the_default_profile_equals_mlx_lm_token_for_token(default: EngineRun, oracle: Oracle) -> None:
    """On the CPU every variant is on, and our kernels and the fold change rounding even for a
    lone stream (what the README says): each logprob stays within the tolerance, and no token
    changes, there being no near-tie here."""
    for name, reply in default.concurrent.items():
        _assert_same_tokens(name, reply, oracle)
        assert _max_logprob_change(reply, oracle.replies[name]) < LOGPROB_TOLERANCE, name
    _assert_same_tokens(ALONE, default.alone, oracle)
    assert _max_logprob_change(default.alone, oracle.replies[ALONE]) < LOGPROB_TOLERANCE
    if mx.default_device() == mx.cpu:
        assert default.profile_variants == (True, True, True, True)
        assert default.alone.logprobs != oracle.replies[ALONE].logprobs
