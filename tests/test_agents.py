"""Agents resume from their caches token-exactly: in memory, after eviction to disk, across models."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from semantic.actors.agent_messages import AgentStoppedError, MailboxFullError, StartTurn
from semantic.actors.engine_client import EngineConfig, RequestStream
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest, TurnStarted
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool, ListCaches, ReferenceGenerate, RestoreCache
from semantic.engine.loop.messages import Finished, PromptStarted, TokenDelta
from semantic.engine.loop.served_model import ServedModel
from semantic.storage.agent_id import AgentId, InvalidAgentIdError, agent_id_from
from semantic.storage.cache_file import CacheIdentity, read_cache_file, write_cache_file

TURNS = ["Hi! My name is Ada.", "What is my name?", "Tell me a fun fact about the moon."]


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["llama", "gemma3", "qwen2"])
async def system(
    request: pytest.FixtureRequest,
    tiny_llama_dir: Path,
    tiny_model_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[AgentSystem]:
    """Tiny random-weight models of three architectures (a full-attention Llama, Gemma 3's sliding
    window, Qwen2): whether a cache resumes token for token does not depend on the words."""
    model_dir = tiny_llama_dir if request.param == "llama" else tiny_model_dirs[request.param]
    config = SystemConfig(
        engine=EngineConfig(model=str(model_dir), cache_budget_mb=256),
        cache_dir=tmp_path_factory.mktemp("cache"),
    )
    system = AgentSystem(config)
    await system.start()
    yield system
    await system.stop()


def user_turn(system: AgentSystem, text: str, first: bool) -> list[int]:
    tokenizer = system.engine.model.tokenizer
    if first:
        return list(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        )
    return list(
        tokenizer.encode(
            f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
    )


async def run_turn(stream: RequestStream) -> tuple[list[int], PromptStarted, Finished]:
    tokens: list[int] = []
    started = finished = None
    async for event in stream:
        if isinstance(event, PromptStarted):
            started = event
        elif isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    assert started is not None and finished is not None
    return tokens, started, finished


def token_turn(agent_id: str | None, prompt: list[int], sampling: SamplingParams) -> TurnRequest:
    agent = AgentId(agent_id) if agent_id is not None else None
    return TurnRequest(uuid.uuid4().hex, agent, [], sampling, prompt_token_ids=list(prompt))


async def generate(
    system: AgentSystem, agent_id: str | None, prompt: list[int], sampling: SamplingParams
) -> RequestStream:
    """A turn of already tokenized prompt through the agent's actor."""
    return (await system.start_turn(token_turn(agent_id, prompt, sampling))).stream


async def cold_output(system: AgentSystem, prompt: list[int], max_tokens: int) -> list[int]:
    return await system.engine.ask(ReferenceGenerate(prompt, max_tokens))


def without_eos(system: AgentSystem, tokens: list[int]) -> list[int]:
    return [t for t in tokens if t not in system.engine.model.eos_token_ids]


async def converse(system: AgentSystem, agent_id: str, between_turns=None) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    """Run TURNS for one agent; check every turn against a cold run; return (tier, cached, history)."""
    history: list[int] = []
    report = []
    for index, text in enumerate(TURNS):
        if index and between_turns is not None:
            await between_turns(index)
        prompt = history + user_turn(system, text, first=index == 0)
        stream = await generate(system, agent_id, prompt, SamplingParams(max_tokens=12))
        tokens, started, _ = await run_turn(stream)
        expected = await cold_output(system, prompt, 12)
        assert without_eos(system, tokens) == expected, f"turn {index}"
        report.append((started.cache_tier, started.num_cached_tokens, len(history)))
        history = prompt + tokens
    return report


