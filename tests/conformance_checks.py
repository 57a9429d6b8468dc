"""The five conformance checks of one model, run through semantic's AgentSystem and judged against
mlx-lm's own greedy generation on exactly the prompt token ids the engine ran.

cold: a new agent's first turn. resume: its next turn, from its cache in memory. share: a second
agent whose prompt starts with the first one's system prompt. batch: four agents' turns started
together. restart: the first agent's next turn after the system is stopped (caches flushed to disk)
and a new one started on the same cache directory.

The engine's turns run first, both systems are stopped, and only then does mlx-lm generate, on this
(the test's) thread: semantic's attention hooks act on the engine thread only, so this is mlx-lm's
own code, bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm.generate import generate_step

from semantic.actors.prompting.chat_format import ChatMessage
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest, TurnStarted
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.config import EngineConfig
from semantic.engine.loop.messages import Finished, PromptStarted
from semantic.storage.agent_id import AgentId

MAX_TOKENS = 16
MIN_DISTINCT_TOKENS = 4  # fewer in a reference reply: the model collapsed, and a match proves nothing
BLOCK_SIZE = 16  # small, so the system prompt spans several blocks
TURN_TIMEOUT_S = 600.0  # a turn that hangs fails its check instead of the whole run
CHECKS = ("cold", "resume", "restart", "share", "batch")

# ~170 tokens: several blocks of 16, short enough for a slow CPU.
SYSTEM_PROMPT = (
    "You are Quill, the coding assistant of a small team that maintains a Python web service. "
    "Answer in short paragraphs. Prefer the standard library. When you change code, show the whole "
    "function, name the file, and say which test covers it. Never invent an API: if you are not sure "
    "a function exists, say so and suggest how to check. The service runs on Python 3.11 with "
    "aiohttp, stores its data in SQLite through a thin repository layer, and ships as a wheel. Tests "
    "use pytest with real files in temporary directories and a real server on loopback; mocks are "
    "allowed only for the clock and the network. Commit messages start with the area they touch."
)
AGENT_TURNS = (
    "Where should a new HTTP handler for exporting reports go?",
    "And which test would cover it?",
    "Summarise both answers in one sentence.",
)
SHARE_TURN = "How do I add a column to the users table?"
BATCH_PROMPTS = (
    ("You answer in one word.", "Name a prime number."),
    ("You are a librarian who loves long, careful explanations of catalogues.", "What is a call number?"),
    ("You are terse.", "What does HTTP status 404 mean, and when should a server send 410 instead?"),
    ("You write haiku about the sea, the wind, the tides and the long grey harbour walls.", "Write one."),
)


class CheckResult(msgspec.Struct, omit_defaults=True):
    check: str
    status: str  # pass | fail | collapsed | error | not run
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    expected_cached: str = ""
    cache_tier: str = ""
    num_distinct_reference_tokens: int = 0
    peak_batch_size: int = 0  # sequences the engine held at once while the check's turns ran
    failure: str = ""
    reply_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    reference_token_ids: list[list[int]] = msgspec.field(default_factory=list)


class RefusedError(Exception):
    """The system did not start with this model: semantic refused it at load."""


class NotRunError(Exception):
    """A check that needs an earlier one's turns, which failed."""


@dataclass(slots=True)
class EngineTurn:
    prompt_token_ids: list[int]
    reply_token_ids: list[int]
    num_cached_tokens: int
    cache_tier: str
    peak_batch_size: int

    def history_without(self, eos_token_ids: set[int]) -> list[int]:
        """What a kept conversation keeps of the turn: the prompt and the reply without its end token
        (actors/kept_conversation.py drops it; the next turn's template writes the end itself)."""
        reply = self.reply_token_ids
        if reply and reply[-1] in eos_token_ids:
            reply = reply[:-1]
        return self.prompt_token_ids + reply


