"""Every setting, in one set of msgspec Structs, and where each value came from.

Precedence, highest first: command-line flags, `SEMANTIC_<SECTION>_<KEY>` environment variables,
the same variables in `./.env`, a TOML file (`--config`), the defaults below. Unknown keys and bad
values are refused with the key, the value, where it came from and what is allowed.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Positive = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
ENV_PREFIX = "SEMANTIC_"
SECRET_KEYS = {"server.api_key"}
# SEMANTIC_* variables that are not settings: the launcher's (semantic/launch.py) and the tests'.
NOT_SETTINGS = {"SEMANTIC_FAST_BLAS", "SEMANTIC_NO_FAST_BLAS", "SEMANTIC_TEST"}


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ServerSection(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    allow_remote: bool = False  # binding a non-loopback address needs this and an api_key
    api_key: str | None = None
    api_keys_file: str | None = None  # TOML: API key -> namespace of agents (protocols/tenancy.py)
    max_body_mb: Positive = 32.0
    request_timeout_s: Positive = 600.0
    # A stream's write that the client has not taken this long ends the request and frees its slot.
    stream_write_timeout_s: Positive = 30.0
    shutdown_timeout_s: Annotated[float, Meta(ge=0)] = 30.0
    # A client's head comes in one write: 10 s is slack for a slow link, short for a held socket.
    header_timeout_s: Positive = 10.0
    body_timeout_s: Positive = 30.0  # the whole body: 32 MB (max_body_mb) at ~1 MB/s
    # Clients' pools reuse a connection within seconds (httpx drops idle ones after 5 s).
    keepalive_timeout_s: Positive = 15.0
    max_connections: PositiveInt | None = None  # None: under the descriptor limit (connections.py)


class ModelSection(_Section):
    name: str = "default"  # 'default' (SmolLM2-135M-Instruct), a local MLX dir or a hub id
    dtype: Literal["float32", "bfloat16"] = "float32"
    dir: str | None = None  # where the default model is converted; None: <cache.dir>/models
    extra: dict[str, str] = {}  # more models requests may switch to: name -> source
    aliases: dict[str, str] = {}  # requested-name glob -> model name ("" = the loaded model)
    idle_unload_s: Positive | None = None
    swap_drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None  # None: the model's own default
    # guided: a call the model opens is decoded under its tools' schemas; free: as written (strict
    # tools are held to theirs either way).
    tool_calls: Literal["free", "guided"] = "guided"
    default_max_tokens: PositiveInt = 1024


class CacheSection(_Section):
    dir: str | None = None  # None: $XDG_CACHE_HOME/semantic
    budget_mb: PositiveInt = 4096
    disk_budget_mb: Annotated[int, Meta(ge=0)] = 20480  # agents' cache files, per model; 0: no limit
    block_size: Annotated[int, Meta(ge=16, le=4096)] = 256
    kv_bits: Literal[4, 8] | None = None
    idle_kv_bits: Literal[4, 8] | None = None
    # the share of budget_mb that Anthropic cache_control breakpoints may keep pinned for their ttl
    pinned_share: Annotated[float, Meta(ge=0, le=1)] = 0.25
    # heap kept faulted in (Linux CPU only); None: the backend profile's (512)
    heap_reserve_mb: Annotated[int, Meta(ge=0, le=1 << 20)] | None = None
    # write the caches that changed since their files after this long without requests; 0: off
    checkpoint_idle_s: Annotated[float, Meta(ge=0, le=86400)] = 120.0


class EngineSection(_Section):
    max_batch_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    tick_ms: Annotated[float, Meta(ge=0, le=1000)] = 0.0  # 0: ticks back to back
    prefill_batch_size: Annotated[int, Meta(ge=0, le=256)] = 0  # 0: 1 on the CPU, 8 on a GPU
    prefill_step_size: Annotated[int, Meta(ge=0, le=65536)] = 0  # 0: 512 on the CPU, 2048 on a GPU
    prefill_stall_ratio: Annotated[float, Meta(ge=0, le=100)] = 1.0  # 0: whole chunks (off)
    # a prompt with at most this many uncached tokens goes in whole chunks; 0: one prefill step
    short_turn_tokens: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    shortest_first_max_wait_s: Annotated[float, Meta(ge=0, le=86400)] = 60.0
    # Under mlx.launch: split the model's layers over the group instead of its heads (where the
    # model supports it), and how long a silent rank is waited for before the group stops.
    pipeline: bool = False
    rank_timeout_s: Annotated[float, Meta(ge=1, le=86400)] = 120.0


class BackendSection(_Section):
    """What runs on the device (engine/loop/backend_profile.py); None: the device's default (on the CPU
    our kernels and step variants, on a GPU mlx-lm's own)."""

    device: Literal["auto", "cpu", "gpu"] = "auto"  # auto: the GPU where this mlx has one
    exact_numerics: bool = False  # mlx-lm's own kernels and steps only, whatever the others say
    cpu_kernels: bool | None = None  # our attention and SwiGLU (engine/cpu/cpu_attention.py)
    last_token_fold: bool | None = None  # a prompt's last token in its last chunk
    mixed_step: bool | None = None  # decode and a prompt's chunk in one forward pass
    joining_cache: bool | None = None  # joins and leaves at one copy of each running row
    # Drafts verified in the batch's pass: off, ngram, or a draft model (a folder, a hub id, default).
    speculate: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None


