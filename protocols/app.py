"""The aiohttp application: routes, and the agent system as a cleanup context."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web
from loguru import logger

from semantic.actors.heap import give_memory_back_when_idle, keep_heap_ready
from semantic.actors.interface import ServerView
from semantic.actors.system import AgentSystem, SystemConfig
from semantic.protocols import admin, agents, anthropic, completions, model_cards, openai, openapi
from semantic.protocols.common import GATE_KEY, METRICS_KEY, SETTINGS_KEY, SYSTEM_KEY
from semantic.protocols.connections import body_in_time, requests_in_connection
from semantic.protocols.errors import errors_in_protocol_shape
from semantic.protocols.guard import Gate
from semantic.protocols.metrics import Metrics
from semantic.protocols.observe import add_request_id_header, observed
from semantic.protocols.settings import Settings

STARTED_KEY = web.AppKey("started", dict[str, float])


async def health_live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def health_startup(request: web.Request) -> web.Response:
    """200 once the model is loaded and the agent system runs (the server listens only after)."""
    started = request.app[STARTED_KEY]
    return web.json_response({"status": "started", "startup_s": round(started["startup_s"], 3)})


async def health_ready(request: web.Request) -> web.Response:
    system = request.app[SYSTEM_KEY]
    if request.app[GATE_KEY].is_shutting_down:
        return web.json_response(
            {"status": "unavailable", "reason": "shutting down"}, status=503, headers={"Retry-After": "5"}
        )
    view = ServerView(system)
    if not view.engine_running:
        return web.json_response({"status": "unavailable", "reason": "engine not running"}, status=503)
    if system.models.is_switching:
        target = system.models.transition_target
        reason = f"switching the model to {target}" if target else "unloading the model"
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)
    group = view.group_report()
    extra: dict[str, object] = {"backend": msgspec.to_builtins(view.backend_profile)}
    if group is not None:
        extra["group"] = group
    if system.models.entry is None:  # unloaded while idle: the next request loads it again
        return web.json_response({"status": "ok", "model": None, "loaded": False, **extra})
    return web.json_response({"status": "ok", "model": system.models.entry.name, "loaded": True, **extra})


def create_app(config: SystemConfig, settings: Settings | None = None) -> web.Application:
    settings = settings or Settings()
    app = web.Application(
        client_max_size=int(settings.server.max_body_mb * 2**20),
        middlewares=[requests_in_connection, errors_in_protocol_shape, observed, body_in_time],
    )
    app[SYSTEM_KEY] = AgentSystem(config)
    app[SETTINGS_KEY] = settings
    app[GATE_KEY] = Gate(settings)
    app[METRICS_KEY] = Metrics()
    app[STARTED_KEY] = {}
    app.on_response_prepare.append(add_request_id_header)

    async def agent_system(app: web.Application) -> AsyncIterator[None]:
        started = time.monotonic()
        system = app[SYSTEM_KEY]
        await system.start()
        # The heap faulted in ahead of the turns (actors/heap.py): on the CPU only, where the
        # arrays live on this heap (the backend profile says so).
        reserve_bytes = config.engine.profile.heap_reserve_mb << 20
        if await asyncio.get_running_loop().run_in_executor(None, keep_heap_ready, reserve_bytes):
            logger.debug("{} MB of heap faulted in, ready for the first turns", reserve_bytes >> 20)
        app[STARTED_KEY]["startup_s"] = time.monotonic() - started
        metrics = app[METRICS_KEY]
        metrics.attach(system, lambda: app[GATE_KEY].num_in_flight)

        def quiet_for_s() -> float:
            """No request in flight, and no idle checkpoint's copies of caches freed, for this long."""
            return min(app[GATE_KEY].quiet_for_s(), time.monotonic() - system.models.last_checkpoint_at)

        housekeeping = [
            asyncio.create_task(metrics.watch_loop_lag()),
            asyncio.create_task(give_memory_back_when_idle(quiet_for_s, reserve_bytes)),
        ]
        yield
        for task in housekeeping:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await system.stop()

    app.cleanup_ctx.append(agent_system)
    app.router.add_get("/health", health_live)  # what mlx_lm.server answers at
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/health/startup", health_startup)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/metrics", app[METRICS_KEY].handle)
    app.router.add_get("/openapi.json", openapi.handle)
    app.router.add_post("/admin/models/load", admin.load_model)
    app.router.add_post("/admin/models/unload", admin.unload_model)
    model_cards.add_routes(app)
    openai.add_routes(app)
    completions.add_routes(app)
    anthropic.add_routes(app)
    agents.add_routes(app)
    return app
