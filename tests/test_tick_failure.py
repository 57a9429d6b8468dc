"""A tick that raises where nothing should (an allocation or an MLX error while keeping caches)
fails the requests in flight, not the engine: it is counted, and the next request is served."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from semantic.actors.engine_client import Engine, EngineConfig, EngineError
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import ReferenceGenerate
from semantic.engine.loop.messages import Finished, GenerationRequest, TokenDelta

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(default_model_dir: Path) -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model=str(default_model_dir), cache_budget_mb=128))
    await engine.start()
    yield engine
    await engine.stop()


async def run(engine: Engine, prompt: list[int]) -> tuple[list[int], Finished | Exception]:
    request = GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=6))
    tokens: list[int] = []
    try:
        async for event in engine.submit(request):
            if isinstance(event, TokenDelta):
                tokens.extend(event.token_ids)
            elif isinstance(event, Finished):
                return tokens, event
    except EngineError as error:
        return tokens, error
    raise AssertionError("the stream ended without Finished or an error")


async def test_a_failed_tick_fails_its_requests_and_the_engine_serves_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = list(
        engine.model.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True
        )
    )
    core = engine._core
    assert core is not None and core._served is not None
    batch = core._served.batch
    keep_caches = batch.keep_caches
    failures = []

    def fails_once() -> None:
        if not failures:
            failures.append(1)
            raise MemoryError("no memory to keep the caches")  # as an allocation that fails would
        keep_caches()

    monkeypatch.setattr(batch, "keep_caches", fails_once)

    _, failed = await run(engine, prompt)
    tokens, finished = await run(engine, prompt)

    assert isinstance(failed, EngineError) and "no memory to keep the caches" in str(failed)
    assert isinstance(finished, Finished) and engine.stats.num_tick_failures == 1
    reference = await engine.ask(ReferenceGenerate(prompt, len(tokens)))
    assert tokens == reference
