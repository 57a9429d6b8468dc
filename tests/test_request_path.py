"""The path of one turn, counted on the real model: one tokenizer job per turn, the final event
entering the reader's queue once (and only once the turn is committed), one flush of events per
engine tick with nothing left for a later one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from semantic.actors.cache_miss import Reason, explain_in_worker
from semantic.actors.engine_client import EngineConfig
from semantic.actors.models import ModelHost
from semantic.actors.prompting.output_grammars import json_schema_grammar
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turn_prompt import _compile
from semantic.actors.turns import OutputGrammar, TurnRequest, TurnStarted
from semantic.engine.decoding.grammar_matcher import GrammarError
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.engine_loop import EngineLoop
from semantic.engine.loop.messages import Event, EventChannel, Finished, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.storage.agent_id import AgentId

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[AgentSystem]:
    async with AgentSystem(config_for(default_model_dir, tmp_path_factory.mktemp("cache"))) as system:
        yield system


def config_for(model_dir: Path, cache_dir: Path) -> SystemConfig:
    return SystemConfig(engine=EngineConfig(model=str(model_dir), cache_budget_mb=256), cache_dir=cache_dir)


def chat_turn(agent_id: str | None, messages: list[dict[str, Any]], **fields: Any) -> TurnRequest:
    agent = AgentId(agent_id) if agent_id is not None else None
    return TurnRequest(
        uuid.uuid4().hex, agent, messages, SamplingParams(max_tokens=6, temperature=0.0), **fields
    )


def count_jobs(models: ModelHost, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions the model host runs in its tokenizer workers, from now on."""
    jobs: list[str] = []
    in_worker = models.in_tokenizer_worker

    async def counted(fn: Callable[..., Any], *args: Any) -> Any:
        jobs.append(fn.__name__)
        return await in_worker(fn, *args)

    monkeypatch.setattr(models, "in_tokenizer_worker", counted)
    return jobs


