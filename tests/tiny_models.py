"""Tiny random-weight models built from mlx-lm's own model classes, for architecture coverage."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Gemma-3 style: every other layer is a 32-token sliding window.
    "gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "vocab_size": 49152,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
    },
    # Llama, like the default model, with head counts that 2 and 3 ranks divide (tensor parallel).
    "llama": {
        "model_type": "llama",
        "hidden_size": 96,
        "num_hidden_layers": 3,
        "intermediate_size": 192,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # tied, its greedy replies repeat one token
    },
    # Qwen3-Next style hybrid: Gated DeltaNet (recurrent) layers beside full attention, MoE.
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 64,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
}


def build_tiny_model(kind: str, dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write an MLX model directory with random weights and the default model's tokenizer."""
    return write_random_model(dict(TINY_CONFIGS[kind]), dest, tokenizer_dir, seed)


def write_random_model(config: dict[str, Any], dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write an MLX model directory of `config`'s architecture with random weights and the tokenizer
    from `tokenizer_dir`."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger embeddings make greedy choices decisive, so oracles do not hinge on ties.
    weights = {
        name: value * 4 if "embed" in name else value for name, value in tree_flatten(model.parameters())
    }
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, dest / name)
    return dest
