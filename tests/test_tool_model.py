"""How the tool model is made (`scripts/tool_model_training.py`, `scripts/make_tool_model.py`),
checked on a tiny random-weight Llama where it is cheap: the frozen layers' shared-head shortcut is
exact, the LoRA learns the replies, and the adapter saved in mlx-lm's format fuses into a model that
computes what the LoRA model does, with the layers below it untouched."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from tests.tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import make_tool_model
from tool_model_training import Example, frozen_states, train_top_layers

FIRST_TRAINED = 1  # the tiny Llama has 3 layers: the top two are trained


@pytest.fixture(scope="module")
def tiny_llama(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tool-model") / "llama", default_model_dir)


def examples(seed: int) -> list[Example]:
    """Prompts that open with a common head (as one agent's requests do), some sharing more of it,
    each followed by one of two scripted replies (as the recorded sessions' replies are)."""
    rng = random.Random(seed)
    words = [rng.randrange(300, 3000) for _ in range(60)]
    head = [rng.choice(words) for _ in range(48)]
    replies = [[rng.choice(words) for _ in range(6)] for _ in range(2)]
    made = []
    for index in range(6):
        middle = head[: 16 * (index % 3)] + [rng.choice(words) for _ in range(rng.randrange(3, 20))]
        prompt = head + middle
        made.append((prompt + replies[index % 2], len(prompt)))
    return made


def layers_below(model: object, tokens: list[int]) -> mx.array:
    """The hidden states entering the first trained layer, by one plain pass of the whole sequence."""
    hidden = model.model.embed_tokens(mx.array([tokens]))  # type: ignore[attr-defined]
    for layer in model.model.layers[:FIRST_TRAINED]:  # type: ignore[attr-defined]
        hidden = layer(hidden, "causal")
    return hidden


def reply_loss(model: nn.Module, made: list[Example]) -> float:
    """The mean cross-entropy of the replies, each example in one plain pass."""
    total = 0.0
    for tokens, offset in made:
        logits = model(mx.array([tokens]))[0, offset - 1 : -1]
        total += nn.losses.cross_entropy(logits, mx.array(tokens[offset:]), reduction="mean").item()
    return total / len(made)


def test_frozen_states_equal_each_examples_own_pass(tiny_llama: Path) -> None:
    model = load(str(tiny_llama))[0]
    made = examples(seed=1)
    states = frozen_states(model, made, FIRST_TRAINED)
    for (tokens, _), state in zip(made, states, strict=True):
        assert state.shape == (1, len(tokens), model.args.hidden_size)
        assert mx.allclose(state, layers_below(model, tokens), atol=1e-4).item()


def test_a_trained_adapter_fuses_into_the_model_the_lora_computes(tiny_llama: Path, tmp_path: Path) -> None:
    base_weights = dict(tree_flatten(load(str(tiny_llama))[0].parameters()))
    model = load(str(tiny_llama))[0]
    made = examples(seed=2)
    before = reply_loss(model, made)
    mx.random.seed(0)  # the LoRA's initial weights
    trained = len(model.model.layers) - FIRST_TRAINED
    train_top_layers(
        model, made, trained, make_tool_model.LORA_PARAMETERS, steps=100, learning_rate=1e-2, seed=0
    )
    # It learns the replies: from ~11.2 (the random model) to ~8 (7.9-8.8 with other initial weights).
    assert reply_loss(model, made) < before - 1.2

    adapter, out = tmp_path / "adapter", tmp_path / "fused"
    make_tool_model.save_adapter(model, adapter, num_layers=trained)
    make_tool_model.fuse(tiny_llama, adapter, out)
    assert make_tool_model.is_fused_from(out, adapter)

    fused = load(str(out))[0]
    tokens = mx.array([made[0][0]])
    assert mx.allclose(fused(tokens), model(tokens), atol=1e-3).item()
    fused_weights = dict(tree_flatten(fused.parameters()))
    assert fused_weights.keys() == base_weights.keys()
    changed = {name for name in base_weights if not mx.array_equal(fused_weights[name], base_weights[name])}
    assert changed and not any(name.startswith("model.layers.0.") for name in changed), changed
    assert {name.split(".")[2] for name in changed} == {"1", "2"}, changed

    (adapter / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text() + " ")
    assert not make_tool_model.is_fused_from(out, adapter)  # another adapter: built again
