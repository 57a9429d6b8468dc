"""Tiny configs of mlx-lm's model families, for the architecture conformance suite (tests/conformance.py).

Each builds a random-weight model of a few layers (hidden ~64, vocab 49152: every tiny model uses the
default model's SmolLM2 tokenizer). Hybrids have at least one layer of each kind, MoE models a few
experts, sliding windows are shorter than the suite's prompts (32 or 48 tokens against ~170); in
mlx-lm 0.32 each family has one window size, so the sizes differ between families, not within one.
`seed` and `embed_scale` are ones whose greedy replies vary (random models can collapse into one
repeated token; tied embeddings need small ones).

Not covered (of mlx-lm 0.32.2's `models/`, besides its helper modules):
- wrappers around a text model covered here, for vision or audio: `gemma3`, `gemma3n`, `gemma4`,
  `kimi_vl`, `kimi_k25`, `lfm2-vl`, `llama4`, `minimax_m3_vl`, `mistral3`, `pixtral`, `qwen2_vl`,
  `qwen3_vl`, `qwen3_vl_moe`;
- `olmo`: needs the `ai2-olmo` package;
- not shrunk yet (configs with fields mlx-lm's own tests do not show): `afm7`, `bailing_hybrid`,
  `bailing_moe_v3`, `bitnet`, `deepseek_v41`, `gear`, `glm_moe_dsa`, `gptj`, `hunyuan`,
  `iquestloopcoder`, `kimi_k3`, `lille-130m`, `longcat_flash_ngram`, `mellum`, `mistral4`,
  `muse_glimmer`, `muse_spark`, `nanbeige`, `nanochat`, `nemotron-nas`, `openelm`, `phi3small`,
  `phixtral`, `plamo`, `plamo3`, `prism_hadamard_qwen35`, `qwen`, `solar_open`, `spark2_5`, `talkie`.
"""

from __future__ import annotations

from dataclasses import replace

from tests.arch_configs_others import OTHERS
from tests.arch_spec import YARN, ArchSpec, Quantization, dense

# The families issue 64 names: in the default suite.
NAMED: list[ArchSpec] = [
    ArchSpec(
        "llama",
        dense("llama", hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=6),
    ),
    ArchSpec(
        "qwen3_next",
        dense(
            "qwen3_next",
            num_hidden_layers=4,  # full attention every 4th layer: three Gated DeltaNet, one full
            head_dim=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[],
            moe_intermediate_size=64,
            partial_rotary_factor=0.5,
            full_attention_interval=2,
        ),
    ),
    ArchSpec(
        "qwen3_5",
        dense(
            "qwen3_5",
            num_hidden_layers=4,
            head_dim=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            partial_rotary_factor=0.5,
            full_attention_interval=2,
        ),
    ),
    ArchSpec(
        "lfm2",
        dense(
            "lfm2",
            num_hidden_layers=3,
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            layer_types=["conv", "full_attention", "conv"],
        ),
        embed_scale=0.25,  # tied embeddings
    ),
    ArchSpec(
        "nemotron_h",
        dense(
            "nemotron_h",
            num_hidden_layers=4,
            attention_bias=False,
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            mamba_proj_bias=False,
            ssm_state_size=16,
            conv_kernel=4,
            n_groups=2,
            time_step_limit=[0.0, float("inf")],
            mlp_bias=False,
            layer_norm_epsilon=1e-5,
            use_bias=False,
            use_conv_bias=True,
            hybrid_override_pattern=["M", "*", "-", "M"],
        ),
    ),
    ArchSpec(
        "granitemoehybrid",
        dense(
            "granitemoehybrid",
            num_hidden_layers=3,
            attention_bias=False,
            embedding_multiplier=1.0,
            attention_multiplier=0.25,
            logits_scaling=1.0,
            residual_multiplier=1.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
            mamba_n_heads=8,  # times the head size: twice hidden_size, as transformers' config checks
            mamba_d_head=16,
            mamba_proj_bias=False,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_n_groups=1,
            mamba_conv_bias=True,
            layer_types=["mamba", "attention", "mamba"],
        ),
    ),
    ArchSpec(
        "gemma3_text",
        dense(
            "gemma3_text",
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=32,
            sliding_window_pattern=2,
            rms_norm_eps=1e-6,
        ),
    ),
    ArchSpec(
        "gpt_oss",
        dense(
            "gpt_oss",
            num_hidden_layers=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=32,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    ArchSpec(
        "qwen3_moe",
        dense(
            "qwen3_moe",
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=64,
            norm_topk_prob=True,
        ),
    ),
    ArchSpec(
        "deepseek_v3",
        dense(
            "deepseek_v3",
            moe_intermediate_size=64,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
            rope_scaling=YARN,
        ),
    ),
]

# Quantized with mlx-lm's own quantization; the default suite runs one of each family (4-bit and 8-bit
# both), CONFORMANCE_ALL=1 every one.
QUANTIZED_FAMILIES = ("llama", "qwen3_next", "gemma3_text", "qwen3_moe")
AFFINE_BITS = (4, 8)
DEFAULT_QUANTIZED = ("llama-4bit", "qwen3_next-8bit", "gemma3_text-4bit", "qwen3_moe-8bit")
GPT_OSS_AS_SHIPPED = Quantization(bits=8, experts=("mxfp4", 4, 32))


def quantized(spec: ArchSpec, quantization: Quantization) -> ArchSpec:
    return replace(spec, name=f"{spec.name}-{quantization.label}", quantization=quantization)


def _all() -> list[ArchSpec]:
    named = [replace(spec, in_default_suite=True) for spec in NAMED]
    by_name = {spec.name: spec for spec in named}
    variants = [
        quantized(by_name[name], Quantization(bits)) for name in QUANTIZED_FAMILIES for bits in AFFINE_BITS
    ]
    variants = [replace(v, in_default_suite=v.name in DEFAULT_QUANTIZED) for v in variants]
    variants.append(quantized(by_name["gpt_oss"], GPT_OSS_AS_SHIPPED))
    return [*named, *variants, *OTHERS]


ARCHITECTURES: dict[str, ArchSpec] = {spec.name: spec for spec in _all()}