class LimitsSection(_Section):
    max_queued: Annotated[int, Meta(ge=0)] = 64  # requests waiting beyond the running batch
    max_tokens: PositiveInt = 32768  # largest max_tokens a request may ask for
    max_messages: PositiveInt = 2048
    max_tools: PositiveInt = 256
    max_prompt_tokens: PositiveInt = 131072
    rate_per_s: Positive | None = None  # all requests, token bucket
    rate_burst: PositiveInt = 32
    agent_rate_per_s: Positive | None = None  # per agent, token bucket
    agent_rate_burst: PositiveInt = 8


class LoggingSection(_Section):
    format: Literal["human", "json"] = "human"
    level: Literal["TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    # Also write the lines to this file, rotated past rotate_mb, the newest keep_files kept; stderr then
    # gets warnings only (a service's stderr goes to a file too: the lines would be there twice).
    file: str | None = None
    rotate_mb: Positive = 50.0
    keep_files: Annotated[int, Meta(ge=1, le=1000)] = 10


class Settings(_Section):
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    cache: CacheSection = msgspec.field(default_factory=CacheSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    backend: BackendSection = msgspec.field(default_factory=BackendSection)
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    logging: LoggingSection = msgspec.field(default_factory=LoggingSection)


class ConfigError(ValueError):
    pass


SECTIONS: dict[str, type[_Section]] = {
    "server": ServerSection,
    "model": ModelSection,
    "cache": CacheSection,
    "engine": EngineSection,
    "backend": BackendSection,
    "limits": LimitsSection,
    "logging": LoggingSection,
}
MAPPING_KEYS = {"model.extra", "model.aliases"}  # written `a=b,c=d` in the environment


def known_keys() -> list[str]:
    return [f"{section}.{key}" for section, cls in SECTIONS.items() for key in cls.__struct_fields__]


class LoadedSettings(msgspec.Struct, frozen=True):
    settings: Settings
    sources: dict[str, str]  # "section.key" -> where its value came from

    def describe(self) -> str:
        """The effective configuration, one `section.key = value  # source` line each, secrets masked."""
        lines = []
        values = msgspec.to_builtins(self.settings)
        for key in known_keys():
            section, name = key.split(".")
            value = values[section][name]
            if key in SECRET_KEYS and value:
                value = "****"
            lines.append(f"{key} = {value!r}  # {self.sources.get(key, 'default')}")
        return "\n".join(lines)


def load_settings(
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    dotenv: Path | None = Path(".env"),
    config_file: Path | None = None,
) -> LoadedSettings:
    """Merge the layers (CLI > environment > .env > TOML file > defaults) and validate once."""
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}

    def layer(values: Mapping[str, Any], source: str) -> None:
        for key, value in values.items():
            if source.endswith(("environment", ".env")):
                source_of_key = f"{source} {ENV_PREFIX}{key.replace('.', '_').upper()}"
            else:
                source_of_key = source
            section, _, name = key.partition(".")
            if section not in SECTIONS or name not in SECTIONS[section].__struct_fields__:
                raise ConfigError(
                    f"unknown setting {key!r} (from {source_of_key}); known: {', '.join(known_keys())}"
                )
            merged.setdefault(section, {})[name] = value
            sources[key] = source_of_key

    if config_file is not None:
        layer(_read_toml(config_file), f"config file {config_file}")
    if dotenv is not None and dotenv.is_file():
        layer(_from_env(_read_dotenv(dotenv)), f"{dotenv}")
    layer(_from_env(os.environ if environ is None else environ), "environment")
    layer(dict(cli or {}), "command line")
    level = merged.get("logging", {}).get("level")
    if isinstance(level, str):
        merged["logging"]["level"] = level.upper()  # `--log-level debug` as loguru's DEBUG
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as error:
        raise ConfigError(_explain(error, merged, sources)) from None
    return LoadedSettings(settings, sources)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    flat: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{path}: {section!r} must be a [section] table; sections: {', '.join(SECTIONS)}"
            )
        flat.update({f"{section}.{key}": value for key, value in values.items()})
    return flat


def _read_dotenv(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        values[key.strip()] = value.strip().strip("'\"")
    return values


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """`SEMANTIC_SERVER_PORT=8001` -> {"server.port": "8001"}; mappings are written `a=b,c=d`."""
    values: dict[str, Any] = {}
    for variable, value in environ.items():
        if not variable.startswith(ENV_PREFIX) or variable in NOT_SETTINGS:
            continue
        section, _, name = variable.removeprefix(ENV_PREFIX).lower().partition("_")
        key = f"{section}.{name}"
        if key in MAPPING_KEYS:
            values[key] = dict(pair.split("=", 1) for pair in value.split(",") if "=" in pair)
        else:
            values[key] = None if value == "" else value
    return values


def _explain(
    error: msgspec.ValidationError, merged: dict[str, dict[str, Any]], sources: dict[str, str]
) -> str:
    """msgspec's reason (`Expected int >= 1, got str`) with the key, its value and its source."""
    reason, _, where = str(error).rpartition(" - at `$.")
    section, _, rest = where.rstrip("`").partition(".")
    name = rest.split(".")[0].split("[")[0]
    if not name:
        return f"invalid settings: {error}"
    key = f"{section}.{name}"
    value = merged.get(section, {}).get(name)
    allowed = _allowed_values(section, name)
    return f"invalid setting {key} = {value!r} (from {sources.get(key, 'default')}): {reason}{allowed}"


def _allowed_values(section: str, name: str) -> str:
    """`; allowed: 'human', 'json'` for settings that take one of a few values."""
    cls = SECTIONS.get(section)
    if cls is None:
        return ""
    for field in msgspec.inspect.type_info(cls).fields:  # type: ignore[attr-defined]
        if field.name == name:
            kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else [field.type]
            values = [v for t in kinds if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]
            return f"; allowed: {', '.join(map(repr, values))}" if values else ""
    return ""
