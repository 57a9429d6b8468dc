"""Model administration: switch the loaded model, or unload it until the next request."""

from __future__ import annotations

import dataclasses

import msgspec
from aiohttp import web

from semantic.actors.interface import UnknownModelError
from semantic.actors.model_session import ModelLoadError, ModelUnavailableError, SwapReport
from semantic.protocols.common import SYSTEM_KEY
from semantic.protocols.errors import agent_error
from semantic.protocols.tenancy import require_admin


class LoadModelBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str


async def load_model(request: web.Request) -> web.Response:
    """Switch the loaded model now (drain, flush, unload, load); 200 with the swap's phases."""
    require_admin(request)
    system = request.app[SYSTEM_KEY]
    try:
        body = msgspec.json.decode(await request.read(), type=LoadModelBody)
        entry = system.models.registry.resolve(body.model) or system.models.entry
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        return agent_error(400, f"invalid request body: {error}", "invalid_request_error")
    except UnknownModelError as error:
        return agent_error(404, str(error), "not_found_error")
    if entry is None:
        return agent_error(
            400, f"{body.model!r} means the loaded model; none is loaded", "invalid_request_error"
        )
    try:
        report = await system.models.swap(entry.name)
    except ModelLoadError as error:
        return agent_error(500, str(error), "model_load_error")
    except ModelUnavailableError as error:
        return agent_error(503, str(error), "overloaded_error")
    return web.json_response({"model": entry.name, "loaded": True, "swap": _report(report)})


async def unload_model(request: web.Request) -> web.Response:
    """Flush every agent's cache and drop the model; the next request loads it again."""
    require_admin(request)
    system = request.app[SYSTEM_KEY]
    report = await system.models.unload()
    memory = {"active_memory_before_first_load": system.models.active_memory_before_load}
    return web.json_response({"loaded": False, "swap": _report(report), **memory})


def _report(report: SwapReport | None) -> dict[str, object] | None:
    return None if report is None else dataclasses.asdict(report)