async def reply_of(started: TurnStarted) -> str:
    return "".join([event.text async for event in started.stream if isinstance(event, TokenDelta)])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_turn_waits_on_the_tokenizer_workers_once(
    system: AgentSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = count_jobs(system.models, monkeypatch)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi! My name is Ada."}]
    first = await system.start_turn(chat_turn("one-job", messages))
    assert first.cache.reason is Reason.FIRST_TURN
    messages += [
        {"role": "assistant", "content": await reply_of(first)},
        {"role": "user", "content": "What is my name?"},
    ]
    assert jobs == ["prepare_in_worker"]

    note = system.cache_notes.note_of(AgentId("one-job"))
    assert note is not None  # the first turn's, which the second is explained against
    turn = chat_turn("one-job", messages)
    second = await system.start_turn(turn)
    await reply_of(second)
    assert jobs == ["prepare_in_worker"] * 2
    session = system.models.session
    assert session is not None
    oracle = explain_in_worker(session.chat, note, session.loaded.fingerprint, turn, second.prompt.token_ids)
    assert second.cache == oracle[0] and second.cache.reason is not Reason.FIRST_TURN

    guided = await system.start_turn(chat_turn("one-job", messages, output_schema=SCHEMA))
    assert guided.stream.request.grammar is not None  # compiled in the same job
    await reply_of(guided)
    assert jobs == ["prepare_in_worker"] * 3


async def test_a_restarted_servers_turn_is_explained_against_its_agents_file(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi! My name is Ada."}]
    async with AgentSystem(config_for(default_model_dir, tmp_path)) as before:
        first = await before.start_turn(chat_turn("restarted", messages))
        messages += [
            {"role": "assistant", "content": await reply_of(first)},
            {"role": "user", "content": "What is my name?"},
        ]
    async with AgentSystem(config_for(default_model_dir, tmp_path)) as after:  # the file is the history
        jobs = count_jobs(after.models, monkeypatch)
        second = await after.start_turn(chat_turn("restarted", messages))
        await reply_of(second)
        assert second.restore is not None and second.restore.reads
        # The note came from the file after the prompt was made: explained again, the one case.
        assert jobs == ["prepare_in_worker", "explain_in_worker"]
        assert second.cache.reason is not Reason.FIRST_TURN
        assert second.cache.num_history_tokens > 0


class CountingQueue(asyncio.Queue[Event]):
    """A request's event queue that counts the final events put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.num_finished = 0

    def put_nowait(self, item: Event) -> None:
        self.num_finished += isinstance(item, Finished)
        super().put_nowait(item)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_final_event_enters_the_readers_queue_once_and_after_the_commit(
    system: AgentSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    channels: list[EventChannel] = []
    init = EventChannel.__init__

    def counting(self: EventChannel, loop: asyncio.AbstractEventLoop) -> None:
        init(self, loop)
        self.queue = CountingQueue()
        channels.append(self)

    monkeypatch.setattr(EventChannel, "__init__", counting)
    agent = AgentId("once")
    for agent_id, kept in [("once", False), ("once-kept", True), (None, False)]:
        turn = chat_turn(agent_id, [{"role": "user", "content": "Hello there."}], keeps_conversation=kept)
        started = await system.start_turn(turn)
        finals: list[Finished] = []
        async for event in started.stream:
            if isinstance(event, Finished):
                finals.append(event)
                if agent_id == "once":  # committed first: the agent's note holds this turn's reply
                    note = system.cache_notes.note_of(agent)
                    num_tokens = len(started.prompt.token_ids) + event.num_generated_tokens
                    assert note is not None and len(note.history) == num_tokens
        assert len(finals) == 1 and started.stream.done.result() is finals[0]  # the engine's, once
        queue = channels[-1].queue
        assert isinstance(queue, CountingQueue) and queue.num_finished == 1


async def test_each_engine_tick_flushes_its_events_once_and_leaves_none_behind(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushes = [0]
    ticks: list[tuple[int, bool]] = []  # per tick: flushes, and whether events were left behind
    flush, run_tick = Outbox.flush, EngineLoop._run_tick

    def counted_flush(self: Outbox) -> None:
        flushes[0] += 1
        flush(self)

    def watched_tick(self: EngineLoop, now: float, chunk: int, fail_reason: str | None) -> None:
        flushes[0] = 0
        run_tick(self, now, chunk, fail_reason)
        served = self._served
        running = served.batch.running.values() if served is not None else []
        ticks.append((flushes[0], bool(self._outbox) or any(s.outbox for s in running)))

    monkeypatch.setattr(Outbox, "flush", counted_flush)
    monkeypatch.setattr(EngineLoop, "_run_tick", watched_tick)
    async with AgentSystem(config_for(default_model_dir, tmp_path)) as system:
        turns = [
            chat_turn(f"tick-{i}", [{"role": "user", "content": f"Count to {i + 3}."}]) for i in range(3)
        ]
        started = await asyncio.gather(*(system.start_turn(turn) for turn in turns))
        replies = await asyncio.gather(*(reply_of(one) for one in started))
    assert all(replies) and ticks
    assert ticks == [(1, False)] * len(ticks)


@pytest.mark.asyncio(loop_scope="module")
async def test_grammar_fallbacks_hold_in_the_one_job(system: AgentSystem) -> None:
    session = system.models.session
    assert session is not None
    grammars, broken = session.grammars, "start: %% not a grammar"
    valid = OutputGrammar(json_schema_grammar(SCHEMA, "schema"))
    with pytest.raises(GrammarError):
        _compile(grammars, OutputGrammar(broken), None)  # the client's: refused
    assert _compile(grammars, OutputGrammar(broken, is_optional=True), None) is None  # the server's: free
    assert _compile(grammars, OutputGrammar(broken, fallback=valid), None) is not None  # the looser one