@dataclass(slots=True)
class Observed:
    """One check's engine side: its turns, or the error that stopped it; `cache_failure` says how the
    reuse differed from what the check expects."""

    check: str
    turns: list[EngineTurn] = field(default_factory=list)
    expected_cached: str = ""
    cache_failure: str = ""
    error: str = ""
    not_run: str = ""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def system_config(model_dir: Path, cache_dir: Path) -> SystemConfig:
    return SystemConfig(
        engine=EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, cache_budget_mb=64),
        cache_dir=cache_dir,
        checkpoint_idle_s=None,  # only the stop writes caches, so the restart check reads what it flushed
        actor_idle_s=3600.0,
    )


async def run_turn(system: AgentSystem, turn: TurnRequest) -> EngineTurn:
    started = await system.start_turn(turn)
    return await asyncio.wait_for(read_turn(system, started), TURN_TIMEOUT_S)


async def read_turn(system: AgentSystem, started: TurnStarted) -> EngineTurn:
    tier, cached, peak = "", -1, 0
    final: Finished | None = None
    async for event in started.stream:
        peak = max(peak, system.engine.stats.num_running)
        if isinstance(event, PromptStarted):
            tier, cached = event.cache_tier, event.num_cached_tokens
        elif isinstance(event, Finished):
            final = event
    assert final is not None, "a stream ended without Finished: engine bug"  # and the turn is durable
    return EngineTurn(list(started.prompt.token_ids), list(final.generated_token_ids), cached, tier, peak)


def kept_turn(agent_id: str, text: str) -> TurnRequest:
    """A turn of the direct agent API: the agent keeps the conversation (system prompt included)."""
    messages: list[ChatMessage] = [{"role": "user", "content": text}]
    return TurnRequest(uuid.uuid4().hex, AgentId(agent_id), messages, greedy(), keeps_conversation=True)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


async def observe(check: str, run: Callable[[Observed], Awaitable[None]]) -> Observed:
    observed = Observed(check)
    try:
        await run(observed)
    except NotRunError as reason:
        observed.not_run = str(reason)
    except Exception as error:  # the check's failure, reported; the other checks still run
        observed.error = describe(error)
    return observed


def expect(observed: Observed, turn: EngineTurn, cached: int, tier: str | None = None) -> None:
    observed.expected_cached = f"== {cached}" + (f" ({tier})" if tier else "")
    if turn.num_cached_tokens != cached or (tier is not None and turn.cache_tier != tier):
        observed.cache_failure = (
            f"reused {turn.num_cached_tokens} tokens ({turn.cache_tier}), expected {cached}"
            + (f" ({tier})" if tier else "")
        )


async def run_engine_checks(model_dir: Path, cache_dir: Path, eos_token_ids: set[int]) -> list[Observed]:
    """The engine side of every check; raises RefusedError if the system does not start."""
    config = system_config(model_dir, cache_dir)
    observed: list[Observed] = []
    agent = "conformance-agent"
    async with started_system(config) as system:
        turns: list[EngineTurn] = []

        async def cold(check: Observed) -> None:
            await system.open(agent, system_prompt=SYSTEM_PROMPT, resume=False)
            turns.append(await run_turn(system, kept_turn(agent, AGENT_TURNS[0])))
            check.turns = [turns[-1]]
            expect(check, turns[-1], 0)

        async def resume(check: Observed) -> None:
            if not turns:
                raise NotRunError("the cold turn failed")
            history = turns[-1].history_without(eos_token_ids)
            turns.append(await run_turn(system, kept_turn(agent, AGENT_TURNS[1])))
            check.turns = [turns[-1]]
            expect(check, turns[-1], len(history), "memory")

        async def share(check: Observed) -> None:
            sharer = "conformance-sharer"
            await system.open(sharer, system_prompt=SYSTEM_PROMPT, resume=False)
            turn = await run_turn(system, kept_turn(sharer, SHARE_TURN))
            check.turns = [turn]
            check.expected_cached = f">= {BLOCK_SIZE}"
            if turn.num_cached_tokens < BLOCK_SIZE:
                check.cache_failure = (
                    f"reused {turn.num_cached_tokens} tokens, expected at least {BLOCK_SIZE}"
                )

        async def batch(check: Observed) -> None:
            requests = [
                TurnRequest(
                    uuid.uuid4().hex,
                    AgentId(f"conformance-batch-{index}"),
                    [{"role": "system", "content": system_text}, {"role": "user", "content": user_text}],
                    greedy(),
                )
                for index, (system_text, user_text) in enumerate(BATCH_PROMPTS)
            ]
            started = await asyncio.gather(*(system.start_turn(request) for request in requests))
            check.turns = list(
                await asyncio.wait_for(
                    asyncio.gather(*(read_turn(system, s) for s in started)), TURN_TIMEOUT_S
                )
            )

        for name, run in (("cold", cold), ("resume", resume), ("share", share), ("batch", batch)):
            observed.append(await observe(name, run))

    async def restart(check: Observed) -> None:
        if len(turns) < 2:
            raise NotRunError("the resume turn failed")
        history = turns[-1].history_without(eos_token_ids)
        async with started_system(config) as system:
            turn = await run_turn(system, kept_turn(agent, AGENT_TURNS[2]))
        check.turns = [turn]
        expect(check, turn, len(history), "disk")

    observed.append(await observe("restart", restart))
    return sorted(observed, key=lambda o: CHECKS.index(o.check))


