"""The `semantic` command: `serve` the HTTP API, `config`, `generate` one answer, `fetch-model`,
`service` (a login service), `doctor` (check the machine)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from semantic.agents_cli import add_agents_parsers
from semantic.cli_settings import add_settings_args, load_settings_from
from semantic.doctor import add_doctor_parser
from semantic.launch import reexec_with_fast_blas
from semantic.service import add_service_parser

if TYPE_CHECKING:
    from semantic.actors.system import SystemConfig
    from semantic.engine.model.default_model import ProgressFn
    from semantic.protocols.settings import Settings


def _cache_dir(settings: Settings) -> Path:
    from semantic.engine.model.default_model import user_cache_dir

    return Path(settings.cache.dir) if settings.cache.dir else user_cache_dir()


def _models_dir(settings: Settings) -> Path:
    return Path(settings.model.dir) if settings.model.dir else _cache_dir(settings) / "models"


def _system_config(settings: Settings) -> SystemConfig:
    from semantic.actors.engine_client import EngineConfig
    from semantic.actors.model_registry import ModelEntry
    from semantic.actors.system import SystemConfig
    from semantic.engine.loop.backend_profile import apply_device_choice

    _refuse_kv_bits(settings.cache.kv_bits)
    apply_device_choice(settings.backend.device)
    backend = settings.backend
    engine = EngineConfig(
        model=settings.model.name,
        block_size=settings.cache.block_size,
        cache_budget_mb=settings.cache.budget_mb,
        idle_kv_bits=settings.cache.idle_kv_bits,
        cache_pinned_share=settings.cache.pinned_share,
        max_batch_size=settings.engine.max_batch_size,
        tick_s=settings.engine.tick_ms / 1000,
        default_dtype=settings.model.dtype,
        models_dir=_models_dir(settings),
        prefill_batch_size=settings.engine.prefill_batch_size or None,
        prefill_step_size=settings.engine.prefill_step_size or None,
        prefill_stall_ratio=settings.engine.prefill_stall_ratio,
        short_turn_tokens=settings.engine.short_turn_tokens or None,
        mixed_step=backend.mixed_step,
        last_token_fold=backend.last_token_fold,
        joining_cache=backend.joining_cache,
        speculate=backend.speculate,
        cpu_kernels=backend.cpu_kernels,
        exact_numerics=backend.exact_numerics,
        heap_reserve_mb=settings.cache.heap_reserve_mb,
        shortest_first_max_wait_s=settings.engine.shortest_first_max_wait_s,
        pipeline=settings.engine.pipeline,
        rank_timeout_s=settings.engine.rank_timeout_s,
    )
    return SystemConfig(
        engine=engine,
        cache_dir=_cache_dir(settings),
        extra_models=tuple(ModelEntry(name, source) for name, source in settings.model.extra.items()),
        model_aliases=settings.model.aliases,
        idle_unload_s=settings.model.idle_unload_s,
        swap_drain_timeout_s=settings.model.swap_drain_timeout_s,
        max_prompt_tokens=settings.limits.max_prompt_tokens,
        disk_budget_mb=settings.cache.disk_budget_mb or None,
        checkpoint_idle_s=settings.cache.checkpoint_idle_s or None,
    )


def _refuse_kv_bits(kv_bits: int | None) -> None:
    """Quantized KV only if it can decode in a batch; say so rather than degrade to one sequence."""
    if kv_bits is None:
        return
    import mlx_lm
    from mlx_lm.models.cache import QuantizedKVCache

    if "merge" not in vars(QuantizedKVCache):
        raise SystemExit(
            f"--kv-bits {kv_bits}: mlx-lm {mlx_lm.__version__} cannot batch quantized KV caches "
            "(QuantizedKVCache has no merge/extract for BatchGenerator), and semantic decodes every "
            "request in the shared batch. Run without --kv-bits, or lower --cache-budget-mb instead."
        )
    raise SystemExit(
        f"--kv-bits {kv_bits}: this mlx-lm can batch quantized KV caches, but semantic's block pool "
        "keeps KV at the model's dtype; quantized blocks are not supported yet"
    )


def _progress_bar() -> ProgressFn:
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=f"default model: {stage}", file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return progress


def _ensure_default_model(settings: Settings) -> None:
    from semantic.engine.model.default_model import ensure_default_model
    from semantic.engine.model.loading import is_default_model

    if is_default_model(settings.model.name):
        ensure_default_model(settings.model.dtype, progress=_progress_bar(), models_dir=_models_dir(settings))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_bind(settings: Settings) -> None:
    server = settings.server
    if server.api_key is not None and not server.api_key.strip():
        raise SystemExit("semantic: refusing an empty API key (server.api_key); leave it unset for no key")
    if server.api_keys_file is not None:
        _check_keys_file(settings)
    if server.host in LOOPBACK:
        return
    if not server.allow_remote:
        raise SystemExit(
            f"semantic: refusing to bind {server.host}: only loopback is served unless --allow-remote "
            "(server.allow_remote) is set, with an API key"
        )
    if not server.api_key and not server.api_keys_file:
        raise SystemExit(
            f"semantic: refusing to bind {server.host} without an API key; "
            "set --api-key or SEMANTIC_SERVER_API_KEY"
        )


def _check_keys_file(settings: Settings) -> None:
    from semantic.protocols.tenancy import KeysFileError, Tenancy

    server = settings.server
    if server.api_key is not None:
        raise SystemExit(
            "semantic: set server.api_key or server.api_keys_file, not both; "
            "give the single key a namespace in the keys file instead"
        )
    try:
        Tenancy.from_settings(server)
    except KeysFileError as error:
        raise SystemExit(f"semantic: {error}") from None


def serve(args: argparse.Namespace) -> None:
    from semantic.logs import configure_logging
    from semantic.server import run_server

    loaded = load_settings_from(args)
    settings = loaded.settings
    rank = _group_rank()
    if rank == 0:
        _check_bind(settings)
    configure_logging(settings.logging)
    if loaded.sources.get("server.api_key") == "command line":
        from loguru import logger

        logger.warning(
            "the API key came by --api-key, which any user of this machine can read in `ps`; "
            "set SEMANTIC_SERVER_API_KEY or server.api_key in a --config file instead"
        )
    _ensure_default_model(settings)
    if rank > 0:  # under mlx.launch: rank 0 serves, this rank runs its shard of every tick
        from semantic.server import run_follower

        _exit_now(run_follower(_system_config(settings)))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    code = run_server(_system_config(settings), settings)
    _exit_now(code)


def _group_rank() -> int:
    """This process's rank in the group mlx.launch started (0 when it runs alone)."""
    from semantic.engine.group.distributed import launched_group

    group = launched_group()
    return group.rank() if group is not None else 0


