"""Restore by cost: a returning agent's cache is read from disk or computed again, whichever the
learnt rates say is faster, and either way the turn's reply is the same."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from loguru import logger

from semantic.actors.engine_client import EngineConfig
from semantic.actors.restore_cost import ALWAYS_READ_S, RateMean, RestoreCosts, Totals, decide_restore
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import Finished, PromptStarted, TokenDelta
from semantic.storage.agent_id import AgentId

# ---- the decision and the means, without a model ----

TABLE = [
    # bytes, tokens, read B/s, prefill tok/s -> reads, the log line's start
    (
        8_000_000,
        1_000,
        1e8,
        1e4,
        True,
        "cache: read from disk (est. 0.080 s) rather than computed (est. 0.100 s)",
    ),
    (
        27_000_000,
        940,
        1e8,
        1e4,
        False,
        "cache: computed again (est. 0.094 s) rather than read from disk (est. 0.270 s)",
    ),
    (1_000, 10, 1e3, 10.0, True, "cache: read from disk (est. 1.000 s) rather than computed (est. 1.000 s)"),
    (8_000_000, 1_000, None, 1e4, True, "cache: read from disk (not measured yet: read ?, computed 0.100 s)"),
    (8_000_000, 1_000, 1e8, None, True, "cache: read from disk (not measured yet: read 0.080 s, computed ?)"),
    (8_000_000, 1_000, None, None, True, "cache: read from disk (not measured yet: read ?, computed ?)"),
    # a read this short is taken whatever computing would cost
    (
        1_000_000,
        100,
        1e8,
        1e5,
        True,
        "cache: read from disk (est. 0.010 s) rather than computed (est. 0.001 s)",
    ),
]


@pytest.mark.parametrize(("num_bytes", "num_tokens", "read_rate", "prefill_rate", "reads", "line"), TABLE)
def test_the_decision_and_its_log_line(
    num_bytes: int,
    num_tokens: int,
    read_rate: float | None,
    prefill_rate: float | None,
    reads: bool,
    line: str,
) -> None:
    decision = decide_restore(num_bytes, num_tokens, read_rate, prefill_rate)
    assert decision.reads is reads
    assert str(decision) == line


rates = st.floats(min_value=1e-3, max_value=1e12, allow_nan=False)


@given(
    num_bytes=st.integers(0, 2**40),
    num_tokens=st.integers(0, 2**24),
    read_rate=st.none() | rates,
    prefill_rate=st.none() | rates,
)
def test_it_computes_only_where_both_rates_are_known_and_computing_is_faster(
    num_bytes: int, num_tokens: int, read_rate: float | None, prefill_rate: float | None
) -> None:
    decision = decide_restore(num_bytes, num_tokens, read_rate, prefill_rate)
    if read_rate is None or prefill_rate is None:
        assert decision.reads
    else:
        read_s = num_bytes / read_rate
        assert decision.reads is (read_s < ALWAYS_READ_S or read_s <= num_tokens / prefill_rate)


@given(st.lists(st.tuples(st.floats(0.0, 1e9), st.floats(0.0, 1e3)), min_size=1, max_size=30))
def test_a_mean_stays_within_the_rates_it_was_given(samples: list[tuple[float, float]]) -> None:
    mean = RateMean()
    for amount, seconds in samples:
        mean.add(amount, seconds)
    measured = [amount / seconds for amount, seconds in samples if amount > 0 and seconds > 0]
    if not measured:
        assert mean.per_s is None
    else:
        assert mean.per_s is not None
        assert min(measured) * (1 - 1e-9) <= mean.per_s <= max(measured) * (1 + 1e-9)


def test_the_costs_learn_what_the_read_counters_gained_and_the_engine_s_prefill_slope() -> None:
    costs = RestoreCosts()
    reader, other_reader = object(), object()
    costs.learn(reader, Totals(0, 0.0), 0.0)
    assert costs.read.per_s is None and costs.prefill.per_s is None  # nothing measured yet
    costs.learn(reader, Totals(1000, 1.0), 0.01)
    assert (costs.read.per_s, costs.prefill.per_s) == (1000.0, 100.0)
    costs.learn(reader, Totals(1000, 1.0), 0.01)  # no read since: unchanged
    assert costs.read.per_s == 1000.0
    costs.learn(reader, Totals(3000, 2.0), 0.001)  # gained 2000 B/s; the slope is the engine's
    assert costs.read.per_s == pytest.approx(0.7 * 1000 + 0.3 * 2000)
    assert costs.prefill.per_s == pytest.approx(1000.0)
    # A new persistence actor (a model swap) counts from 0; the new model's slope is not known yet.
    costs.learn(other_reader, Totals(500, 0.5), 0.0)
    assert costs.read.per_s == pytest.approx(0.7 * 1300 + 0.3 * 1000)
    assert costs.prefill.per_s is None
    assert costs.decide(10**9, 1).reads  # unknown: the prior reads


def test_fixed_costs_do_not_learn() -> None:
    costs = RestoreCosts(read_bytes_per_s=5.0, prefill_tokens_per_s=7.0, learns=False)
    costs.learn(object(), Totals(1e9, 1.0), 1e-9)
    assert (costs.read.per_s, costs.prefill.per_s) == (5.0, 7.0)


# ---- through the real engine and files ----

FIRST = "Hi! My name is Ada. Please remember it."
FOLLOW_UP = "\n<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


@pytest_asyncio.fixture
async def make_system(default_model_dir: Path, tmp_path: Path) -> AsyncIterator[type[AgentSystem]]:
    started: list[AgentSystem] = []

    class System(AgentSystem):
        def __init__(self, restore_costs: RestoreCosts) -> None:
            config = SystemConfig(
                engine=EngineConfig(model=str(default_model_dir), cache_budget_mb=256),
                cache_dir=tmp_path / "cache",
                checkpoint_idle_s=None,
            )
            super().__init__(config, restore_costs)
            started.append(self)

    yield System
    for system in started:
        await system.stop()


async def turn(system: AgentSystem, agent_id: str, prompt: list[int]) -> tuple[list[int], PromptStarted]:
    """A greedy turn of an already tokenized prompt through the agent's actor, under its own salt
    (so no agent reuses another's blocks: what is not restored is computed)."""
    request = TurnRequest(
        uuid.uuid4().hex,
        AgentId(agent_id),
        [],
        SamplingParams(temperature=0.0, max_tokens=10),
        prompt_token_ids=list(prompt),
        cache_salt=agent_id,
    )
    stream = (await system.start_turn(request)).stream
    tokens: list[int] = []
    started = None
    async for event in stream:
        if isinstance(event, PromptStarted):
            started = event
        elif isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            break
    assert started is not None
    return tokens, started


async def first_turn_then_evict(system: AgentSystem, agent_id: str) -> list[int]:
    """One turn, then the cache written to disk and dropped from memory; the follow-up's prompt."""
    tokenizer = system.engine.model.tokenizer
    prompt = list(
        tokenizer.apply_chat_template([{"role": "user", "content": FIRST}], add_generation_prompt=True)
    )
    tokens, _ = await turn(system, agent_id, prompt)
    assert await system.evict(AgentId(agent_id))
    return prompt + tokens + list(tokenizer.encode(FOLLOW_UP, add_special_tokens=False))


async def test_the_rates_decide_and_a_computed_history_replies_as_the_restored_one(
    make_system: type[AgentSystem], log_lines: list[str]
) -> None:
    costs = RestoreCosts(read_bytes_per_s=1e12, prefill_tokens_per_s=1.0, learns=False)  # reading wins
    system = make_system(costs)
    await system.start()
    persistence = system.models.persistence
    assert persistence is not None
    read_follow_up = await first_turn_then_evict(system, "reads")
    computed_follow_up = await first_turn_then_evict(system, "computes")
    assert read_follow_up == computed_follow_up

    restored, started = await turn(system, "reads", read_follow_up)
    assert started.cache_tier == "disk" and started.num_cached_tokens > 0
    assert any(
        line.startswith("agent reads turn") and "cache: read from disk (est." in line for line in log_lines
    )

    costs.read, costs.prefill = RateMean(1.0), RateMean(1e12)  # now computing wins
    path = persistence.path_for(AgentId("computes"))
    file_before, num_loads = (path.read_bytes(), path.stat().st_mtime_ns), persistence.num_loads
    computed, started = await turn(system, "computes", computed_follow_up)

    assert started.cache_tier == "none" and started.num_cached_tokens == 0
    assert persistence.num_loads == num_loads  # not read
    assert (path.read_bytes(), path.stat().st_mtime_ns) == file_before  # and left as it was
    assert any(
        line.startswith("agent computes turn") and "cache: computed again (est." in line for line in log_lines
    )
    assert computed == restored  # token for token


async def test_the_rates_are_learnt_from_the_server_s_own_reads_and_prefills(
    make_system: type[AgentSystem], log_lines: list[str]
) -> None:
    costs = RestoreCosts()
    system = make_system(costs)
    await system.start()
    follow_up = await first_turn_then_evict(system, "learner")

    tokens, started = await turn(system, "learner", follow_up)  # nothing read yet: the prior reads
    assert started.cache_tier == "disk"
    assert any("cache: read from disk (not measured yet: read ?" in line for line in log_lines)
    assert await system.evict(AgentId("learner"))
    log_lines.clear()

    await turn(system, "learner", follow_up + tokens)  # decided on two measured rates
    assert costs.read.per_s is not None and costs.read.per_s > 0
    assert costs.prefill.per_s is not None and costs.prefill.per_s > 0
    assert any("rather than" in line and "est." in line for line in log_lines)
