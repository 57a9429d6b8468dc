"""An imported agent's cache is another person's data: its blocks, and every block computed on top of
them, serve only that agent. A sender who altered its KV (checksums recomputed) cannot change what
any other request answers, and the mark stays with the agent's cache file across saves. The engine
serves the tiny random-weight Llama: what is tested is which blocks serve whom, and the replies are
compared with the same model's own."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from semantic.actors.engine_client import Engine, EngineConfig
from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import LoadModel, ReferenceGenerate, RestoreCache, TakeCache, UnloadModel
from semantic.engine.loop.messages import Finished, GenerationRequest, PromptStarted, TokenDelta
from semantic.storage.agent_archive import export_archive, import_archive
from semantic.storage.agent_id import AgentId
from semantic.storage.cache_dir_files import AgentFiles
from semantic.storage.cache_file import identity_of, read_cache_file, read_metadata, write_cache_file

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 8


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_llama_dir: Path) -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=128, block_size=16))
    await engine.start()
    yield engine
    await engine.stop()


def first_turn(engine: Engine) -> list[int]:
    messages = [
        {"role": "system", "content": "You are a terse assistant for a fruit shop."},
        {"role": "user", "content": "Name a red fruit."},
    ]
    return list(engine.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


async def turn(engine: Engine, prompt: list[int], agent_id: str | None) -> tuple[list[int], int]:
    """The reply's tokens and how many prompt tokens came from the cache."""
    request = GenerationRequest(
        uuid.uuid4().hex, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), agent_id
    )
    tokens: list[int] = []
    num_cached = -1
    async for event in engine.submit(request):
        if isinstance(event, PromptStarted):
            num_cached = event.num_cached_tokens
        elif isinstance(event, TokenDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            return tokens, num_cached
    raise AssertionError("the stream ended without Finished")


def altered(cache: SerializedCache, agent_id: str) -> SerializedCache:
    """The cache with every key and value negated (the sign bit flipped), as a hostile sender's."""
    tensors = {}
    for name, tensor in cache.tensors.items():
        if name.startswith("attn."):
            tensor = tensor ^ np.array(1 << (8 * tensor.itemsize - 1), dtype=tensor.dtype)
        tensors[name] = tensor
    return SerializedCache(agent_id, tensors, cache.kv_starts, cache.num_tokens, cache.state_points)


async def reload(engine: Engine, model_dir: Path) -> None:
    """A fresh pool: nothing of the sender's turn is left in it."""
    await engine.ask(UnloadModel())
    await engine.ask(LoadModel(str(model_dir)))


async def imported_cache(engine: Engine, model_dir: Path, tmp_path: Path) -> tuple[SerializedCache, Path]:
    """A sender's turn, its KV altered and its checksums recomputed, exported and imported here; the
    cache as the server reads it, and its file."""
    prompt = first_turn(engine)
    await turn(engine, prompt, "sender")
    taken = await engine.ask(TakeCache("sender"))
    assert taken is not None
    identity = identity_of(engine.model)
    sender_folder = tmp_path / "sender" / "agents" / engine.model.fingerprint[:16]
    write_cache_file(sender_folder / "mallory.safetensors", altered(taken, "mallory"), identity)
    archive = tmp_path / "mallory.tar"
    export_archive(AgentFiles(AgentId("mallory"), sender_folder, has_cache=True), archive)
    _, folder = import_archive(archive, tmp_path / "receiver")
    await reload(engine, model_dir)
    path = folder / "mallory.safetensors"
    return read_cache_file(path, identity_of(engine.model), "mallory"), path


async def test_an_imported_agent_s_altered_blocks_serve_no_other_request(
    engine: Engine, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    prompt = first_turn(engine)
    reference = await engine.ask(ReferenceGenerate(prompt, MAX_TOKENS))
    cache, _ = await imported_cache(engine, tiny_llama_dir, tmp_path)

    assert await engine.ask(RestoreCache(cache, engine.model.fingerprint))
    _, num_cached_imported = await turn(engine, prompt, "mallory")
    tokens, num_cached = await turn(engine, prompt, "victim")
    anonymous, _ = await turn(engine, prompt, None)  # may share the victim's blocks, computed here

    assert num_cached_imported == len(prompt) - 1  # its own cache serves it
    assert num_cached == 0
    assert tokens == reference[: len(tokens)] and anonymous == reference[: len(anonymous)]
    assert len(tokens) == len(anonymous) == len(reference)


async def test_the_imported_mark_stays_with_the_agent_s_cache_across_saves(
    engine: Engine, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cache, path = await imported_cache(engine, tiny_llama_dir, tmp_path)
    assert read_metadata(path).get("origin") == "imported"

    assert await engine.ask(RestoreCache(cache, engine.model.fingerprint))
    prompt = first_turn(engine)
    await turn(engine, prompt, "mallory")
    saved = await engine.ask(TakeCache("mallory"))  # as a flush or an eviction writes it
    assert saved is not None and saved.num_tokens > len(prompt)
    write_cache_file(path, saved, identity_of(engine.model))
    assert read_metadata(path).get("origin") == "imported"

    await reload(engine, tiny_llama_dir)  # a restart
    assert await engine.ask(
        RestoreCache(read_cache_file(path, identity_of(engine.model)), engine.model.fingerprint)
    )
    reference = await engine.ask(ReferenceGenerate(prompt, MAX_TOKENS))
    tokens, num_cached = await turn(engine, prompt, "victim-after-restart")
    assert num_cached == 0 and tokens == reference