@contextlib.asynccontextmanager
async def started_system(config: SystemConfig) -> AsyncIterator[AgentSystem]:
    """An AgentSystem started (RefusedError if it does not start), stopped with its caches flushed."""
    system = AgentSystem(config)
    try:
        await system.start()
    except Exception as error:
        with contextlib.suppress(Exception):  # the start's error is the one to report
            await system.stop(flush=False)
        raise RefusedError(describe(error)) from error
    try:
        yield system
    finally:
        await system.stop()


def reference_reply(model: Any, prompt_token_ids: list[int], eos_token_ids: set[int]) -> list[int]:
    """mlx-lm's greedy reply, ending at an end token or MAX_TOKENS as the engine's does."""
    reply: list[int] = []
    for token, _ in generate_step(mx.array(prompt_token_ids), model, max_tokens=MAX_TOKENS):
        reply.append(int(token))
        if reply[-1] in eos_token_ids:
            break
    return reply


def judge(observed: Observed, model: Any, eos_token_ids: set[int]) -> CheckResult:
    """The check's result: the engine's replies against mlx-lm's on the same prompts."""
    turns = observed.turns
    result = CheckResult(
        observed.check,
        "pass",
        num_prompt_tokens=sum(len(turn.prompt_token_ids) for turn in turns),
        num_cached_tokens=sum(turn.num_cached_tokens for turn in turns),
        expected_cached=observed.expected_cached,
        cache_tier="/".join(sorted({turn.cache_tier for turn in turns})),
        peak_batch_size=max((turn.peak_batch_size for turn in turns), default=0),
    )
    if observed.error or observed.not_run:
        result.status = "error" if observed.error else "not run"
        result.failure = observed.error or observed.not_run
        return result
    references = [reference_reply(model, turn.prompt_token_ids, eos_token_ids) for turn in turns]
    result.num_distinct_reference_tokens = min(len(set(reference)) for reference in references)
    failures = [
        f"turn {index}: {difference(turn.reply_token_ids, reference)}"
        for index, (turn, reference) in enumerate(zip(turns, references, strict=True))
        if turn.reply_token_ids != reference
    ]
    if observed.cache_failure:
        failures.insert(0, observed.cache_failure)
    if failures:
        result.status, result.failure = "fail", "; ".join(failures)
    elif result.num_distinct_reference_tokens < MIN_DISTINCT_TOKENS:
        result.status = "collapsed"
        result.failure = f"mlx-lm's reply has {result.num_distinct_reference_tokens} distinct tokens"
    if result.status != "pass":  # what to look at; a pass's replies are its references
        result.reply_token_ids = [turn.reply_token_ids for turn in turns]
        result.reference_token_ids = references
    return result


def difference(reply: list[int], reference: list[int]) -> str:
    same = [a == b for a, b in zip(reply, reference, strict=False)]
    index = same.index(False) if False in same else len(same)
    shown = slice(index, index + 4)
    return f"differs from mlx-lm at token {index}: engine {reply[shown]}, mlx-lm {reference[shown]}"