@pytest.mark.asyncio(loop_scope="module")
async def test_turns_resume_from_memory(system: AgentSystem) -> None:
    report = await converse(system, "memory-agent")
    for tier, cached, history in report[1:]:
        assert (tier, cached) == ("memory", history)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_agent_whose_cache_is_not_on_disk_never_waits_on_the_engine_thread(
    system: AgentSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the engine holds an agent's cache is read without a message (an ask waits for the
    engine's tick to end): a new agent asks the persistence actor for a file once, on its first
    turn, finds none and goes in; a returning agent's cache is in memory, so it goes straight in
    and resumes from it. No turn sends the engine an ask."""
    asked: list[object] = []
    loads: list[AgentId] = []
    send = system.engine.send  # every ask goes through it
    persistence = system.models.persistence
    assert persistence is not None
    describe = persistence.describe_cache

    def recording_send(command):  # type: ignore[no-untyped-def]
        asked.append(command)
        return send(command)

    async def recording_describe(agent_id: AgentId):  # type: ignore[no-untyped-def]
        loads.append(agent_id)
        return await describe(agent_id)

    monkeypatch.setattr(system.engine, "send", recording_send)
    monkeypatch.setattr(persistence, "describe_cache", recording_describe)
    report = await converse(system, "held-agent")
    assert [c for c in asked if not isinstance(c, ReferenceGenerate)] == []  # the test's own cold runs
    assert loads == [AgentId("held-agent")]  # the first turn: no file
    for tier, cached, history in report[1:]:
        assert (tier, cached) == ("memory", history)


@pytest.mark.asyncio(loop_scope="module")
async def test_turns_resume_after_eviction_to_disk(system: AgentSystem) -> None:
    async def evict(index: int) -> None:
        assert await system.evict(AgentId("disk-agent"))
        persistence = system.models.persistence
        assert persistence is not None and persistence.path_for(AgentId("disk-agent")).exists()
        assert not await system.engine.ask(ListCaches("disk-agent"))

    report = await converse(system, "disk-agent", between_turns=evict)
    for tier, cached, history in report[1:]:
        assert (tier, cached) == ("disk", history)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_turn_whose_cache_is_on_disk_goes_in_behind_its_restore_without_waiting_for_it(
    system: AgentSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore is sent to the engine and the turn submitted straight after (the engine thread
    takes them in order), not once the engine has answered, which waits for a tick to end; the
    turn still resumes from the restored cache, and reports it came from disk."""
    agent_id = AgentId("restored-behind")
    sent: list[tuple[object, asyncio.Future[Any]]] = []
    answered_at_submit: list[bool] = []
    send, submit = system.engine.send, system.engine.submit

    def recording_send(command):  # type: ignore[no-untyped-def]
        reply = send(command)
        sent.append((command, reply))
        return reply

    def recording_submit(request):  # type: ignore[no-untyped-def]
        answered_at_submit.extend(
            reply.done() for command, reply in sent if isinstance(command, RestoreCache)
        )
        return submit(request)

    prompt = user_turn(system, TURNS[0], first=True)
    tokens, _, _ = await run_turn(await generate(system, agent_id, prompt, SamplingParams(max_tokens=8)))
    assert await system.evict(agent_id)
    monkeypatch.setattr(system.engine, "send", recording_send)
    monkeypatch.setattr(system.engine, "submit", recording_submit)
    follow_up = prompt + tokens + user_turn(system, TURNS[1], first=False)
    resumed, started, _ = await run_turn(
        await generate(system, agent_id, follow_up, SamplingParams(max_tokens=8))
    )
    assert answered_at_submit == [False]
    assert [reply.result() for command, reply in sent if isinstance(command, RestoreCache)] == [True]
    assert (started.cache_tier, started.num_cached_tokens) == ("disk", len(prompt + tokens))
    assert without_eos(system, resumed) == await cold_output(system, follow_up, 8)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_cache_file_the_engine_cannot_take_is_quarantined_and_the_turn_computes_it(
    system: AgentSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that passes its checks and still fails in the engine (here: the restore raises) is
    quarantined once the engine answers; the turn, already submitted, computes its history."""
    agent_id = AgentId("untakeable")
    prompt = user_turn(system, TURNS[0], first=True)
    tokens, _, _ = await run_turn(await generate(system, agent_id, prompt, SamplingParams(max_tokens=8)))
    assert await system.evict(agent_id)

    def failing_restore(served: ServedModel, cache: Any, salt: str | None = None) -> None:
        raise ValueError("a layer of another shape")

    monkeypatch.setattr(ServedModel, "restore", failing_restore)
    follow_up = prompt + tokens + user_turn(system, TURNS[1], first=False)
    recomputed, started, _ = await run_turn(
        await generate(system, agent_id, follow_up, SamplingParams(max_tokens=8))
    )
    persistence = system.models.persistence
    assert persistence is not None
    assert started.cache_tier != "disk" and started.num_cached_tokens < len(prompt + tokens)
    assert not persistence.path_for(agent_id).exists()
    assert any(p.name.startswith(agent_id) for p in persistence.quarantine_dir.iterdir())
    assert without_eos(system, recomputed) == await cold_output(system, follow_up, 8)


@pytest.mark.parametrize("damage", ["truncate", "flip", "other-model"])
@pytest.mark.asyncio(loop_scope="module")
async def test_damaged_cache_file_is_quarantined_and_agent_starts_cold(
    system: AgentSystem, damage: str
) -> None:
    agent_id = AgentId(f"damaged-{damage}")
    prompt = user_turn(system, TURNS[0], first=True)
    await run_turn(await generate(system, agent_id, prompt, SamplingParams(max_tokens=6)))
    assert await system.evict(agent_id)
    persistence = system.models.persistence
    assert persistence is not None
    path = persistence.path_for(agent_id)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        identity = persistence.identity
        cache = read_cache_file(path, identity)
        other = CacheIdentity("another-model", "0" * 32, identity.block_size, identity.spec)
        write_cache_file(path, cache, other)
    follow_up = prompt + user_turn(system, TURNS[1], first=False)
    tokens, started, _ = await run_turn(
        await generate(system, agent_id, follow_up, SamplingParams(max_tokens=8))
    )
    assert started.num_cached_tokens == 0
    assert not path.exists()
    assert any(p.name.startswith(agent_id) for p in persistence.quarantine_dir.iterdir())
    assert without_eos(system, tokens) == await cold_output(system, follow_up, 8)


@pytest.mark.asyncio(loop_scope="module")
async def test_agents_sharing_a_system_prompt_store_it_once(system: AgentSystem) -> None:
    tokenizer = system.engine.model.tokenizer
    shared = "You are a meticulous assistant. " * 120
    block_size = system.engine.model.spec.block_size

    async def used_blocks() -> int:
        report = await system.engine.ask(InspectPool())
        return report.num_blocks - report.num_free_blocks

    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": shared}, {"role": "user", "content": f"Agent {i}: hi"}],
                add_generation_prompt=True,
            )
        )
        for i in range(4)
    ]
    before = await used_blocks()
    await run_turn(await generate(system, "share-0", prompts[0], SamplingParams(max_tokens=4)))
    first = await used_blocks() - before
    spec = system.engine.model.spec
    for i in range(1, 4):
        _, started, _ = await run_turn(
            await generate(system, f"share-{i}", prompts[i], SamplingParams(max_tokens=4))
        )
        # Token ids say nowhere where the system prompt ends: a sliding-window model's first agent to
        # share the blocks stops its prefill at their end to keep the window there for the rest.
        if i > 1 or not spec.has_sliding_layers:
            assert started.num_cached_tokens >= block_size
    per_other_agent = (await used_blocks() - before - first) / 3
    assert first >= 3
    # Only the private tail block, and a sliding model's windows near where each prompt ends (and,
    # once, where the shared blocks end).
    assert per_other_agent <= 1 + 2 * spec.window_extra


@pytest.mark.asyncio(loop_scope="module")
async def test_one_agent_runs_one_turn_at_a_time(system: AgentSystem) -> None:
    prompt = user_turn(system, "Count to five.", first=True)
    order: list[str] = []

    async def turn(name: str) -> None:
        stream = await generate(system, "serial", prompt, SamplingParams(max_tokens=6))
        async for event in stream:
            if isinstance(event, PromptStarted):
                order.append(f"{name}-start")
            elif isinstance(event, Finished):
                order.append(f"{name}-end")

    await asyncio.gather(turn("a"), turn("b"))
    assert order in (["a-start", "a-end", "b-start", "b-end"], ["b-start", "b-end", "a-start", "a-end"])


@pytest.mark.asyncio(loop_scope="module")
async def test_full_mailbox_is_refused_and_stop_fails_queued_asks(system: AgentSystem) -> None:
    actor = system._actor(AgentId("busy"))
    prompt = user_turn(system, "Say hi.", first=True)

    def ask() -> asyncio.Future[TurnStarted]:
        return actor.ask(StartTurn(token_turn("busy", prompt, SamplingParams(max_tokens=4))))

    asks = [ask() for _ in range(actor.mailbox_size)]
    with pytest.raises(MailboxFullError, match=f"{actor.mailbox_size} requests queued"):
        ask()
    # The stop's own reply has no reader: an exception on it would be logged as never retrieved.
    unretrieved: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        actor.stop_nowait()
        results = await asyncio.gather(*asks, return_exceptions=True)
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert any(isinstance(r, AgentStoppedError) for r in results)
    assert unretrieved == []
    for result in results:
        if isinstance(result, TurnStarted):
            async for _ in result.stream:
                pass


def test_agent_ids_are_validated() -> None:
    assert AgentId("agent-1.a_b") == "agent-1.a_b"
    for bad in ["", "../etc", "a/b", ".hidden", "x" * 129, "a b", "-x", "#anon-1", "a\x00b"]:
        with pytest.raises(InvalidAgentIdError):
            AgentId(bad)
    headers = {"x-session-id": "s", "x-claude-code-session-id": "c"}
    assert agent_id_from({"x-agent-id": "a", **headers}, "body") == "a"
    assert agent_id_from(headers, "body") == "body"
    assert agent_id_from(headers) == "s"
    assert agent_id_from({"x-claude-code-session-id": "c"}) == "c"
    assert agent_id_from({}) is None
