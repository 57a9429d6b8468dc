"""The `semantic` command: `serve` the HTTP API, `generate` one answer, `fetch-model`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from semantic.launch import reexec_with_fast_blas

if TYPE_CHECKING:
    from actors.system import SystemConfig
    from engine.default_model import ProgressFn
    from protocols.common import ServerSettings


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), a local MLX model dir or a hub id",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="where models and agent caches live")
    parser.add_argument("--cache-budget-mb", type=int, default=4096, help="memory for KV caches, in MiB")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    parser.add_argument("--max-batch-size", type=int, default=16, help="sequences decoding together")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="default model conversion dtype"
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize the KV cache (refused at start-up where mlx-lm cannot batch it)",
    )


def _system_config(args: argparse.Namespace) -> SystemConfig:
    from actors.system import SystemConfig
    from engine.default_model import user_cache_dir
    from engine.engine import EngineConfig
    from engine.registry import ModelEntry

    _refuse_kv_bits(getattr(args, "kv_bits", None))
    engine = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        cache_budget_mb=args.cache_budget_mb,
        max_batch_size=args.max_batch_size,
        default_dtype=args.dtype,
    )
    extra_models = []
    for spec in getattr(args, "add_model", []):
        name, _, source = spec.partition("=")
        if not name or not source:
            raise SystemExit(f"--add-model wants NAME=SOURCE (a local MLX dir or a hub id), got {spec!r}")
        extra_models.append(ModelEntry(name, source))
    aliases = {}
    for alias in getattr(args, "alias", []):
        pattern, _, target = alias.partition("=")
        if not pattern:
            raise SystemExit(f"--alias wants NAME=MODEL (NAME may be a glob), got {alias!r}")
        aliases[pattern] = target
    return SystemConfig(
        engine=engine,
        cache_dir=args.cache_dir or user_cache_dir(),
        extra_models=tuple(extra_models),
        model_aliases=aliases,
        idle_unload_s=getattr(args, "idle_unload_s", None),
        swap_drain_timeout_s=getattr(args, "swap_drain_timeout_s", 30.0),
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


def _ensure_default_model(args: argparse.Namespace) -> None:
    from engine.default_model import ensure_default_model
    from engine.loading import is_default_model

    if is_default_model(args.model):
        ensure_default_model(args.dtype, progress=_progress_bar())


def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from protocols.app import create_app

    _ensure_default_model(args)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"refusing to bind {args.host}: only loopback is allowed in this version", file=sys.stderr)
        raise SystemExit(2)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    app = create_app(_system_config(args), _server_settings(args))
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        print=lambda s: print(s, file=sys.stderr),
    )
    _exit_now(0)


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


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    from protocols.common import ServerSettings

    return ServerSettings(default_max_tokens=args.default_max_tokens, default_temperature=args.temperature)


async def _generate(args: argparse.Namespace) -> None:
    from actors.system import AgentSystem
    from engine.messages import TokenDelta
    from engine.sampling import SamplingParams

    system = AgentSystem(_system_config(args))
    await system.start()
    try:
        tokenizer = system.engine.model.tokenizer
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
        sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        stream = await system.generate(args.agent, prompt, sampling)
        async for event in stream:
            if isinstance(event, TokenDelta):
                sys.stdout.write(event.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        await system.stop()


def generate(args: argparse.Namespace) -> None:
    _ensure_default_model(args)
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    asyncio.run(_generate(args))


def fetch_model(args: argparse.Namespace) -> None:
    from engine.default_model import ensure_default_model

    print(ensure_default_model(args.dtype, progress=_progress_bar()))


def main(argv: list[str] | None = None) -> None:
    reexec_with_fast_blas()
    parser = argparse.ArgumentParser(prog="semantic", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve the HTTP API")
    _engine_args(serve_parser)
    serve_parser.add_argument("--host", default="127.0.0.1")
    serve_parser.add_argument("--port", type=int, default=8000)
    serve_parser.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="answer requests for model NAME (a glob, e.g. 'claude-haiku*') with MODEL, a configured "
        "model's name, or with whichever model is loaded when MODEL is empty",
    )
    serve_parser.add_argument(
        "--add-model",
        action="append",
        default=[],
        metavar="NAME=SOURCE",
        help="another model requests may switch to by NAME (SOURCE: a local MLX dir or a hub id)",
    )
    serve_parser.add_argument(
        "--idle-unload-s",
        type=float,
        default=None,
        help="unload the model after this many seconds without requests (reloaded on the next one)",
    )
    serve_parser.add_argument(
        "--swap-drain-timeout-s",
        type=float,
        default=30.0,
        help="how long running requests may finish before a model swap cancels them",
    )
    serve_parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature for requests that do not set one (Claude Code never does)",
    )
    serve_parser.add_argument(
        "--default-max-tokens", type=int, default=1024, help="max_tokens for requests that do not set it"
    )
    serve_parser.set_defaults(run=serve)

    generate_parser = commands.add_parser("generate", help="print one answer as it streams")
    _engine_args(generate_parser)
    generate_parser.add_argument("prompt")
    generate_parser.add_argument("--max-tokens", type=int, default=256)
    generate_parser.add_argument("--temperature", type=float, default=0.0)
    generate_parser.add_argument("--agent", default=None, help="agent id whose cache to use and keep")
    generate_parser.set_defaults(run=generate)

    fetch_parser = commands.add_parser("fetch-model", help="fetch and convert the default model")
    fetch_parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    fetch_parser.set_defaults(run=fetch_model)

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
