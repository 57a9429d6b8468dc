"""Resolve `--model` to weights and load them: the default model, a local directory or a hub id."""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import xxhash
from loguru import logger

from semantic.engine.cache_store.cache_spec import ModelCacheSpec
from semantic.engine.decoding.sampling import GenerationDefaults
from semantic.engine.group.distributed import GroupLayout
from semantic.engine.mlx_adapter.api import load as mlx_lm_load
from semantic.engine.mlx_adapter.api import sharded_load
from semantic.engine.model.default_model import (
    DEFAULT_MODEL_SAMPLING,
    DEFAULT_MODEL_SOURCES,
    ensure_default_model,
    model_name_for,
    user_cache_dir,
)
from semantic.engine.model.weights_digest import digests_of
from semantic.engine.speculation.model_drafts import check_draft_model

DEFAULT_CONTEXT_LENGTH = 8192


@dataclass(slots=True)
class LoadedModel:
    name: str
    source: str
    model: Any
    tokenizer: Any
    spec: ModelCacheSpec
    fingerprint: str
    context_length: int
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    max_chars_per_token: int = 1 << 20  # see longest_token_length
    layout: GroupLayout | None = None  # this rank's part of a model split over a group
    legacy_fingerprint: str = ""  # what releases before format 3 named its agents folder by

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def num_embedding_rows(self) -> int:
        """How many token ids the model reads and scores (its embedding's rows; the tokenizer's
        length, added tokens included, where the model's config does not say): the bound on token
        ids read back from disk. Not the tokenizer's `vocab_size`, which leaves out added tokens
        (Qwen's and Llama 3's chat markers lie above it)."""
        args = getattr(self.model, "args", None)
        return int(getattr(args, "vocab_size", 0) or len(self.tokenizer))

    @property
    def num_token_ids(self) -> int:
        """How many token ids a request may name: those the model scores and the tokenizer can
        write (added tokens included; a padded embedding has rows past them)."""
        return min(self.num_embedding_rows, len(self.tokenizer))


def is_default_model(source: str) -> bool:
    return source in DEFAULT_MODEL_SOURCES


def resolve_model_path(source: str, default_dtype: str = "float32", models_dir: Path | None = None) -> str:
    """The local directory or hub id a `--model` value loads from (converting the default model)."""
    if is_default_model(source):
        return str(ensure_default_model(default_dtype, models_dir=models_dir))
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if source.startswith(("/", "./", "../", "~")) or path.exists():
        raise FileNotFoundError(f"{source} is not a model directory")
    return source


# Besides the weights, what mlx-lm reads that decides the computation: the config (architecture,
# dtype, quantization) and ModelOpt's quantization settings, which it reads from a file of their own.
FINGERPRINTED_CONFIGS = ("config.json", "hf_quant_config.json")
WEIGHTS_GLOB = "*.safetensors"  # mlx-lm reads `model*.safetensors`; hash any that might be weights
DIGESTS_FILE_NAME = "weight-digests.json"


def fingerprint_model(model_dir: Path, digests_path: Path | None = None) -> str:
    """Identify what decides a cache's KV: the config files and every byte of every weights file
    (the default model's dtype is in its weights' bytes). Each file's digest is kept in
    `digests_path` against its identity, so a restart does not read the weights again."""
    fingerprint = xxhash.xxh3_128()
    for name in FINGERPRINTED_CONFIGS:
        path = model_dir / name
        if path.exists():
            data = path.read_bytes()
            fingerprint.update(f"{name}:{len(data)}:".encode() + data)
    files = sorted(model_dir.glob(WEIGHTS_GLOB))
    if digests_path is not None and not digests_path.exists():
        logger.info(
            "fingerprinting {} over every weight byte (kept in {}); cache folders written by releases "
            "that fingerprinted only each file's header and ends are not read: their agents start cold",
            model_dir,
            digests_path,
        )
    for path, digest in zip(files, digests_of(files, digests_path), strict=True):
        fingerprint.update(f"{path.name}:{digest}\n".encode())
    return str(fingerprint.hexdigest())


