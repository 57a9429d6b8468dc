"""`/openapi.json`, generated from the msgspec wire schemas the handlers decode and encode."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from semantic.protocols import agents, anthropic, openai
from semantic.protocols.admin import LoadModel
from semantic.protocols.errors import AgentError, AnthropicError, OpenAIError

SSE = {"text/event-stream": {"schema": {"type": "string"}}}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _ref(cls: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{cls.__name__}"}


def _operation(
    summary: str,
    error: type,
    body: type | None = None,
    reply: type | dict[str, Any] | None = None,
    streams: bool = False,
    status: str = "200",
) -> dict[str, Any]:
    content: dict[str, Any] = {
        "application/json": {"schema": _ref(reply) if isinstance(reply, type) else reply or ANY_OBJECT}
    }
    if streams:
        content.update(SSE)
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            status: {"description": "OK", "content": content},
            "default": {"description": "An error", "content": {"application/json": {"schema": _ref(error)}}},
        },
    }
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    return operation


AGENT_ID = [{"name": "agent_id", "in": "path", "required": True, "schema": {"type": "string"}}]


def build() -> dict[str, Any]:
    wire_types = [
        anthropic.MessagesRequest,
        anthropic.MessageResponse,
        anthropic.TokenCount,
        openai.ChatCompletionRequest,
        openai.ChatCompletion,
        agents.CreateAgent,
        agents.AgentTurn,
        agents.TurnResult,
        LoadModel,
        AnthropicError,
        OpenAIError,
        AgentError,
    ]
    _, components = msgspec.json.schema_components(wire_types, ref_template="#/components/schemas/{name}")
    paths: dict[str, Any] = {
        "/v1/messages": {
            "post": _operation(
                "Anthropic Messages",
                AnthropicError,
                anthropic.MessagesRequest,
                anthropic.MessageResponse,
                True,
            )
        },
        "/v1/messages/count_tokens": {
            "post": _operation(
                "Count prompt tokens", AnthropicError, anthropic.MessagesRequest, anthropic.TokenCount
            )
        },
        "/v1/chat/completions": {
            "post": _operation(
                "OpenAI chat completions",
                OpenAIError,
                openai.ChatCompletionRequest,
                openai.ChatCompletion,
                True,
            )
        },
        "/v1/models": {"get": _operation("Configured models", OpenAIError)},
        "/v1/agents": {
            "get": _operation("List agents", AgentError),
            "post": _operation("Create an agent", AgentError, agents.CreateAgent, status="201"),
        },
        "/v1/agents/{agent_id}": {
            "parameters": AGENT_ID,
            "get": _operation("One agent", AgentError),
            "delete": _operation("Forget an agent (memory and disk)", AgentError),
        },
        "/v1/agents/{agent_id}/messages": {
            "parameters": AGENT_ID,
            "post": _operation("A turn", AgentError, agents.AgentTurn, agents.TurnResult, True),
        },
        "/v1/agents/{agent_id}/evict": {
            "parameters": AGENT_ID,
            "post": _operation("Write the agent's cache to disk", AgentError),
        },
        "/health/live": {"get": _operation("The process answers", AgentError)},
        "/health/ready": {"get": _operation("Ready to serve (503 with the reason when not)", AgentError)},
        "/health/startup": {"get": _operation("Startup finished", AgentError)},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
        "/admin/models/load": {"post": _operation("Switch the loaded model", AgentError, LoadModel)},
        "/admin/models/unload": {"post": _operation("Unload the model", AgentError)},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "semantic", "version": "0.1.0"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "bearer": {"type": "http", "scheme": "bearer"},
            },
        },
        "security": [{}, {"apiKey": []}, {"bearer": []}],
    }


_DOCUMENT = msgspec.json.encode(build())


async def handle(request: web.Request) -> web.Response:
    return web.Response(body=_DOCUMENT, content_type="application/json")
