"""The direct agent API: the server keeps each agent's conversation; clients send only what is new.

POST   /v1/agents                  create, with an optional id and system prompt
GET    /v1/agents                  list: cached tokens, tier, last use
GET    /v1/agents/{id}             one agent
DELETE /v1/agents/{id}             forget it (memory and disk); its running and queued turns fail
POST   /v1/agents/{id}/messages    a turn, JSON or SSE (`stream: true`)
POST   /v1/agents/{id}/evict       write its cache to disk and free its memory

With an API keys file each key sees only its own namespace's agents (protocols/tenancy.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from semantic.actors.agent_messages import AgentExistsError
from semantic.actors.interface import AgentId, Finished, PromptStarted
from semantic.actors.system import AgentInfo
from semantic.actors.turns import TurnRequest, TurnStarted
from semantic.protocols.answer_turn import TurnEvent, TurnReply, answer_turn
from semantic.protocols.common import GATE_KEY, SYSTEM_KEY, SseWriter, json_response
from semantic.protocols.errors import ApiError, NotFound
from semantic.protocols.tenancy import CacheSalt, client_agent_id, is_admin, is_visible, scoped_cache_salt
from semantic.protocols.tool_parser import TextPart
from semantic.protocols.wire_sampling import SamplingFields, sampling_of

PING_FRAME = b": ping\n\n"


class CreateAgent(msgspec.Struct):
    id: str | None = None
    system: str | None = None
    model: str | None = None


class InputMessage(msgspec.Struct):
    role: str
    content: str


class AgentTurn(SamplingFields):
    content: str | None = None
    messages: list[InputMessage] | None = None
    stream: bool = False
    max_tokens: int | None = None
    model: str | None = None  # a configured model to switch to first; None: the loaded one
    cache_salt: CacheSalt | None = None  # only turns with the same salt share prefix blocks


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


def _agent_json(info: AgentInfo) -> dict[str, Any]:
    shown = {
        "id": AgentId(info.agent_id).local_id,
        "cached_tokens": info.num_cached_tokens,
        "tier": info.tier,
        "last_used_s_ago": None if info.last_used_s_ago is None else round(info.last_used_s_ago, 3),
    }
    if info.num_turns is not None:
        shown["turns"] = info.num_turns
    return shown


def _agent_id(request: web.Request) -> AgentId:
    return client_agent_id(request, request.match_info["agent_id"])


async def create_agent(request: web.Request) -> web.Response:
    system = request.app[SYSTEM_KEY]
    body = _decode_create(await request.read() or b"{}")
    request.app[GATE_KEY].take_rate()  # each agent is a record on disk and an actor: as a generation
    agent_id = client_agent_id(request, body.id if body.id is not None else f"agent-{uuid.uuid4().hex[:16]}")
    session = await system.models.ready(body.model, may_switch=is_admin(request))
    try:  # the agent's actor checks and creates in one step: of racing creates, one wins
        await system.open_agent(agent_id, body.system)
    except AgentExistsError as error:
        raise ApiError(str(error), status=409) from None
    reply = {"id": agent_id.local_id, "system": body.system, "model": session.loaded.name}
    return json_response(reply, status=201)


async def list_agents(request: web.Request) -> web.Response:
    infos = await request.app[SYSTEM_KEY].list_agents()
    return json_response(
        {"object": "list", "data": [_agent_json(i) for i in infos if is_visible(request, i.agent_id)]}
    )


async def get_agent(request: web.Request) -> web.Response:
    agent_id = _agent_id(request)
    info = await request.app[SYSTEM_KEY].agent_info(agent_id)
    if info is None:
        raise NotFound(f"no agent {agent_id.local_id}")
    counts = request.app[SYSTEM_KEY].cache_notes.counts_of(agent_id)  # since the server started
    return json_response(_agent_json(info) | {"cache": counts.as_json() if counts is not None else None})


async def delete_agent(request: web.Request) -> web.Response:
    agent_id = _agent_id(request)
    if not await request.app[SYSTEM_KEY].forget(agent_id):
        raise NotFound(f"no agent {agent_id.local_id}")
    return json_response({"id": agent_id.local_id, "deleted": True})


async def evict_agent(request: web.Request) -> web.Response:
    agent_id = _agent_id(request)
    evicted = await request.app[SYSTEM_KEY].evict(agent_id)
    return json_response({"id": agent_id.local_id, "evicted": evicted})


async def post_message(request: web.Request) -> web.StreamResponse:
    agent_id = _agent_id(request)
    body = _decode_turn(await request.read())
    if body.messages:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
    elif body.content is not None:
        messages = [{"role": "user", "content": body.content}]
    else:
        raise ApiError("send `content` (a user message) or `messages`")
    sampling = sampling_of(request, body, body.max_tokens)
    turn = TurnRequest(
        f"turn-{uuid.uuid4().hex}",
        agent_id,
        messages,
        sampling,
        model=body.model,
        keeps_conversation=True,
        cache_salt=scoped_cache_salt(request, body.cache_salt),
    )

    def reply(_started: TurnStarted, sse: SseWriter | None) -> TurnReply:
        return AgentReply(turn.request_id, agent_id.local_id, sse)

    return await answer_turn(request, turn, body.stream, reply, PING_FRAME)


class AgentReply:
    """`event: start`, `event: delta` per piece of text, `event: done`; or the TurnResult as JSON."""

    def __init__(self, turn_id: str, agent_id: str, sse: SseWriter | None) -> None:
        self.turn_id = turn_id
        self.agent_id = agent_id
        self.sse = sse
        self.tier = "none"
        self.texts: list[str] = []
        self.result: TurnResult | None = None

    async def event(self, event: TurnEvent) -> None:
        match event:
            case PromptStarted():
                self.tier = event.cache_tier
                if self.sse is not None:
                    start = {
                        "id": self.turn_id,
                        "agent_id": self.agent_id,
                        "prompt_tokens": event.num_prompt_tokens,
                        "cached_tokens": event.num_cached_tokens,
                        "cache_tier": self.tier,
                        "created": int(time.time()),
                    }
                    await self.sse.event("start", start)
            case TextPart(text=text) if text:
                self.texts.append(text)
                if self.sse is not None:
                    await self.sse.event("delta", {"text": text})
            case Finished():
                usage = TurnUsage(
                    event.num_prompt_tokens, event.num_generated_tokens, event.num_cached_tokens, self.tier
                )
                self.result = TurnResult(
                    self.turn_id,
                    self.agent_id,
                    "".join(self.texts),
                    event.reason.value,
                    event.stop_sequence,
                    usage,
                )
                if self.sse is not None:
                    await self.sse.event("done", self.result)

    async def error(self, error: ApiError) -> None:
        if self.sse is None:
            raise error
        await self.sse.event("error", {"error": {"type": error.kind, "message": str(error)}})

    def body(self) -> TurnResult:
        assert self.result is not None, "turn ended without Finished: pipeline bug"
        return self.result


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/agents", create_agent)
    app.router.add_get("/v1/agents", list_agents)
    app.router.add_get("/v1/agents/{agent_id}", get_agent)
    app.router.add_delete("/v1/agents/{agent_id}", delete_agent)
    app.router.add_post("/v1/agents/{agent_id}/messages", post_message)
    app.router.add_post("/v1/agents/{agent_id}/evict", evict_agent)
