"""The batch ends every sequence itself, and keeps its cache exactly as the model computed it.

The generator is given no stop tokens and a token limit past the request's, so every end (a stop
token, the limit, a stop string) goes through the batch, which reads the sequence's cache as views
into the batch's arrays. Driven step by step on the real model.
"""

from __future__ import annotations

import asyncio
import uuid

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from semantic.engine.loop.messages import Finished, FinishReason, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.mlx_adapter import generator_seams
from tests.batch_driver import chat, loop, outbox, served, steps_until_finished

__all__ = ["loop", "outbox", "served"]  # fixtures


def finished_of(per_step: list[list[object]]) -> Finished:
    (finished,) = [e for events in per_step for e in events if isinstance(e, Finished)]
    return finished


def assert_kept_cache_is_the_models(served: ServedModel, agent_id: str, expected_tokens: list[int]) -> None:
    """The agent's kept tokens are `expected_tokens` and its keys and values equal a fresh prefill's."""
    agent = served.store.agents[agent_id]
    assert agent.token_ids == expected_tokens
    prepared = served.store.prepare(agent_id, [*expected_tokens, 0])
    assert prepared.num_cached_tokens == len(expected_tokens)
    fresh = make_prompt_cache(served.loaded.model)
    served.loaded.model(mx.array([expected_tokens]), cache=fresh)
    for layer in served.loaded.spec.full_layer_ids:
        kept_keys, kept_values = prepared.caches[layer].state[:2]
        fresh_keys, fresh_values = fresh[layer].state[:2]
        n = len(expected_tokens)
        assert mx.allclose(kept_keys[..., :n, :], fresh_keys[..., :n, :], rtol=1e-3, atol=1e-3).item()
        assert mx.allclose(kept_values[..., :n, :], fresh_values[..., :n, :], rtol=1e-3, atol=1e-3).item()


def test_a_reply_that_reaches_its_limit_ends_with_exactly_that_many_tokens(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    agent_id = f"limit-{uuid.uuid4().hex}"
    prompt = chat(served, "Count from one to fifty, separated by commas.")
    finished = finished_of(steps_until_finished(served, outbox, loop, prompt, 7, agent_id))
    assert finished.reason is FinishReason.LENGTH
    assert len(finished.generated_token_ids) == 7
    assert generator_seams.num_generating(served.batch._generator) == 0  # taken out of the generator
    # The generator returns a token in the step that feeds it to the model: the cache holds all seven.
    assert_kept_cache_is_the_models(served, agent_id, [*prompt, *finished.generated_token_ids])


def test_a_reply_that_samples_a_stop_token_ends_there(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    agent_id = f"eos-{uuid.uuid4().hex}"
    prompt = chat(served, "What is the capital of France? Answer in one short sentence.")
    per_step = steps_until_finished(served, outbox, loop, prompt, 60, agent_id)
    finished = finished_of(per_step)
    assert finished.reason is FinishReason.STOP
    assert finished.generated_token_ids[-1] in served.loaded.eos_token_ids
    assert len(finished.generated_token_ids) < 60
    text = "".join(e.text for events in per_step for e in events if isinstance(e, TokenDelta))
    assert "Paris" in text
    assert_kept_cache_is_the_models(served, agent_id, [*prompt, *finished.generated_token_ids])


def test_a_one_token_reply_keeps_the_prompt_it_ended_on(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop
) -> None:
    agent_id = f"one-{uuid.uuid4().hex}"
    prompt = chat(served, "Say hi.")
    finished = finished_of(steps_until_finished(served, outbox, loop, prompt, 1, agent_id))
    assert finished.reason is FinishReason.LENGTH and len(finished.generated_token_ids) == 1
    # Taken early, the one token ended the reply before the model was fed it.
    assert_kept_cache_is_the_models(served, agent_id, prompt)
