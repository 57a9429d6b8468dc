"""Anthropic Messages API: `POST /v1/messages` (SSE or JSON) and `POST /v1/messages/count_tokens`.

The handlers parse the body into a turn (`anthropic_wire`) and render its events as Anthropic's
content blocks (`anthropic_reply`); the pipeline does the rest.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from semantic.actors.interface import PromptTooLongError
from semantic.actors.turns import PromptLimitError, TurnRequest, TurnStarted, UnsupportedContentError
from semantic.protocols.answer_turn import TurnReply, answer_turn, sampling_params
from semantic.protocols.anthropic_reply import MessageReply, MessageStream, new_id
from semantic.protocols.anthropic_wire import (
    MessagesRequest,
    chat_and_breakpoints,
    decode_request,
    output_schema,
    split_prefill,
    tool_choice,
    tool_schemas,
)
from semantic.protocols.common import SYSTEM_KEY, SseWriter, json_response
from semantic.protocols.errors import ApiError
from semantic.protocols.observe import admit, check_bounds
from semantic.protocols.tenancy import is_admin, request_agent_id, scoped_cache_salt

PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'


class TokenCount(msgspec.Struct):
    input_tokens: int


def to_turn(request: web.Request, body: MessagesRequest, counting: bool = False) -> TurnRequest:
    """The turn a Messages request asks for, validated as Anthropic validates it."""
    if not body.messages:
        raise ApiError("messages: at least one message is required")
    if body.max_tokens is None and not counting:
        raise ApiError("max_tokens: Field required")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise ApiError(f"temperature: {body.temperature} is out of range: 0..1")
    messages, breakpoints = chat_and_breakpoints(body)
    if not messages:
        raise UnsupportedContentError("messages: none has content the model can read (only thinking blocks)")
    prefill = split_prefill(messages)
    sampling = sampling_params(  # the Messages API has no seed, penalties or logit bias
        request,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences),
    )
    return TurnRequest(
        request_id=new_id("msg_"),
        agent_id=request_agent_id(request),
        cache_salt=scoped_cache_salt(request, body.cache_salt),
        messages=messages,
        sampling=sampling,
        model=body.model,
        tools=tool_schemas(body.tools),
        tool_choice=tool_choice(body.tool_choice),
        prefill=prefill,
        output_schema=output_schema(body),
        cache_breakpoints=breakpoints,
    )


async def messages(request: web.Request) -> web.StreamResponse:
    body = decode_request(await request.read())
    turn = to_turn(request, body)

    def reply(started: TurnStarted, sse: SseWriter | None) -> TurnReply:
        return MessageStream(started, turn.request_id, sse) if sse else MessageReply(started, turn.request_id)

    try:
        return await answer_turn(request, turn, body.stream, reply, PING_FRAME)
    except (PromptTooLongError, PromptLimitError) as error:  # the wording Claude Code acts on
        raise ApiError(f"prompt is too long: {error.num_tokens} tokens > {error.limit} maximum") from error


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens, for a body `messages` would take (its bounds), also past the context:
    clients count to learn that a conversation no longer fits."""
    body = decode_request(await request.read())
    turn = to_turn(request, body, counting=True)
    num_tools = len(turn.tools or ())
    check_bounds(request, max_tokens=body.max_tokens, num_messages=len(turn.messages), num_tools=num_tools)
    admit(request, turn.agent_id)
    turn.may_switch_model = is_admin(request)
    system = request.app[SYSTEM_KEY]
    num_tokens = await system.count_tokens(turn)
    return json_response(TokenCount(num_tokens))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