def legacy_fingerprint(model_dir: Path) -> str:
    """The fingerprint releases before format 3 named a model's agents folder by (config plus each
    weights file's header and ends): only to find the conversation records kept there."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for weights in sorted(model_dir.glob(WEIGHTS_GLOB)):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_len, 1 << 24)))
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:32]


def digests_path_for(models_dir: Path | None) -> Path:
    """Where weight digests are kept: the models folder (the user cache's `models/` by default)."""
    return (models_dir or user_cache_dir() / "models") / DIGESTS_FILE_NAME


def context_length_of(model_dir: Path, tokenizer: Any) -> int:
    config: dict[str, Any] = {}
    if (model_dir / "config.json").exists():
        config = json.loads((model_dir / "config.json").read_text())
    for source in (config, config.get("text_config", {})):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            if isinstance(source.get(key), int):
                return int(source[key])
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and limit < 10**7 else DEFAULT_CONTEXT_LENGTH


def load_model(
    source: str,
    block_size: int = 256,
    default_dtype: str = "float32",
    name: str | None = None,
    models_dir: Path | None = None,
    layout: GroupLayout | None = None,
) -> LoadedModel:
    """Load a model with mlx-lm's normal path, or in a group its `sharded_load` (every rank at
    once); call it on the thread that will run the model."""
    path = resolve_model_path(source, default_dtype, models_dir)
    model_dir = Path(path) if Path(path).is_dir() else None
    if layout is None:
        model, tokenizer = mlx_lm_load(path)  # type: ignore[misc]
    else:
        model, tokenizer = load_shard(path, model_dir, layout)
    model_dir = model_dir or _hub_snapshot_dir(path)
    mx.eval(model.parameters())
    fingerprint = fingerprint_model(model_dir, digests_path_for(models_dir))
    legacy = legacy_fingerprint(model_dir) if layout is None else ""
    if layout is not None:  # a shard's caches hold its heads or layers only: never another layout's
        fingerprint = hashlib.sha256(f"{fingerprint}:{layout.name}".encode()).hexdigest()[:32]
    return LoadedModel(
        name=name or model_name_for(source),
        source=source,
        model=model,
        tokenizer=tokenizer,
        spec=ModelCacheSpec.from_model(model, block_size),
        fingerprint=fingerprint,
        legacy_fingerprint=legacy,
        layout=layout,
        context_length=context_length_of(model_dir, tokenizer),
        generation_defaults=generation_defaults_of(model_dir, is_default_model(source)),
        max_chars_per_token=longest_token_length(tokenizer),
    )


def load_draft_model(source: str, main: LoadedModel, default_dtype: str, models_dir: Path | None) -> Any:
    """A draft model for speculative decoding (`--speculate`), resolved as `--model` is: refused
    where its tokenizer differs from the main model's or its cache cannot take back drafts."""
    try:
        path = resolve_model_path(source, default_dtype, models_dir)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"the draft model (backend.speculate): {error}") from None
    model, tokenizer = mlx_lm_load(path)  # type: ignore[misc]
    check_draft_model(model, tokenizer, main.tokenizer, source)
    mx.eval(model.parameters())
    logger.info("draft model {} drafts for {}", source, main.name)
    return model


def load_shard(path: str, model_dir: Path | None, layout: GroupLayout) -> tuple[Any, Any]:
    """This rank's part of the model, through mlx-lm's `sharded_load`: heads and MLP columns split
    over the group (tensor parallel), or its run of layers (`pipeline`, where the model has it)."""
    if layout.parallel == "tensor" and model_dir is not None:
        check_heads_divide(model_dir, layout.size)
    group = mx.distributed.init()
    pipeline = group if layout.parallel == "pipeline" else None
    tensor = group if layout.parallel == "tensor" else None
    model, tokenizer = sharded_load(path, pipeline_group=pipeline, tensor_group=tensor)
    return model, tokenizer


def check_heads_divide(model_dir: Path, num_ranks: int) -> None:
    """Tensor parallelism splits attention heads, KV heads and MLP columns evenly; mlx-lm's `shard`
    would silently floor a KV head count that does not divide, so refuse it here, by name."""
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    heads = config.get("num_attention_heads")
    counts = {
        "attention heads": heads,
        "KV heads": config.get("num_key_value_heads", heads),
        "MLP columns": config.get("intermediate_size"),
    }
    for what, count in counts.items():
        if isinstance(count, int) and count % num_ranks:
            raise ValueError(
                f"the model has {count} {what}, which {num_ranks} ranks cannot split evenly: use a "
                f"group size that divides {count}, or --pipeline where the model supports it"
            )


def longest_token_length(tokenizer: Any) -> int:
    """The UTF-8 length of the vocabulary's longest token, special tokens included: no token spans
    more characters of a text (byte-level vocabularies spell one byte a character, and those
    characters take up to 2 bytes in UTF-8: a margin for normalizers that join characters)."""
    return max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)


def generation_defaults_of(model_dir: Path, is_default: bool = False) -> GenerationDefaults:
    """The sampling the model's generation_config.json asks for (as vLLM and mlx-lm honour it):
    `do_sample: false` means greedy; what it leaves out stays at 1.0 / 1.0 / 0 (off)."""
    config: dict[str, Any] = {}
    path = model_dir / "generation_config.json"
    with contextlib.suppress(OSError, ValueError):
        config = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(config, dict):
        config = {}
    if is_default and not path.exists():
        config = dict(DEFAULT_MODEL_SAMPLING)
    fallback = GenerationDefaults()
    temperature = config.get("temperature", fallback.temperature)
    if config.get("do_sample") is False:
        temperature = 0.0
    top_p, top_k = config.get("top_p", fallback.top_p), config.get("top_k", fallback.top_k)
    try:
        return GenerationDefaults(
            temperature=min(2.0, max(0.0, float(temperature))),
            top_p=float(top_p) if 0.0 < float(top_p) <= 1.0 else 1.0,
            top_k=max(0, int(top_k)),
        )
    except (TypeError, ValueError):
        return fallback


def _hub_snapshot_dir(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, local_files_only=True))
