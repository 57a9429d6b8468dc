"""A turn's one stream, owned by its agent actor: Finished reaches the reader only once the turn is
durable, or an error does instead; the real model, the real agents' folder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import Finished, FinishReason
from semantic.storage.agent_id import AgentId
from semantic.storage.conversation_file import read_conversation


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[AgentSystem]:
    config = SystemConfig(
        engine=EngineConfig(model=str(default_model_dir), cache_budget_mb=256),
        cache_dir=tmp_path_factory.mktemp("cache"),
    )
    async with AgentSystem(config) as system:
        yield system


def kept_turn(agent_id: str, text: str) -> TurnRequest:
    return TurnRequest(
        f"{agent_id}-{text}",
        AgentId(agent_id),
        [{"role": "user", "content": text}],
        SamplingParams(max_tokens=6, temperature=0.0),
        keeps_conversation=True,
    )


@pytest.mark.asyncio(loop_scope="module")
async def test_finished_reaches_the_reader_only_once_the_turn_is_on_disk(system: AgentSystem) -> None:
    persistence = system.models.persistence
    assert persistence is not None
    path = persistence.conversation_path_for(AgentId("durable"))
    for num_turns, text in enumerate(["Hi!", "And again?"], start=1):
        started = await system.start_turn(kept_turn("durable", text))
        async for event in started.stream:
            if isinstance(event, Finished):
                record = read_conversation(path)  # read as the reader gets Finished, not after
                assert record is not None and record.num_turns == num_turns
                assert record.token_ids[: len(started.prompt.token_ids)] == started.prompt.token_ids
        assert started.stream.finished is not None
        assert started.stream.finished.reason is not FinishReason.CANCELLED


@pytest.mark.asyncio(loop_scope="module")
async def test_a_turn_that_cannot_be_saved_ends_with_its_error_and_the_agent_serves_on(
    system: AgentSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    persistence = system.models.persistence
    assert persistence is not None
    save = persistence.save_conversation
    failures = [OSError(28, "No space left on device")]

    async def fails_once(*args: object) -> None:
        if failures:
            raise failures.pop()
        await save(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(persistence, "save_conversation", fails_once)
    started = await system.start_turn(kept_turn("unsaved", "Hello there."))
    events: list[object] = []
    with pytest.raises(OSError, match="No space left"):
        async for event in started.stream:
            events.append(event)
    assert not any(isinstance(event, Finished) for event in events)  # never acknowledged
    assert events  # it did generate: only the commit failed
    path = persistence.conversation_path_for(AgentId("unsaved"))
    assert read_conversation(path) is None
    started = await system.start_turn(kept_turn("unsaved", "Hello again."))
    finals = [event async for event in started.stream if isinstance(event, Finished)]
    assert len(finals) == 1
    record = read_conversation(path)
    assert record is not None and record.num_turns == 1  # the failed turn was not kept
