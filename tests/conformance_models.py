"""Model directories for the conformance suite: random weights of an `ArchSpec`'s architecture, quantized
with mlx-lm's own quantization where the spec says, and what kinds of layers the model has."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import quantize_model

from tests.arch_spec import ArchSpec, Quantization

MAX_CONV_WIDTH = 8  # the tiny configs' recurrent states are 16 wide on every axis
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_model(spec: ArchSpec) -> tuple[nn.Module, dict[str, Any]]:
    """The spec's model with random weights (quantized if it says so) and the config that loads it."""
    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    mx.random.seed(spec.seed)
    model = module.Model(module.ModelArgs.from_dict(dict(spec.config)))
    # Larger embeddings make greedy choices decisive, so the oracle does not hinge on near ties
    # (`wte`: gpt2's token embeddings).
    scaled = [
        (name, value * spec.embed_scale if "embed" in name or "wte" in name else value)
        for name, value in parameters(model)
    ]
    model.update(tree_unflatten(scaled))
    config = dict(spec.config)
    if spec.quantization is not None:
        model, config = quantize(model, config, spec.quantization)
    mx.eval(model.parameters())
    return model, config


def parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    return cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))


def quantize(
    model: nn.Module, config: dict[str, Any], quantization: Quantization
) -> tuple[nn.Module, dict[str, Any]]:
    own_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if quantization.experts is not None and isinstance(module, SwitchLinear):
            mode, bits, group_size = quantization.experts
            return {"mode": mode, "bits": bits, "group_size": group_size}
        return own_predicate(path, module) if own_predicate is not None else True

    return quantize_model(
        model,
        config,
        quantization.group_size,
        quantization.bits,
        mode=quantization.mode,
        quant_predicate=predicate,
    )


def save_model_dir(model: nn.Module, config: dict[str, Any], dest: Path, tokenizer_dir: Path) -> Path:
    """An MLX model directory of `model` (as `build_model` made it), with `tokenizer_dir`'s tokenizer."""
    dest.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def layer_kinds(model: nn.Module, config: dict[str, Any]) -> list[str]:
    """What the model holds, from the caches mlx-lm makes for it and its modules: full, sliding (with
    its windows), conv (a short convolution's last inputs), recurrent (any other state: an SSM's, a
    linear attention's), MLA, sink, MoE, quantized; any other cache type by its class name."""
    caches = make_prompt_cache(model)
    # A forward pass fills the state arrays, whose shapes tell conv from recurrent.
    model(mx.array([[1, 2, 3, 4]]), cache=caches)
    flat = [
        inner for cache in caches for inner in (cache.caches if isinstance(cache, CacheList) else [cache])
    ]
    kinds = ["full"] if any(type(cache) is KVCache for cache in flat) else []
    windows = sorted({cache.max_size for cache in flat if isinstance(cache, RotatingKVCache)})
    if windows:
        kinds.append("sliding " + "/".join(str(window) for window in windows))
    arrays_caches: list[Any] = [cache for cache in flat if isinstance(cache, ArraysCache)]
    states = [state for cache in arrays_caches for state in cache.cache if state is not None]
    is_conv = [is_conv_state(state) for state in states]
    kinds += (["conv"] if any(is_conv) else []) + (["recurrent"] if not all(is_conv) else [])
    named = (KVCache, RotatingKVCache)  # exactly: a subclass (ChunkedKVCache) is another kind
    others = {type(c).__name__ for c in flat if type(c) not in named and not isinstance(c, ArraysCache)}
    kinds += sorted(others)
    if "kv_lora_rank" in config.get("text_config", config):
        kinds.append("MLA")
    if any("sink" in name.rsplit(".", 1)[-1] for name, _ in parameters(model)):
        kinds.append("sink")
    if any("Switch" in type(module).__name__ for module in model.modules()):
        kinds.append("MoE")
    if "quantization" in config:
        kinds.append("quantized")
    return kinds


def is_conv_state(state: mx.array) -> bool:
    """A short convolution's last few inputs along the sequence axis (axis 1, or 2 behind heads)."""
    return (state.ndim == 3 and state.shape[1] < MAX_CONV_WIDTH) or (
        state.ndim == 4 and state.shape[2] < MAX_CONV_WIDTH
    )
