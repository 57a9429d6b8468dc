"""The command line's settings: a flag for each setting (beside its SEMANTIC_* variable and its
TOML key), and the effective settings they give."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from semantic.protocols.settings import LoadedSettings

# Flags for settings: (flag, setting key, help). Every setting also has SEMANTIC_<SECTION>_<KEY>.
MODEL_FLAGS = [
    ("--model", "model.name", "'default' (SmolLM2-135M-Instruct), a local MLX model dir or a hub id"),
    ("--dtype", "model.dtype", "default model conversion dtype: float32 or bfloat16"),
    ("--cache-dir", "cache.dir", "where models and agent caches live"),
    ("--models-dir", "model.dir", "where the default model is converted (default: <cache-dir>/models)"),
    ("--cache-budget-mb", "cache.budget_mb", "memory for KV caches, in MiB"),
    (
        "--disk-budget-mb",
        "cache.disk_budget_mb",
        "disk for agents' cache files, per model, in MiB; least recently used deleted first (0: no limit)",
    ),
    ("--block-size", "cache.block_size", "tokens per KV block"),
    (
        "--kv-bits",
        "cache.kv_bits",
        "quantize the KV cache (refused at start-up where mlx-lm cannot batch it)",
    ),
    (
        "--idle-kv-bits",
        "cache.idle_kv_bits",
        "keep caches no sequence is decoding from quantized to 4 or 8 bits (more agents per GB)",
    ),
    (
        "--cache-pinned-share",
        "cache.pinned_share",
        "share of the KV budget that Anthropic cache_control prefixes may keep for their ttl (0 to 1)",
    ),
    (
        "--checkpoint-idle-s",
        "cache.checkpoint_idle_s",
        "after this many seconds without requests, write the caches that changed to disk (0: off)",
    ),
    (
        "--heap-reserve-mb",
        "cache.heap_reserve_mb",
        "heap faulted in at start-up and kept through idle trims, on Linux CPU, in MiB (512; 0: none)",
    ),
    ("--device", "backend.device", "where MLX runs: auto (the GPU where there is one), cpu or gpu"),
    (
        "--speculate",
        "backend.speculate",
        "draft tokens and verify them in the batch: off (default), ngram (from each reply's own "
        "history) or a draft model with the same tokenizer (a folder or hub id)",
    ),
    ("--max-batch-size", "engine.max_batch_size", "sequences decoding together"),
    ("--tick-ms", "engine.tick_ms", "shortest engine tick under load, in ms (0: back to back)"),
    (
        "--prefill-batch-size",
        "engine.prefill_batch_size",
        "prompts prefilled together (0: 1 on CPU, 8 on GPU)",
    ),
    (
        "--prefill-step-size",
        "engine.prefill_step_size",
        "prefill chunk in tokens (0: 512 on CPU, 2048 on GPU)",
    ),
    (
        "--prefill-stall-ratio",
        "engine.prefill_stall_ratio",
        "while others decode, prefill per tick what takes this many of their decode steps (0: off)",
    ),
    (
        "--short-turn-tokens",
        "engine.short_turn_tokens",
        "prompts with at most this many uncached tokens go in whole chunks while others decode, and "
        "may overtake a long prefill (0: two prefill steps on the CPU, one on a GPU)",
    ),
    (
        "--shortest-first-max-wait-s",
        "engine.shortest_first_max_wait_s",
        "queued prompts go fewest uncached tokens first; past this wait, in arrival order",
    ),
    (
        "--rank-timeout-s",
        "engine.rank_timeout_s",
        "under mlx.launch: a rank silent this long stops the group with an error",
    ),
]
SERVER_FLAGS = [
    ("--host", "server.host", "address to bind (non-loopback needs --allow-remote and an API key)"),
    ("--port", "server.port", "port to listen on"),
    ("--api-key", "server.api_key", "require this key (x-api-key or Authorization: Bearer)"),
    (
        "--api-keys-file",
        "server.api_keys_file",
        "a TOML file mapping API keys to namespaces: each key sees only its own agents",
    ),
    ("--max-body-mb", "server.max_body_mb", "largest request body, in MiB"),
    ("--request-timeout-s", "server.request_timeout_s", "a generation running longer fails"),
    (
        "--stream-write-timeout-s",
        "server.stream_write_timeout_s",
        "a stream whose client takes none of a write this long is closed and its slot freed",
    ),
    ("--shutdown-timeout-s", "server.shutdown_timeout_s", "on SIGTERM, how long running requests may finish"),
    (
        "--header-timeout-s",
        "server.header_timeout_s",
        "a request's head must arrive within this many seconds of its first byte (or of connecting)",
    ),
    (
        "--body-timeout-s",
        "server.body_timeout_s",
        "a request's whole body must arrive within this many seconds of its head (else 408)",
    ),
    (
        "--keepalive-timeout-s",
        "server.keepalive_timeout_s",
        "close a connection idle this long between requests",
    ),
    (
        "--max-connections",
        "server.max_connections",
        "open connections at most; more get 503 (default: 256 under the descriptor limit, at most 1024)",
    ),
    ("--idle-unload-s", "model.idle_unload_s", "unload the model after this many idle seconds"),
    (
        "--swap-drain-timeout-s",
        "model.swap_drain_timeout_s",
        "how long a model swap waits for running requests",
    ),
    (
        "--temperature",
        "model.temperature",
        "sampling temperature for requests that set none (default: the model's generation_config)",
    ),
    ("--default-max-tokens", "model.default_max_tokens", "max_tokens for requests that set none"),
    (
        "--tool-calls",
        "model.tool_calls",
        "guided (default): a tool call the model opens follows its tool's schema; free: as written",
    ),
    ("--max-queued", "limits.max_queued", "requests that may wait beyond the running batch (then 429/529)"),
    ("--max-tokens-limit", "limits.max_tokens", "largest max_tokens a request may ask for"),
    ("--max-messages", "limits.max_messages", "most messages in one request"),
    ("--max-tools", "limits.max_tools", "most tools in one request"),
    ("--max-prompt-tokens", "limits.max_prompt_tokens", "longest prompt, in tokens"),
    ("--rate-per-s", "limits.rate_per_s", "requests per second for the whole server (token bucket)"),
    ("--rate-burst", "limits.rate_burst", "burst for --rate-per-s"),
    ("--agent-rate-per-s", "limits.agent_rate_per_s", "requests per second per agent (token bucket)"),
    ("--agent-rate-burst", "limits.agent_rate_burst", "burst for --agent-rate-per-s"),
    ("--log-format", "logging.format", "human or json (JSON lines)"),
    ("--log-level", "logging.level", "loguru level, e.g. INFO or DEBUG"),
    ("--log-file", "logging.file", "also log to this file, rotated (stderr then gets warnings only)"),
    ("--log-rotate-mb", "logging.rotate_mb", "start a new log file past this size, in MiB"),
    ("--log-keep-files", "logging.keep_files", "rotated log files kept, newest first"),
]


def _setting_flags(parser: argparse.ArgumentParser, flags: list[tuple[str, str, str]]) -> None:
    for flag, key, help_text in flags:
        parser.add_argument(
            flag, dest=f"setting:{key}", default=argparse.SUPPRESS, metavar="VALUE", help=help_text
        )


def add_settings_args(parser: argparse.ArgumentParser, server: bool) -> None:
    parser.add_argument(
        "--config", type=Path, default=None, help="a TOML file with [section] tables of settings"
    )
    _setting_flags(parser, MODEL_FLAGS)
    if not server:
        return
    _setting_flags(parser, SERVER_FLAGS)
    parser.add_argument(
        "--allow-remote",
        dest="setting:server.allow_remote",
        action="store_true",
        default=argparse.SUPPRESS,
        help="allow binding a non-loopback --host (an API key is then required)",
    )
    parser.add_argument(
        "--pipeline",
        dest="setting:engine.pipeline",
        action="store_true",
        default=argparse.SUPPRESS,
        help="under mlx.launch: split the model's layers over the ranks instead of its heads",
    )
    parser.add_argument(
        "--no-mixed-step",
        dest="setting:backend.mixed_step",
        action="store_false",
        default=argparse.SUPPRESS,
        help="decode and prefill in two forward passes a tick (mlx-lm's way) instead of one",
    )
    parser.add_argument(
        "--exact-numerics",
        dest="setting:backend.exact_numerics",
        action="store_true",
        default=argparse.SUPPRESS,
        help="run mlx-lm's own kernels and steps only (no CPU kernels, fold or step variants)",
    )
    parser.add_argument(
        "--alias",
        dest="setting:model.aliases",
        action="append",
        default=argparse.SUPPRESS,
        metavar="NAME=MODEL",
        help="answer requests for model NAME (a glob, e.g. 'claude-haiku*') with MODEL, a configured "
        "model's name, or with whichever model is loaded when MODEL is empty",
    )
    parser.add_argument(
        "--add-model",
        dest="setting:model.extra",
        action="append",
        default=argparse.SUPPRESS,
        metavar="NAME=SOURCE",
        help="another model requests may switch to by NAME (SOURCE: a local MLX dir or a hub id)",
    )


def _pairs(flag: str, specs: list[str], need_value: bool) -> dict[str, str]:
    pairs = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not name or not sep or (need_value and not value):
            raise SystemExit(f"{flag} wants NAME=VALUE, got {spec!r}")
        pairs[name] = value
    return pairs


def load_settings_from(args: argparse.Namespace) -> LoadedSettings:
    """The effective settings: flags over SEMANTIC_* over .env over --config over defaults."""
    from semantic.protocols.settings import ConfigError, load_settings

    cli = {k.removeprefix("setting:"): v for k, v in vars(args).items() if k.startswith("setting:")}
    if "model.extra" in cli:
        cli["model.extra"] = _pairs("--add-model", cli["model.extra"], need_value=True)
    if "model.aliases" in cli:
        cli["model.aliases"] = _pairs("--alias", cli["model.aliases"], need_value=False)
    try:
        return load_settings(cli, config_file=args.config)
    except ConfigError as error:
        print(f"semantic: {error}", file=sys.stderr)
        raise SystemExit(2) from None
