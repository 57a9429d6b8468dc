"""`GET /v1/models` and `GET /v1/models/{model_id}`: the configured models, in the shape both
OpenAI's and Anthropic's SDKs read, with which is loaded."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from semantic.actors.interface import ModelEntry, ServerView
from semantic.protocols.common import SYSTEM_KEY


def _card(entry: ModelEntry, loaded: ModelEntry | None, group: dict[str, Any] | None) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": entry.name,
        "object": "model",
        "type": "model",
        "display_name": entry.name,
        "created": 0,
        "created_at": "1970-01-01T00:00:00Z",
        "owned_by": "semantic",
        "source": entry.source,
        "aliases": list(entry.aliases),
        "loaded": entry == loaded,
    }
    if group is not None and card["loaded"]:
        card["group"] = group
    return card


async def list_models(request: web.Request) -> web.Response:
    models = request.app[SYSTEM_KEY].models
    group = ServerView(request.app[SYSTEM_KEY]).group_report()
    data = [_card(entry, models.entry, group) for entry in models.registry.entries]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
            "loaded_model_aliases": models.registry.loaded_aliases,
        }
    )


async def get_model(request: web.Request) -> web.Response:
    """One model by name or alias (a loaded-model alias such as `default` gives the loaded one)."""
    models = request.app[SYSTEM_KEY].models
    entry = models.registry.resolve(request.match_info["model_id"]) or models.entry
    if entry is None:
        raise web.HTTPNotFound(text="no model is loaded")
    return web.json_response(_card(entry, models.entry, ServerView(request.app[SYSTEM_KEY]).group_report()))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)  # a hub id has a "/"
