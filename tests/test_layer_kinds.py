"""Sliding-window and recurrent layers resume where a turn can, token-exactly against mlx-lm.

A sliding-window model (Gemma 3 style) resumes at any token whose window its blocks still hold: a
reply that does not re-tokenize the same costs only the tokens after the divergence, in memory and
after a restart. A hybrid (Qwen3-Next style: Gated DeltaNet beside attention) cannot cut its
recurrent state back, so it resumes where a state was kept: where its turns' prompts ended (but for
their last token, which a re-rendered reply may tokenize together with the reply's first) and where
its replies ended, and where a system prompt other agents share ends.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load, stream_generate

from semantic.actors.engine_client import EngineConfig
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import InspectPool
from semantic.engine.loop.messages import PromptStarted, TokenDelta
from semantic.storage.agent_id import AgentId
from tests.tiny_models import TINY_CONFIGS, build_tiny_model

BLOCK = 16
NUM_TOKENS = 12
SYSTEM_PROMPT = "You are a careful assistant who answers questions about rivers, boats and bridges. " * 4

Model = tuple[str, Path, Any, Any]


@pytest.fixture(scope="module", params=["gemma3", "qwen3_next"])
def model(
    request: pytest.FixtureRequest, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Model:
    model_dir = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)
    reference_model, tokenizer = load(str(model_dir))
    return request.param, model_dir, reference_model, tokenizer


def system_config(model_dir: Path, cache_dir: Path) -> SystemConfig:
    engine = EngineConfig(model=str(model_dir), cache_budget_mb=64, block_size=BLOCK)
    return SystemConfig(engine=engine, cache_dir=cache_dir)


def reference(model: Model, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy reply, in this thread (the engine thread's attention hooks are not here)."""
    _, _, reference_model, tokenizer = model
    steps = stream_generate(reference_model, tokenizer, prompt, max_tokens=NUM_TOKENS)
    return [step.token for step in steps if step.token not in tokenizer.eos_token_ids]


async def turn(
    system: AgentSystem,
    agent: str | None,
    prompt: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
) -> tuple[list[int], list[int], PromptStarted]:
    """One turn (of an anonymous request where `agent` is None): its prompt's token ids, its reply's,
    and how much of the prompt was cached."""
    sampling = SamplingParams(max_tokens=NUM_TOKENS)
    agent_id = AgentId(agent) if agent is not None else None
    request = TurnRequest(uuid.uuid4().hex, agent_id, messages or [], sampling, prompt_token_ids=prompt)
    started = await system.start_turn(request)
    reply: list[int] = []
    prompt_started = None
    async for event in started.stream:
        if isinstance(event, PromptStarted):
            prompt_started = event
        elif isinstance(event, TokenDelta):
            reply.extend(event.token_ids)
    assert prompt_started is not None
    return list(started.prompt.token_ids), reply, prompt_started


def user_turn(model: Model, text: str) -> list[int]:
    tokenizer = model[3]
    return list(
        tokenizer.encode(
            f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
    )


async def exact_turn(
    system: AgentSystem, model: Model, agent: str | None, prompt: list[int]
) -> tuple[list[int], PromptStarted]:
    _, reply, started = await turn(system, agent, prompt)
    expected = reference(model, prompt)
    assert [t for t in reply if t not in model[3].eos_token_ids] == expected
    assert len(set(expected)) > 3, "the random model's reply collapsed: the oracle would be vacuous"
    return reply, started


def diverging(model: Model, prompt: list[int], reply: list[int], text: str) -> tuple[list[int], int]:
    """The next prompt as a template that rewrites the reply's last tokens makes it, and where it
    diverges from the agent's history."""
    kept = len(prompt) + len(reply) - 3
    return (prompt + reply)[:kept] + user_turn(model, text), kept


@pytest.mark.asyncio
async def test_a_reply_that_does_not_round_trip_resumes_where_the_prompt_diverges(
    model: Model, tmp_path: Path
) -> None:
    kind, model_dir, _, tokenizer = model
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Where does the Nile begin?"},
    ]
    first = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    async with AgentSystem(system_config(model_dir, tmp_path)) as system:
        first_reply, _ = await exact_turn(system, model, "agent", first)
        second = first + first_reply + user_turn(model, "And the Amazon?")
        reply, started = await exact_turn(system, model, "agent", second)
        assert (started.cache_tier, started.num_cached_tokens) == ("memory", len(first) + len(first_reply))
        third, diverges_at = diverging(model, second, reply, "Which is longer?")
        reply, started = await exact_turn(system, model, "agent", third)
        # A sliding window resumes at the divergence; a recurrent state where the prompt ended (but for
        # its last token).
        expected = diverges_at if kind == "gemma3" else len(second) - 1
        assert (started.cache_tier, started.num_cached_tokens) == ("memory", expected)
    async with AgentSystem(system_config(model_dir, tmp_path)) as system:
        fourth, diverges_at = diverging(model, third, reply, "Name a bridge over one.")
        _, started = await exact_turn(system, model, "agent", fourth)
        expected = diverges_at if kind == "gemma3" else len(third) - 1
        assert (started.cache_tier, started.num_cached_tokens) == ("disk", expected)


