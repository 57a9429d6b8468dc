"""The processes: rank 0 (or a lone process) serves HTTP until SIGTERM/SIGINT and shuts down
gracefully; under mlx.launch every other rank follows rank 0's engine (`run_follower`).

On the first signal: new requests get 503 with Retry-After, running ones get up to
`server.shutdown_timeout_s` to finish and are then cancelled with an error, every hot cache is
flushed to disk, and the process exits 0. A second signal exits at once; cache files already on
disk stay valid (each is written atomically). In a group the followers ignore the first signal
(rank 0's shutdown, which they follow, flushes their shards too); when a rank is lost every
process stops with status 3 (`EXIT_GROUP_LOST`) after failing what ran.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

from aiohttp import web
from loguru import logger

from semantic.actors.model_registry import ModelEntry
from semantic.actors.system import SystemConfig
from semantic.engine.group.distributed import (
    EXIT_GROUP_LOST,
    Collectives,
    GroupLostError,
    heartbeat_s,
    launched_group,
    layout_of,
)
from semantic.engine.group.follower_loop import FollowerLoop
from semantic.engine.group.lockstep import Follower, GroupDivergedError
from semantic.engine.loop.commands import Drain
from semantic.engine.loop.config import EngineStats
from semantic.protocols.app import create_app
from semantic.protocols.common import GATE_KEY, SYSTEM_KEY
from semantic.protocols.connections import CappedSite
from semantic.protocols.settings import Settings
from semantic.storage.cache_dir_lock import CacheDirBusyError, CacheDirLock, LockFileError, LockHolder
from semantic.storage.shard_files import ShardFiles

HANDLER_GRACE_S = 5.0  # after the engine is drained, for handlers to write their last events


async def serve_until_signalled(config: SystemConfig, settings: Settings) -> int:
    app = create_app(config, settings)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        handle_signals=False,
        shutdown_timeout=2.0,
        keepalive_timeout=settings.server.keepalive_timeout_s,
    )
    await runner.setup()
    site = CappedSite(runner, settings.server)  # the connection cap and head deadline
    await site.start()
    logger.info("serving on http://{}:{}", settings.server.host, settings.server.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("second {}: exiting now (caches already on disk stay valid)", sig.name)
            logger.complete()
            os._exit(128 + sig.value)
        logger.info("{}: shutting down gracefully (again to exit at once)", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    gate, system = app[GATE_KEY], app[SYSTEM_KEY]
    group_lost = system.engine.group_lost
    waits = [asyncio.ensure_future(stop.wait())]
    if group_lost is not None:
        waits.append(asyncio.ensure_future(group_lost.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if group_lost is not None and group_lost.is_set():
        logger.error("a rank of the group was lost: stopping (cache files already on disk stay valid)")
        gate.is_shutting_down = True
        await asyncio.sleep(HANDLER_GRACE_S / 5)  # handlers write the error events the engine posted
        await site.stop()
        return EXIT_GROUP_LOST

    gate.is_shutting_down = True
    system.models.begin_shutdown()  # a swap under way loads nothing; requests waiting on it get 503
    timeout_s = settings.server.shutdown_timeout_s
    if system.engine.loaded is not None and system.engine.is_running:
        num_cancelled = await system.engine.ask(Drain(timeout_s, "the server is shutting down"))
        if num_cancelled:
            logger.warning("cancelled {} requests still running after {:g} s", num_cancelled, timeout_s)
    deadline = time.monotonic() + HANDLER_GRACE_S
    while gate.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await runner.cleanup()  # closes the listener and connections, then stops the system (flush)
    logger.info("shut down cleanly")
    return 0


def run_server(config: SystemConfig, settings: Settings) -> int:
    """Serve while holding the cache dir's lock (a follower rank writes only its own `rank-r-of-n/`
    folder, so rank 0's lock covers the group); refuse to start where another process holds it."""
    holder = LockHolder(os.getpid(), "server", settings.server.host, settings.server.port)
    try:
        with CacheDirLock(config.cache_dir, holder):
            _refuse_linked_folders(config.cache_dir)
            return asyncio.run(serve_until_signalled(config, settings))
    except CacheDirBusyError as error:
        raise SystemExit(
            f"semantic: refusing to serve: {error}; stop it first, or serve another --cache-dir"
        ) from None
    except LockFileError as error:
        raise SystemExit(f"semantic: refusing to serve: {error}") from None


def _refuse_linked_folders(cache_dir: Path) -> None:
    """The server writes only into folders of the cache dir's own: a link where `agents/`, a model's
    folder or `quarantine/` would be is refused at start, saying which, rather than written through."""
    from semantic.storage.cache_dir_files import linked_folders

    linked = linked_folders(cache_dir)
    if linked:
        raise SystemExit(
            f"semantic: refusing to serve: {linked[0]} is a symbolic link, and semantic never follows "
            "links out of the cache dir: make it a folder of its own, or point --cache-dir at the real one"
        )


def run_follower(config: SystemConfig) -> int:
    """A rank other than 0: load its shard with rank 0 and run rank 0's ticks until it shuts down."""
    group = launched_group()
    assert group is not None and group.rank() > 0, "run_follower outside a group: caller bug"
    engine_config = replace(
        config.engine, model_name=ModelEntry.from_source(config.engine.model, config.engine.model_name).name
    )
    layout = layout_of(group, engine_config.pipeline)
    collectives = Collectives(group, engine_config.rank_timeout_s)
    files = ShardFiles(config.cache_dir, layout)
    follower = Follower(collectives, layout, files, heartbeat_s(engine_config.rank_timeout_s))
    core = FollowerLoop(engine_config, EngineStats(), follower)
    _follow_signals(layout.rank)
    logger.info(
        "rank {} of {} ({} parallel, {}): following rank 0",
        layout.rank,
        layout.size,
        layout.parallel,
        layout.backend,
    )
    try:
        core.follow()
    except (GroupLostError, GroupDivergedError) as error:
        logger.error("rank {}: {}; stopping (cache files already on disk stay valid)", layout.rank, error)
        return EXIT_GROUP_LOST
    logger.info("rank {}: rank 0 shut the group down", layout.rank)
    return 0


def _follow_signals(rank: int) -> None:
    """The first SIGTERM/SIGINT is left to rank 0 (mlx.launch sends it to every rank): its shutdown
    flushes this rank's shards too. A second one exits at once."""
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if received:
            logger.warning("rank {}: second signal, exiting now", rank)
            logger.complete()
            os._exit(128 + signum)
        received.append(signum)
        logger.info("rank {}: {}: following rank 0's shutdown", rank, signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
