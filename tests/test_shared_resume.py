"""A second agent whose first prompt repeats another agent's, with no system message to share, reuses
every full block a full-attention model reuses, whatever its layers: sliding windows and recurrent
states are kept at the last full block boundary of each new agent's prompt, shared under that
block's hash. Token-exact against mlx-lm.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest
from semantic.engine.cache_store import agent_cache
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool
from semantic.engine.loop.messages import PromptStarted, TokenDelta
from semantic.storage.agent_id import AgentId
from tests.agent_api_client import _loaded, cold_continuation
from tests.arch_configs import ARCHITECTURES
from tests.conformance_models import build_model, save_model_dir

BLOCK = 16
NUM_TOKENS = 12
QUESTION = "Tell me about the rivers, boats and bridges of an old town, one by one and in order. " * 6


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "lfm2"])
def model_dir(
    request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    model, config = build_model(ARCHITECTURES[request.param])
    return save_model_dir(model, config, tmp_path_factory.mktemp(request.param), default_model_dir)


async def exact_turn(system: AgentSystem, model_dir: Path, agent: str, prompt: list[int]) -> PromptStarted:
    """One turn of `prompt`, its reply checked token for token against mlx-lm's own generation."""
    sampling = SamplingParams(max_tokens=NUM_TOKENS)
    request = TurnRequest(uuid.uuid4().hex, AgentId(agent), [], sampling, prompt_token_ids=prompt)
    started = await system.start_turn(request)
    reply: list[int] = []
    prompt_started = None
    async for event in started.stream:
        if isinstance(event, PromptStarted):
            prompt_started = event
        elif isinstance(event, TokenDelta):
            reply.extend(event.token_ids)
    assert prompt_started is not None
    eos = _loaded(model_dir)[1].eos_token_ids
    assert [t for t in reply if t not in eos] == cold_continuation(model_dir, prompt, NUM_TOKENS)
    return prompt_started


@pytest.mark.asyncio
async def test_a_new_agent_repeating_another_agents_prompt_reuses_every_full_block(
    model_dir: Path, tmp_path: Path
) -> None:
    """Agent A's user-only prompt of several blocks, then agent B's first turn with the same prompt:
    B starts from the last full block boundary before the prompt's last token, which is every block a
    full-attention model reuses (the llama case checks that figure)."""
    engine = EngineConfig(model=str(model_dir), cache_budget_mb=64, block_size=BLOCK)
    async with AgentSystem(SystemConfig(engine=engine, cache_dir=tmp_path / "cache")) as system:
        tokenizer = _loaded(model_dir)[1]
        messages = [{"role": "user", "content": QUESTION}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert len(prompt) > 4 * 32, "the prompt must run past a sliding window several times"
        full_blocks = (len(prompt) - 1) // BLOCK * BLOCK
        first = await exact_turn(system, model_dir, "first", prompt)
        assert first.num_cached_tokens == 0
        second = await exact_turn(system, model_dir, "second", prompt)
        assert second.cache_tier == "memory"
        assert second.num_cached_tokens >= full_blocks, (second.num_cached_tokens, full_blocks)
        if model_dir.name.startswith("llama"):
            assert second.num_cached_tokens == full_blocks


@pytest.mark.asyncio
async def test_shared_points_are_bounded_and_those_resumed_from_are_dropped_last(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every new agent's prompt keeps a point; past MAX_SHARED_STATES the one least recently kept or
    resumed from goes: a prompt another agent repeated outlasts one kept before it was repeated."""
    monkeypatch.setattr(agent_cache, "MAX_SHARED_STATES", 2)
    model, config = build_model(ARCHITECTURES["lfm2"])
    model_dir = save_model_dir(model, config, tmp_path / "lfm2", default_model_dir)
    engine = EngineConfig(model=str(model_dir), cache_budget_mb=64, block_size=BLOCK)
    tokenizer = _loaded(model_dir)[1]
    # Raw text, no template: the template's default system prompt would be a block all three share.
    prompts = [
        list(tokenizer.encode(f"{topic} {QUESTION}", add_special_tokens=False))
        for topic in ("Rivers first.", "Bridges first.", "Boats first.")
    ]
    async with AgentSystem(SystemConfig(engine=engine, cache_dir=tmp_path / "cache")) as system:
        for agent, prompt in (("a", prompts[0]), ("b", prompts[1]), ("c", prompts[0]), ("d", prompts[2])):
            await exact_turn(system, model_dir, agent, prompt)
        assert (await system.engine.ask(InspectPool())).num_shared_states == 2
        repeated = await exact_turn(system, model_dir, "e", prompts[0])  # resumed from by "c"
        assert repeated.num_cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
        dropped = await exact_turn(system, model_dir, "f", prompts[1])
        assert dropped.num_cached_tokens == 0
