"""A hybrid model resumes where the previous prompt's generation prompt began when the chat template
rewrites that prompt's tail, from memory and after a restart, token-exactly against mlx-lm.

Qwen3's template ends a generation prompt with an empty `<think>\n\n</think>\n\n` and renders the
reply without it, so the next prompt parts a few tokens before the previous prompt's end. A recurrent
state cannot be cut back: the agent keeps one where the generation prompt begins (the assistant
header), which the next prompt still shares.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from semantic.actors.engine_client import EngineConfig
from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import PromptStarted, TokenDelta
from semantic.storage.agent_id import AgentId
from tests.agent_api_client import _loaded, cold_continuation
from tests.test_real_templates import model_with_template

BLOCK = 16
NUM_TOKENS = 12
SYSTEM = "You are a careful assistant who answers questions about rivers, boats and bridges. " * 4


@pytest.fixture(scope="module", params=["qwen3_next", "lfm2"])
def model_dir(
    request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    dest = tmp_path_factory.mktemp(request.param)
    return model_with_template(request.param, "qwen3.jinja", default_model_dir, dest)


def system_config(model_dir: Path, cache_dir: Path) -> SystemConfig:
    engine = EngineConfig(model=str(model_dir), cache_budget_mb=64, block_size=BLOCK)
    return SystemConfig(engine=engine, cache_dir=cache_dir)


async def exact_turn(
    system: AgentSystem, model_dir: Path, messages: list[dict[str, Any]]
) -> tuple[list[int], str, PromptStarted]:
    """One chat turn of the whole conversation, its reply checked token for token against mlx-lm:
    its prompt's token ids, its reply's text and how much of the prompt was cached."""
    sampling = SamplingParams(max_tokens=NUM_TOKENS)
    request = TurnRequest(uuid.uuid4().hex, AgentId("agent"), messages, sampling)
    started = await system.start_turn(request)
    reply: list[int] = []
    prompt_started = None
    async for event in started.stream:
        if isinstance(event, PromptStarted):
            prompt_started = event
        elif isinstance(event, TokenDelta):
            reply.extend(event.token_ids)
    assert prompt_started is not None
    tokenizer = _loaded(model_dir)[1]
    prompt = list(started.prompt.token_ids)
    expected = cold_continuation(model_dir, prompt, NUM_TOKENS)
    reply = [t for t in reply if t not in tokenizer.eos_token_ids]
    assert reply == expected
    assert len(set(expected)) > 2, "the random model's reply collapsed: the oracle would be vacuous"
    return prompt, tokenizer.decode(reply), prompt_started


def generation_prompt_start(model_dir: Path, messages: list[dict[str, Any]], prompt: list[int]) -> int:
    """Where the generation prompt begins in `prompt` (`messages` rendered with it)."""
    chat = ChatFormat(_loaded(model_dir)[1])
    bare = chat.encode(chat.render(messages, add_generation_prompt=False), None)
    assert prompt[: len(bare)] == bare
    return len(bare)


def parts_at(previous: list[int], prompt: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(previous, prompt, strict=False)) if a != b), len(previous))


async def next_turn(
    system: AgentSystem, model_dir: Path, messages: list[dict[str, Any]], previous: list[int], tier: str
) -> tuple[list[int], str]:
    """The conversation's next turn, which parts inside the previous prompt's generation prompt and
    resumes at its start, or (turn 2: at a new agent's last full block) between it and the parting."""
    start = generation_prompt_start(model_dir, messages[:-2], previous)
    prompt, reply, started = await exact_turn(system, model_dir, messages)
    parted = parts_at(previous, prompt)
    assert start < parted < len(previous) - 1, "the template must rewrite the previous prompt's tail"
    assert started.cache_tier == tier
    assert start <= started.num_cached_tokens <= parted, (start, started.num_cached_tokens, parted)
    return prompt, reply


@pytest.mark.asyncio
async def test_a_prompt_parting_inside_the_last_generation_prompt_resumes_at_its_start(
    model_dir: Path, tmp_path: Path
) -> None:
    """Turn 2 may resume from the point a new agent keeps at its prompt's last full block; turn 3 (a
    returning agent's) and turn 4 (after a restart) have only the agent's own points."""
    cache_dir = tmp_path / "cache"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where does the Nile begin?"},
    ]
    async with AgentSystem(system_config(model_dir, cache_dir)) as system:
        prompt, reply, started = await exact_turn(system, model_dir, messages)
        assert started.num_cached_tokens == 0
        for question in ("And the Amazon?", "Which is longer?"):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
            prompt, reply = await next_turn(system, model_dir, messages, prompt, "memory")
    async with AgentSystem(system_config(model_dir, cache_dir)) as system:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Name a bridge."}]
        await next_turn(system, model_dir, messages, prompt, "disk")
