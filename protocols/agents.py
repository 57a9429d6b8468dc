"""The direct agent API: the server keeps each agent's conversation; clients send only what is new.

POST   /v1/agents                  create, with an optional id and system prompt
GET    /v1/agents                  list: cached tokens, tier, last use
GET    /v1/agents/{id}             one agent
DELETE /v1/agents/{id}             forget it (memory and disk)
POST   /v1/agents/{id}/messages    a turn, JSON or SSE (`stream: true`)
POST   /v1/agents/{id}/evict       write its cache to disk and free its memory
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from semantic.actors.agent import AgentStoppedError, MailboxFullError
from semantic.actors.identity import InvalidAgentIdError, validate_agent_id
from semantic.actors.system import AgentInfo, ModelUnavailableError
from semantic.engine.chat_format import ChatTemplateError
from semantic.engine.engine import ModelChangedError, PromptTooLongError
from semantic.engine.messages import Finished, PromptStarted, TokenDelta
from semantic.engine.registry import UnknownModelError
from semantic.engine.sampling import SamplingParams
from semantic.protocols.common import SETTINGS_KEY, SYSTEM_KEY, ready_model, sse_response
from semantic.protocols.errors import ApiError
from semantic.protocols.errors import agent_error as error_response
from semantic.protocols.observe import admit, check_bounds, watch


class CreateAgent(msgspec.Struct):
    id: str | None = None
    system: str | None = None
    model: str | None = None


class InputMessage(msgspec.Struct):
    role: str
    content: str


class AgentTurn(msgspec.Struct):
    content: str | None = None
    messages: list[InputMessage] | None = None
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    seed: int | None = None
    model: str | None = None  # a configured model to switch to first; None: the loaded one


class TurnUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_tier: str


class TurnResult(msgspec.Struct):
    id: str
    agent_id: str
    content: str
    finish_reason: str
    stop_sequence: str | None
    usage: TurnUsage


_decode_create = msgspec.json.Decoder(CreateAgent).decode
_decode_turn = msgspec.json.Decoder(AgentTurn).decode
_encode = msgspec.json.Encoder().encode


def _agent_json(info: AgentInfo) -> dict[str, Any]:
    return {
        "id": info.agent_id,
        "cached_tokens": info.num_cached_tokens,
        "tier": info.tier,
        "last_used_s_ago": None if info.last_used_s_ago is None else round(info.last_used_s_ago, 3),
    }


async def create_agent(request: web.Request) -> web.Response:
    system = request.app[SYSTEM_KEY]
    try:
        body = _decode_create(await request.read() or b"{}")
        agent_id = validate_agent_id(body.id) if body.id is not None else f"agent-{uuid.uuid4().hex[:16]}"
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        return error_response(400, f"invalid request body: {error}")
    except InvalidAgentIdError as error:
        return error_response(400, str(error))
    if await system.agent_info(agent_id) is not None:
        return error_response(409, f"agent {agent_id} already exists; DELETE it first", "conflict_error")
    try:
        model = await ready_model(system, body.model)
        await system.open_agent(agent_id, body.system)
    except UnknownModelError as error:
        return error_response(404, str(error), "not_found_error")
    except ModelUnavailableError as error:
        return error_response(503, str(error), "overloaded_error")
    return web.json_response({"id": agent_id, "system": body.system, "model": model.name}, status=201)


async def list_agents(request: web.Request) -> web.Response:
    infos = await request.app[SYSTEM_KEY].list_agents()
    return web.json_response({"object": "list", "data": [_agent_json(i) for i in infos]})


async def get_agent(request: web.Request) -> web.Response:
    info = await request.app[SYSTEM_KEY].agent_info(request.match_info["agent_id"])
    if info is None:
        return error_response(404, f"no agent {request.match_info['agent_id']}", "not_found_error")
    return web.json_response(_agent_json(info))


async def delete_agent(request: web.Request) -> web.Response:
    agent_id = request.match_info["agent_id"]
    if not await request.app[SYSTEM_KEY].forget_agent(agent_id):
        return error_response(404, f"no agent {agent_id}", "not_found_error")
    return web.json_response({"id": agent_id, "deleted": True})


async def evict_agent(request: web.Request) -> web.Response:
    agent_id = request.match_info["agent_id"]
    try:
        evicted = await request.app[SYSTEM_KEY].evict(validate_agent_id(agent_id))
    except InvalidAgentIdError as error:
        return error_response(400, str(error))
    except MailboxFullError as error:
        return error_response(429, str(error), "rate_limit_error")
    return web.json_response({"id": agent_id, "evicted": evicted})


async def post_message(request: web.Request) -> web.StreamResponse:
    system = request.app[SYSTEM_KEY]
    settings = request.app[SETTINGS_KEY]
    agent_id = request.match_info["agent_id"]
    try:
        validate_agent_id(agent_id)
        body = _decode_turn(await request.read())
        sampling = SamplingParams(
            temperature=settings.model.temperature if body.temperature is None else body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_tokens or settings.model.default_max_tokens,
            stop=tuple(body.stop),
            seed=body.seed,
        )
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        return error_response(400, f"invalid request body: {error}")
    except (InvalidAgentIdError, ValueError) as error:
        return error_response(400, str(error))
    if body.messages:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
    elif body.content is not None:
        messages = [{"role": "user", "content": body.content}]
    else:
        return error_response(400, "send `content` (a user message) or `messages`")
    check_bounds(request, max_tokens=body.max_tokens, num_messages=len(messages))
    turn_id = f"turn-{uuid.uuid4().hex}"
    try:
        await ready_model(system, body.model)
        admit(request, agent_id)
        stream = watch(request, await system.converse(agent_id, messages, sampling, turn_id))
    except (PromptTooLongError, ChatTemplateError) as error:
        return error_response(400, str(error))
    except UnknownModelError as error:
        return error_response(404, str(error), "not_found_error")
    except (ModelUnavailableError, ModelChangedError) as error:
        return error_response(503, str(error), "overloaded_error")
    except MailboxFullError as error:
        return error_response(429, str(error), "rate_limit_error")
    except AgentStoppedError as error:
        return error_response(503, str(error), "overloaded_error")

    tier = "none"
    if not body.stream:
        parts: list[str] = []
        finished: Finished | None = None
        try:
            async for event in stream:
                if isinstance(event, PromptStarted):
                    tier = event.cache_tier
                elif isinstance(event, TokenDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    finished = event
        except ValueError as error:
            return error_response(400, str(error))
        except ApiError:
            raise
        except Exception as error:
            return error_response(500, f"generation failed: {error}", "api_error")
        assert finished is not None
        result = _result(turn_id, agent_id, "".join(parts), finished, tier)
        return web.Response(body=_encode(result), content_type="application/json")

    response = await sse_response(request)

    async def send(event: str, data: Any) -> None:
        await response.write(f"event: {event}\ndata: ".encode() + _encode(data) + b"\n\n")

    text: list[str] = []
    try:
        async for event in stream:
            if isinstance(event, PromptStarted):
                tier = event.cache_tier
                await send(
                    "start",
                    {
                        "id": turn_id,
                        "agent_id": agent_id,
                        "prompt_tokens": event.num_prompt_tokens,
                        "cached_tokens": event.num_cached_tokens,
                        "cache_tier": tier,
                        "created": int(time.time()),
                    },
                )
            elif isinstance(event, TokenDelta) and event.text:
                text.append(event.text)
                await send("delta", {"text": event.text})
            elif isinstance(event, Finished):
                await send("done", _result(turn_id, agent_id, "".join(text), event, tier))
    except Exception as error:  # the stream has started: report in-band, then end it
        await send("error", {"error": {"type": "api_error", "message": str(error)}})
    await response.write_eof()
    return response


def _result(turn_id: str, agent_id: str, content: str, finished: Finished, tier: str) -> TurnResult:
    usage = TurnUsage(
        finished.num_prompt_tokens, finished.num_generated_tokens, finished.num_cached_tokens, tier
    )
    return TurnResult(turn_id, agent_id, content, finished.reason.value, finished.stop_sequence, usage)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/agents", create_agent)
    app.router.add_get("/v1/agents", list_agents)
    app.router.add_get("/v1/agents/{agent_id}", get_agent)
    app.router.add_delete("/v1/agents/{agent_id}", delete_agent)
    app.router.add_post("/v1/agents/{agent_id}/messages", post_message)
    app.router.add_post("/v1/agents/{agent_id}/evict", evict_agent)
