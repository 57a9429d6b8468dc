"""LoRA on a llama-family model's top layers, fast enough for a 2-core CPU.

Claude Code's requests run to ~2,000 tokens and a plain LoRA step over one took ~30 s here, almost
all of it the forward pass through frozen layers and MLX's scalar CPU softmax. So:

- LoRA (mlx-lm's `linear_to_lora_layers`) goes on the top `trained` layers only. The layers below
  are frozen, so their output for each example is computed once, not on every step, and examples
  that open with the same tokens (every request of one Claude Code agent does) share that work
  through a KV cache: the common head runs once, each example only its own tail.
- Attention in the trained layers uses `engine/cpu_exp`'s polynomial softmax, wrapped in a
  `mx.custom_function` with the softmax's own gradient.
- The loss is on the reply tokens only, so only their positions go through the output head.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models.cache import KVCache
from mlx_lm.tuner.utils import linear_to_lora_layers

from semantic.engine.cpu import cpu_exp
from semantic.engine.mlx_adapter import model_hooks

Example = tuple[list[int], int]  # token ids of prompt plus reply, where the reply starts


@mx.custom_function
def _softmax(scores: mx.array) -> mx.array:
    return cpu_exp.softmax(scores)


@_softmax.vjp
def _softmax_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
    return output * (cotangent - (cotangent * output).sum(axis=-1, keepdims=True))


def _causal_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """mlx's "causal" attention (bottom-right aligned when keys run ahead of queries), our softmax."""
    batch, heads, length, dims = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    queries = (queries * scale).reshape(batch, kv_heads, repeats, length, dims)
    scores = mx.matmul(queries, mx.expand_dims(keys, 2).swapaxes(-1, -2))
    causal = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
    weights = cast(mx.array, _softmax(mx.where(causal, scores, mx.finfo(scores.dtype).min)))
    return mx.matmul(weights, mx.expand_dims(values, 2)).reshape(batch, heads, length, dims)


def _training_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> mx.array:
    assert mask in ("causal", None) and sinks is None, "training runs causal sequences"
    return _causal_attention(queries, keys, values, scale)


def _shared_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def frozen_states(model: nn.Module, examples: list[Example], first_trained: int) -> list[mx.array]:
    """Each example's hidden states entering layer `first_trained`, computed once. Examples go in
    token order, so each shares the longest head with the one before: its cache is cut back to the
    shared head and only the rest is run."""
    layers = model.model.layers[:first_trained]
    model_hooks.install_kernel_hooks()
    caches = [KVCache() for _ in layers]
    states: dict[int, mx.array] = {}
    previous_tokens: list[int] = []
    previous_state = mx.zeros((1, 0, model.args.hidden_size))
    with model_hooks.cpu_kernels_on_this_thread():
        for index in sorted(range(len(examples)), key=lambda i: examples[i][0]):
            tokens = examples[index][0]
            shared = min(_shared_length(previous_tokens, tokens), len(tokens) - 1)
            for cache in caches:
                cache.offset = min(cache.offset, shared)
            tail = _run(layers, model.model.embed_tokens(mx.array([tokens[shared:]])), caches)
            states[index] = mx.concatenate([previous_state[:, :shared], tail], axis=1)
            mx.eval(states[index])
            previous_tokens, previous_state = tokens, states[index]
    return [states[index] for index in range(len(examples))]


def _run(layers: list[nn.Module], hidden: mx.array, caches: list[KVCache]) -> mx.array:
    mask = "causal" if hidden.shape[1] > 1 else None
    for layer, cache in zip(layers, caches, strict=True):
        hidden = layer(hidden, mask, cache=cache)
    return hidden


def _reply_loss(
    model: nn.Module, state: mx.array, targets: mx.array, offset: int, first_trained: int
) -> mx.array:
    """Cross-entropy of the reply. The prompt runs through the trained layers with the adapter but
    without a gradient (its keys and values are constants to the reply), so the backward pass costs
    the reply's length, not the prompt's."""
    layers = model.model.layers[first_trained:]
    caches = [KVCache() for _ in layers]
    _run(layers, state[:, : offset - 1], caches)
    for cache in caches:
        assert cache.keys is not None and cache.values is not None
        cache.keys, cache.values = mx.stop_gradient(cache.keys), mx.stop_gradient(cache.values)
    hidden = model.model.norm(_run(layers, state[:, offset - 1 : -1], caches))
    logits = (
        model.model.embed_tokens.as_linear(hidden)
        if model.args.tie_word_embeddings
        else model.lm_head(hidden)
    )
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def train_top_layers(
    model: nn.Module,
    examples: list[Example],
    trained: int,
    lora_parameters: dict[str, float],
    steps: int,
    learning_rate: float,
    seed: int,
) -> None:
    """Put a LoRA (mlx-lm's, `lora_parameters` as its config has them: rank, scale, dropout) on the
    top `trained` layers of `model` and train it on the examples' replies."""
    first_trained = len(model.model.layers) - trained
    started = time.monotonic()
    states = frozen_states(model, examples, first_trained)
    print(
        f"frozen layers done for {len(examples)} examples in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    model.freeze()
    linear_to_lora_layers(model, trained, lora_parameters)
    attention_modules = {type(layer.self_attn).__module__ for layer in model.model.layers}
    saved = {name: sys.modules[name].scaled_dot_product_attention for name in attention_modules}
    for name in attention_modules:
        sys.modules[name].scaled_dot_product_attention = _training_attention  # type: ignore[attr-defined]
    optimizer = optim.Adam(learning_rate=learning_rate)
    loss_and_grad = nn.value_and_grad(model, _reply_loss)
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    try:
        for step in range(1, steps + 1):
            if not order:
                order = rng.sample(range(len(examples)), len(examples))
            index = order.pop()
            tokens, offset = examples[index]
            targets = mx.array([tokens[offset:]])
            loss, grads = loss_and_grad(model, states[index], targets, offset, first_trained)
            optimizer.update(model, grads)
            mx.eval(loss, model.trainable_parameters(), optimizer.state)
            losses.append(loss.item())
            if step % 10 == 0:
                elapsed = time.monotonic() - started
                print(
                    f"step {step}/{steps}: loss {sum(losses[-10:]) / 10:.3f} ({elapsed:.0f} s)",
                    file=sys.stderr,
                )
    finally:
        for name, function in saved.items():
            sys.modules[name].scaled_dot_product_attention = function  # type: ignore[attr-defined]
