"""The aiohttp application: routes, and the agent system as a cleanup context."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler

from actors.system import AgentSystem, SystemConfig
from protocols import agents, anthropic, openai
from protocols.common import SETTINGS_KEY, SYSTEM_KEY, ServerSettings


async def health_live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def health_ready(request: web.Request) -> web.Response:
    system = request.app[SYSTEM_KEY]
    if not system.engine.is_running:
        return web.json_response({"status": "unavailable", "reason": "engine not running"}, status=503)
    return web.json_response({"status": "ok", "model": system.engine.model.name})


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(openai.model_list(request.app[SYSTEM_KEY]))


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
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    anthropic.add_routes(app)
    agents.add_routes(app)
    return app
