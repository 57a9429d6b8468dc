"""Run the HTTP server until SIGTERM/SIGINT, then shut down gracefully.

On the first signal: new requests get 503 with Retry-After, running ones get up to
`server.shutdown_timeout_s` to finish and are then cancelled with an error, every hot cache is
flushed to disk, and the process exits 0. A second signal exits at once; cache files already on
disk stay valid (each is written atomically).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from aiohttp import web
from loguru import logger

from semantic.actors.system import SystemConfig
from semantic.config import Settings
from semantic.engine.commands import Drain
from semantic.protocols.app import create_app
from semantic.protocols.common import GATE_KEY, SYSTEM_KEY

HANDLER_GRACE_S = 5.0  # after the engine is drained, for handlers to write their last events


async def serve_until_signalled(config: SystemConfig, settings: Settings) -> int:
    app = create_app(config, settings)
    runner = web.AppRunner(app, handler_cancellation=True, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port)
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
    await stop.wait()

    gate, system = app[GATE_KEY], app[SYSTEM_KEY]
    gate.is_shutting_down = True
    timeout_s = settings.server.shutdown_timeout_s
    if system.engine.loaded is not None:
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
    return asyncio.run(serve_until_signalled(config, settings))
