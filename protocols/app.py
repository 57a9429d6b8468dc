"""The aiohttp application: routes, and the agent system as a cleanup context."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler

from actors.system import AgentSystem, ModelLoadError, ModelUnavailableError, SwapReport, SystemConfig
from engine.registry import UnknownModelError
from protocols import agents, anthropic, openai
from protocols.common import SETTINGS_KEY, SYSTEM_KEY, ServerSettings


async def health_live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def health_ready(request: web.Request) -> web.Response:
    system = request.app[SYSTEM_KEY]
    if not system.engine.is_running:
        return web.json_response({"status": "unavailable", "reason": "engine not running"}, status=503)
    if system.is_switching:
        target = system.transition_target
        reason = f"switching the model to {target}" if target else "unloading the model"
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)
    if system.model_entry is None:  # unloaded while idle: the next request loads it again
        return web.json_response({"status": "ok", "model": None, "loaded": False})
    return web.json_response({"status": "ok", "model": system.model_entry.name, "loaded": True})


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(openai.model_list(request.app[SYSTEM_KEY]))


class LoadModel(msgspec.Struct, forbid_unknown_fields=True):
    model: str


async def load_model(request: web.Request) -> web.Response:
    """Switch the loaded model now (drain, flush, unload, load); 200 with the swap's phases."""
    system = request.app[SYSTEM_KEY]
    try:
        body = msgspec.json.decode(await request.read(), type=LoadModel)
        entry = system.registry.resolve(body.model) or system.model_entry
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        return agents.error_response(400, f"invalid request body: {error}", "invalid_request_error")
    except UnknownModelError as error:
        return agents.error_response(404, str(error), "not_found_error")
    if entry is None:
        return agents.error_response(
            400, f"{body.model!r} means the loaded model; none is loaded", "invalid_request_error"
        )
    try:
        report = await system.swap_model(entry.name)
    except ModelLoadError as error:
        return agents.error_response(500, str(error), "model_load_error")
    except ModelUnavailableError as error:
        return agents.error_response(503, str(error), "overloaded_error")
    return web.json_response({"model": entry.name, "loaded": True, "swap": _report(report)})


async def unload_model(request: web.Request) -> web.Response:
    """Flush every agent's cache and drop the model; the next request loads it again."""
    system = request.app[SYSTEM_KEY]
    report = await system.unload_model()
    memory = {"active_memory_before_first_load": system.active_memory_before_load}
    return web.json_response({"loaded": False, "swap": _report(report), **memory})


def _report(report: SwapReport | None) -> dict[str, object] | None:
    return None if report is None else dataclasses.asdict(report)


@web.middleware
async def errors_in_protocol_shape(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413 body too large) in the error shape of the API called."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = (
            f"{error.reason}: {error.text}" if error.text and error.text != error.reason else error.reason
        )
        if error.status == 413:
            message = f"request body too large: {error.text}"
        if request.path.startswith("/v1/messages"):
            return anthropic.error_response(error.status, message)
        if request.path.startswith("/v1/chat") or request.path == "/v1/models":
            return openai.error_response(error.status, message, kind="invalid_request_error")
        return agents.error_response(error.status, message, kind="http_error")


def create_app(config: SystemConfig, settings: ServerSettings | None = None) -> web.Application:
    app = web.Application(client_max_size=32 * 2**20, middlewares=[errors_in_protocol_shape])
    app[SYSTEM_KEY] = AgentSystem(config)
    app[SETTINGS_KEY] = settings or ServerSettings()

    async def agent_system(app: web.Application) -> AsyncIterator[None]:
        await app[SYSTEM_KEY].start()
        yield
        await app[SYSTEM_KEY].stop()

    app.cleanup_ctx.append(agent_system)
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/admin/models/load", load_model)
    app.router.add_post("/admin/models/unload", unload_model)
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    anthropic.add_routes(app)
    agents.add_routes(app)
    return app
