"""A prompt's last token prefilled with its last chunk (mlx_adapter/last_token_fold.py), on the real model
stepped by hand: the same tokens as mlx-lm's own loop, one step sooner, cold and returning; and the
head split refused where it would change the logits (tiny random-weight models from mlx-lm)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from semantic.engine.loop.messages import Event, Finished, PromptStarted, TokenDelta
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.mlx_adapter.last_token_fold import (
    FoldingBatchGenerator,
    fold_head,
    forked_sources_match,
    last_position_head,
    make_batch_generator,
)
from tests.batch_driver import chat, loop, outbox, served, steps_until_finished

__all__ = ["loop", "outbox", "served"]  # fixtures

pytestmark = pytest.mark.skipif(
    not forked_sources_match(), reason="the installed mlx-lm is not the one `_next` was forked from"
)


@pytest.fixture(params=["folded", "mlx-lm's own"])
def generator_kind(served: ServedModel, request: pytest.FixtureRequest) -> Iterator[str]:
    """The batch with a folding generator, or with mlx-lm's own; the folding one is put back after."""
    batch = served.batch
    head = batch._generators.head
    assert head is not None  # SmolLM2 is `model.model` then the tied embedding
    if request.param != "folded":
        batch._generators.head = None
        batch._generator = batch._generators()
    assert isinstance(batch._generator, FoldingBatchGenerator) == (request.param == "folded")
    yield request.param
    batch._generators.head = head
    batch._generator = batch._generators()


def first_token_step(per_step: list[list[Event]]) -> int:
    return next(i for i, events in enumerate(per_step) if any(isinstance(e, TokenDelta) for e in events))


def tokens_of(per_step: list[list[Event]]) -> list[int]:
    return [t for events in per_step for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


def run_turn(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, prompt: list[int], agent: str
):
    per_step = steps_until_finished(served, outbox, loop, prompt, 6, agent)
    started = next(e for events in per_step for e in events if isinstance(e, PromptStarted))
    finished = next(e for events in per_step for e in events if isinstance(e, Finished))
    return per_step, started, finished


def test_cold_and_returning_turns_give_mlx_lm_s_tokens_folded_one_step_sooner(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, generator_kind: str
) -> None:
    agent = f"agent-{uuid.uuid4().hex}"
    first = chat(served, f"{uuid.uuid4().hex} Name three rivers in Europe.")
    per_step, started, finished = run_turn(served, outbox, loop, first, agent)
    assert started.num_cached_tokens == 0
    assert first_token_step(per_step) == (0 if generator_kind == "folded" else 1)
    eos = served.loaded.eos_token_ids
    assert [t for t in tokens_of(per_step) if t not in eos] == served.reference_generate(first, 6)

    tokenizer = served.loaded.tokenizer
    follow_up = tokenizer.encode("<|im_start|>user\nAnd three in Asia?<|im_end|>\n<|im_start|>assistant\n")
    returning = [*first, *finished.generated_token_ids, *follow_up]
    per_step, started, _ = run_turn(served, outbox, loop, returning, agent)
    assert started.num_cached_tokens > len(first) // 2  # its history came from the cache
    assert first_token_step(per_step) == (0 if generator_kind == "folded" else 1)
    assert [t for t in tokens_of(per_step) if t not in eos] == served.reference_generate(returning, 6)


def tiny_args(tied: bool) -> llama.ModelArgs:
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


class ScaledLogits(llama.Model):
    """A model whose logits are not its head's output (as with a logit scale or a soft cap)."""

    def __call__(self, inputs: mx.array, cache: object = None, input_embeddings: object = None) -> mx.array:
        return 2.0 * super().__call__(inputs, cache=cache)


def test_the_head_is_split_off_only_where_the_split_gives_the_model_s_own_logits() -> None:
    assert last_position_head(llama.Model(tiny_args(tied=True))) is not None
    assert last_position_head(llama.Model(tiny_args(tied=False))) is not None
    assert last_position_head(ScaledLogits(tiny_args(tied=True))) is None


def test_a_model_that_cannot_be_split_gets_mlx_lm_s_own_generator() -> None:
    model = ScaledLogits(tiny_args(tied=True))
    generator = make_batch_generator(model, fold_head(model, foldable=True))
    try:
        assert type(generator) is BatchGenerator
    finally:
        generator.close()
    plain = llama.Model(tiny_args(tied=True))
    assert fold_head(plain, foldable=False) is None  # a model split over a group is never folded