def _exit_now(code: int) -> None:
    """Exit without running C++ static destructors once shutdown is complete.

    Every cache is flushed and fsynced by now. MLX's CPU stream threads can abort the process at
    interpreter teardown ("terminate called without an active exception", seen as exit -6 in CI),
    which would turn a clean shutdown into a crash for supervisors.
    """
    import os

    from loguru import logger

    logger.complete()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def show_config(args: argparse.Namespace) -> None:
    loaded = load_settings_from(args)
    print(loaded.describe())
    print(f"# {_system_config(loaded.settings).engine.profile.describe()}")


async def _generate(args: argparse.Namespace, settings: Settings) -> None:
    from semantic import AgentId, AgentSystem, SamplingParams, TokenDelta, TurnRequest

    system = AgentSystem(_system_config(settings))
    await system.start()
    try:
        sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        agent = AgentId(args.agent) if args.agent else None
        turn = TurnRequest("generate", agent, [{"role": "user", "content": args.prompt}], sampling)
        started = await system.start_turn(turn)
        async for event in started.stream:
            if isinstance(event, TokenDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        await system.stop()


def generate(args: argparse.Namespace) -> None:
    settings = load_settings_from(args).settings
    _ensure_default_model(settings)
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    from semantic.storage.cache_dir_lock import CacheDirBusyError, CacheDirLock, LockFileError, LockHolder

    try:  # it writes caches and conversations like a server: one writer per cache dir
        with CacheDirLock(_cache_dir(settings), LockHolder(os.getpid(), "command")):
            asyncio.run(_generate(args, settings))
    except CacheDirBusyError as error:
        raise SystemExit(f"semantic generate: {error}; ask that server instead") from None
    except LockFileError as error:
        raise SystemExit(f"semantic generate: {error}") from None


def fetch_model(args: argparse.Namespace) -> None:
    from semantic.engine.model.default_model import ensure_default_model

    settings = load_settings_from(args).settings
    models_dir = _models_dir(settings)
    print(ensure_default_model(settings.model.dtype, progress=_progress_bar(), models_dir=models_dir))


def _version() -> str:
    from semantic import __version__

    return __version__


def main(argv: list[str] | None = None) -> None:
    reexec_with_fast_blas()
    parser = argparse.ArgumentParser(prog="semantic", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve the HTTP API")
    add_settings_args(serve_parser, server=True)
    serve_parser.set_defaults(run=serve)

    config_parser = commands.add_parser(
        "config", help="print the effective configuration and where each value came from"
    )
    add_settings_args(config_parser, server=True)
    config_parser.set_defaults(run=show_config)

    generate_parser = commands.add_parser("generate", help="print one answer as it streams")
    add_settings_args(generate_parser, server=False)
    generate_parser.add_argument("prompt")
    generate_parser.add_argument("--max-tokens", type=int, default=256)
    generate_parser.add_argument("--temperature", type=float, default=0.0)
    generate_parser.add_argument("--agent", default=None, help="agent id whose cache to use and keep")
    generate_parser.set_defaults(run=generate)

    fetch_parser = commands.add_parser("fetch-model", help="fetch and convert the default model")
    add_settings_args(fetch_parser, server=False)  # --dtype, --cache-dir and --models-dir decide where
    fetch_parser.set_defaults(run=fetch_model)

    add_service_parser(commands)
    add_agents_parsers(commands)
    add_doctor_parser(commands)

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
