"""What one architecture of the conformance suite is: its tiny config, seed, embedding scale and
quantization (tests/arch_configs.py lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VOCAB_SIZE = 49152  # SmolLM2's tokenizer


@dataclass(frozen=True, slots=True)
class Quantization:
    """mlx-lm's own quantization of every layer it quantizes; `experts` (mode, bits, group size)
    quantizes MoE experts otherwise, as gpt-oss ships (mxfp4 experts beside 8-bit affine layers)."""

    bits: int
    mode: str = "affine"
    group_size: int = 64
    experts: tuple[str, int, int] | None = None

    @property
    def label(self) -> str:
        if self.experts is not None:
            return f"{self.experts[0]}-experts-{self.bits}bit"
        return f"{self.bits}bit" if self.mode == "affine" else self.mode


@dataclass(frozen=True, slots=True)
class ArchSpec:
    name: str
    config: dict[str, Any]
    seed: int = 0
    quantization: Quantization | None = None
    in_default_suite: bool = False  # the rest run with CONFORMANCE_ALL=1
    # Embeddings scaled up make greedy choices decisive; with tied embeddings the residual stream
    # then keeps the input token, and the greedy reply repeats it, so those scale down.
    embed_scale: float = 4.0

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


def dense(model_type: str, **fields: Any) -> dict[str, Any]:
    """A llama-shaped tiny config; `fields` add to or override it."""
    return {
        "model_type": model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **fields,
    }


YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
