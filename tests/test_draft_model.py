"""Drafts from a draft model (`--speculate <model>`): each sequence's drafter keeps the draft model's
cache of its history across steps where the batch keeps some drafts and rejects the rest, and its
drafts stay the draft model's greedy continuation of the whole history, as computed from nothing.
A draft model whose tokenizer or cache does not fit the main model is refused at load."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama

from semantic.engine.mlx_adapter.api import load
from semantic.engine.speculation import model_drafts
from semantic.engine.speculation.model_drafts import ModelDrafter, check_draft_model
from tests.tiny_models import build_tiny_model

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_llama() -> llama.Model:
    mx.random.seed(7)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    # Larger weights than the initializer's: logits far apart, so no near-tie reads as a bug.
    model.update(tree_map(lambda weights: weights * 4.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def _greedy_from_nothing(model: llama.Model, tokens: list[int], k: int, num_token_ids: int) -> list[int]:
    """The oracle: the model's greedy continuation, each token from a pass over the whole sequence."""
    sequence, drafts = list(tokens), []
    while len(drafts) < k:
        token = int(mx.argmax(model(mx.array([sequence]))[0, -1]).item())
        if token >= num_token_ids:
            break
        drafts.append(token)
        sequence.append(token)
    return drafts


@pytest.mark.parametrize("num_token_ids", [VOCAB, VOCAB * 2 // 3])
def test_drafts_are_the_greedy_continuation_across_kept_and_rejected_drafts(
    tiny_llama: llama.Model, num_token_ids: int
) -> None:
    rng = random.Random(num_token_ids)
    history = [rng.randrange(VOCAB) for _ in range(40)]
    drafter = ModelDrafter(tiny_llama, history, num_token_ids)
    num_drafted = num_rejected = 0
    for _ in range(25):
        guess = drafter.guess_next()
        expected = _greedy_from_nothing(tiny_llama, history, 1, num_token_ids)
        assert guess == (expected[0] if expected else None)
        # The token the batch computed: the guess, as a greedy copy of the draft model would, or not.
        pending = guess if guess is not None and rng.random() < 0.5 else rng.randrange(num_token_ids)
        k = rng.randrange(1, 7)
        drafts = drafter.propose(pending, k)
        assert drafts == _greedy_from_nothing(tiny_llama, [*history, pending], k, num_token_ids)
        # The batch keeps a leading part of the drafts; the token after them is its own (often not
        # the next draft: then the drafter must take back what it drafted past it).
        num_kept = rng.randrange(len(drafts) + 1)
        fed = [pending, *drafts[:num_kept]]
        drafter.extend(fed)
        history.extend(fed)
        num_drafted += len(drafts)
        num_rejected += len(drafts) - num_kept
    assert num_drafted > 30 and num_rejected > 10, "the test took back too little to check anything"


def test_a_long_history_is_caught_up_a_chunk_per_step(
    tiny_llama: llama.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_drafts, "CATCH_UP_TOKENS", 16)
    rng = random.Random(3)
    history = [rng.randrange(VOCAB) for _ in range(50)]
    drafter = ModelDrafter(tiny_llama, history, VOCAB)
    # 51 tokens to feed (the history and the pending token): three steps of 16 without drafts.
    assert [drafter.propose(5, 4) for _ in range(3)] == [[], [], []]
    assert drafter.guess_next() == _greedy_from_nothing(tiny_llama, history, 1, VOCAB)[0]
    assert drafter.propose(5, 4) == _greedy_from_nothing(tiny_llama, [*history, 5], 4, VOCAB)


def test_a_draft_model_with_another_tokenizer_is_refused(default_model_dir: Path, tmp_path: Path) -> None:
    _, main_tokenizer = load(str(default_model_dir))  # type: ignore[misc]
    other = build_tiny_model("llama", tmp_path / "other", default_model_dir)
    tokenizer_json = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    first, second = "hello", "world"  # the same tokens under each other's ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    model, tokenizer = load(str(other))  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"has another tokenizer .* 4 entries differ"):
        check_draft_model(model, tokenizer, main_tokenizer, str(other))


def test_a_draft_model_that_cannot_take_back_drafts_is_refused(
    default_model_dir: Path, tmp_path: Path
) -> None:
    _, main_tokenizer = load(str(default_model_dir))  # type: ignore[misc]
    hybrid = build_tiny_model("qwen3_next", tmp_path / "hybrid", default_model_dir)
    model, tokenizer = load(str(hybrid))  # type: ignore[misc]
    with pytest.raises(ValueError, match="ArraysCache layers, which cannot take back rejected drafts"):
        check_draft_model(model, tokenizer, main_tokenizer, str(hybrid))
    same = build_tiny_model("llama", tmp_path / "same", default_model_dir)
    model, tokenizer = load(str(same))  # type: ignore[misc]
    check_draft_model(model, tokenizer, main_tokenizer, str(same))  # the same tokenizer, full attention