@pytest.mark.asyncio
async def test_an_anonymous_conversation_resumes_though_its_reply_does_not_round_trip(
    model: Model, tmp_path: Path
) -> None:
    """A client of the chat APIs without an agent id sends the whole conversation back, its last
    reply re-rendered: the turn still finds the cache it continues."""
    kind, model_dir, _, tokenizer = model
    messages = [{"role": "user", "content": "Where does the Nile begin?"}]
    first = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    async with AgentSystem(system_config(model_dir, tmp_path)) as system:
        reply, _ = await exact_turn(system, model, None, first)
        second, diverges_at = diverging(model, first, reply, "And the Amazon?")
        _, started = await exact_turn(system, model, None, second)
        # A recurrent state before the first prompt's last token; a sliding model's own cache at the
        # divergence (its windows there are those its reply ended with).
        expected = len(first) - 1 if kind == "qwen3_next" else diverges_at
        assert (started.cache_tier, started.num_cached_tokens) == ("memory", expected)


@pytest.mark.asyncio
async def test_a_second_agent_resumes_at_the_end_of_a_shared_system_prompt(
    model: Model, tmp_path: Path
) -> None:
    _, model_dir, _, tokenizer = model
    head = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}], tokenize=False)
    head_tokens = len(tokenizer.encode(head, add_special_tokens=False))
    async with AgentSystem(system_config(model_dir, tmp_path)) as system:
        for index, (agent, question) in enumerate(
            [("first", "Where does the Nile begin?"), ("second", "How do locks work?")]
        ):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
            prompt, reply, started = await turn(system, agent, messages=messages)
            assert [t for t in reply if t not in tokenizer.eos_token_ids] == reference(model, prompt)
            if index:
                # Its blocks and, for a hybrid, the recurrent state kept where the system prompt ends.
                assert started.num_cached_tokens >= head_tokens // BLOCK * BLOCK > 0
            else:
                assert started.num_cached_tokens == 0
        report = await system.engine.ask(InspectPool())
        assert report.num_shared_states >= 1


@pytest.mark.asyncio
async def test_an_agent_keeps_sliding_layers_only_near_where_its_next_turn_resumes(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Blocks hold every attention layer, but a sliding layer's blocks behind the window before the
    last prompt's end are given back: an agent's window charge stays bounded however long it talks."""
    model_dir = build_tiny_model("gemma3", tmp_path / "gemma3", default_model_dir)
    window = TINY_CONFIGS["gemma3"]["sliding_window"]
    reference_model, tokenizer = load(str(model_dir))
    model: Model = ("gemma3", model_dir, reference_model, tokenizer)
    async with AgentSystem(system_config(model_dir, tmp_path / "cache")) as system:
        prompt = list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "Tell me about boats."}], add_generation_prompt=True
            )
        )
        for index in range(6):
            reply, _ = await exact_turn(system, model, "talker", prompt)
            history = prompt + reply
            report = await system.engine.ask(InspectPool())
            blocks = report.agent_id_to_block_ids["talker"]
            windowed = [b for b in blocks if b in report.window_block_ids]
            # The window before the prompt's end, through the reply, and the one before the first
            # prompt's last full block (kept for a new agent that repeats it): never the whole history.
            assert len(windowed) <= (window + NUM_TOKENS) // BLOCK + 2 + window // BLOCK
            prompt = history + user_turn(model, f"Tell me more, part {index}.")
        assert len(blocks) > (window + NUM_TOKENS) // BLOCK + 2
