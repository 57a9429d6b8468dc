"""`/openapi.json`, generated from the msgspec wire schemas the handlers decode and encode."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from semantic.actors.interface import (
    MAX_AGENT_ID_LENGTH,
    MAX_LOGIT_BIASES,
    MAX_SEED,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from semantic.protocols import agents, anthropic, anthropic_reply, completions, openai_reply, openai_wire
from semantic.protocols.admin import LoadModelBody
from semantic.protocols.errors import AgentError, AnthropicError, OpenAIError

# One server-sent event (before Open API 3.2's `itemSchema`, a stream's `schema` describes each event).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
ANY_STRING: dict[str, Any] = {"type": "string"}


def _ref(cls: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{cls.__name__}"}


def _operation(
    summary: str,
    error: type,
    body: type | None = None,
    reply: type | dict[str, Any] | None = None,
    streams: bool = False,
    status: str = "200",
    body_requires: dict[str, Any] | None = None,
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
        schema: dict[str, Any] = _ref(body)
        if body_requires:  # fields this operation needs that the shared body leaves optional
            schema = {"allOf": [schema, {"required": list(body_requires), "properties": body_requires}]}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return operation


# What `AgentId` accepts from a client (storage/agent_id.py), so generated ids reach the handlers.
AGENT_ID_SCHEMA = {
    "type": "string",
    "pattern": f"^[A-Za-z0-9_][A-Za-z0-9._-]{{0,{MAX_AGENT_ID_LENGTH - 1}}}$",
}
AGENT_ID = [{"name": "agent_id", "in": "path", "required": True, "schema": AGENT_ID_SCHEMA}]


MAX_TOKEN_ID = 9_999  # what the document allows in token ids (the handlers check the model's own)
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_LIMITS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _sampling_ranges() -> dict[str, dict[str, Any]]:
    """Each SamplingParams field's bounds as JSON schema, read from the struct (engine/decoding/sampling.py
    states them once), under the name of the wire field that sets it."""
    _, components = msgspec.json.schema_components([SamplingParams])
    ranges = {}
    for name, field in components["SamplingParams"]["properties"].items():
        for branch in field.get("anyOf", [field]):
            if limits := {key: value for key, value in branch.items() if key in _LIMITS}:
                ranges[name] = limits
    ranges["seed"]["maximum"] = MAX_SEED  # beyond what msgspec's bounds take
    ranges["max_completion_tokens"] = ranges["max_tokens"]
    return ranges


SAMPLING_RANGES = _sampling_ranges()


def _refine(components: dict[str, Any]) -> None:
    """Rules the handlers check that the wire Structs do not state (engine/decoding/sampling.py's ranges,
    each API's own), so that generated valid requests are valid."""
    for request in ("MessagesRequest", "ChatCompletionRequest", "CompletionRequest", "AgentTurn"):
        properties = components[request]["properties"]
        for name, limits in SAMPLING_RANGES.items():
            if name in properties:
                _restrict(properties[name], limits)
    for request in ("MessagesRequest", "ChatCompletionRequest"):
        components[request]["properties"]["messages"]["minItems"] = 1
    _restrict(components["MessagesRequest"]["properties"]["temperature"], {"maximum": 1})
    chat = components["ChatCompletionRequest"]
    completion = components["CompletionRequest"]
    for request in (chat, completion):
        request["properties"]["n"] = {"const": 1, "default": 1}
    for request in (chat, completion, components["AgentTurn"]):
        request["properties"]["logit_bias"]["anyOf"][0].update(
            description=f"token ids (below the model's vocabulary size; below {MAX_TOKEN_ID + 1:,} here, "
            "as the vocabularies of all common models are larger) mapped to what is added to their logits",
            propertyNames={"pattern": "^(0|[1-9][0-9]{0,3})$"},
            additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
            maxProperties=MAX_LOGIT_BIASES,
        )
    completion["properties"].update(
        prompt={
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
                },
            ]
        },
        best_of={"anyOf": [{"const": 1}, {"type": "null"}], "default": None},
        echo={"const": False, "default": False},
        suffix={"anyOf": [{"const": ""}, {"type": "null"}], "default": None},
    )
    _restrict(completion["properties"]["logprobs"], {"minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    chat["dependentSchemas"] = {  # as OpenAI: top_logprobs only with logprobs
        "top_logprobs": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    }
    turn = components["AgentTurn"]
    turn["anyOf"] = [{"required": ["content"]}, {"required": ["messages"]}]
    turn["properties"]["content"] = {"type": "string"}
    turn["properties"]["messages"]["anyOf"][0]["minItems"] = 1
    optional_agent_id = {"anyOf": [AGENT_ID_SCHEMA, {"type": "null"}], "default": None}
    components["CreateAgent"]["properties"]["id"] = optional_agent_id
    chat["properties"]["session_id"] = optional_agent_id


def _restrict(schema: dict[str, Any], limits: dict[str, Any]) -> None:
    """Add `limits` to a number schema, or to the number branch of an optional one."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") in ("integer", "number"):
            branch.update(limits)


def build() -> dict[str, Any]:
    wire_types = [
        anthropic.MessagesRequest,
        anthropic_reply.MessageResponse,
        anthropic.TokenCount,
        openai_wire.ChatCompletionRequest,
        openai_reply.ChatCompletion,
        completions.CompletionRequest,
        completions.Completion,
        agents.CreateAgent,
        agents.AgentTurn,
        agents.TurnResult,
        LoadModelBody,
        AnthropicError,
        OpenAIError,
        AgentError,
    ]
    _, components = msgspec.json.schema_components(wire_types, ref_template="#/components/schemas/{name}")
    _refine(components)
    paths: dict[str, Any] = {
        "/v1/messages": {
            "post": _operation(
                "Anthropic Messages",
                AnthropicError,
                anthropic.MessagesRequest,
                anthropic_reply.MessageResponse,
                True,
                body_requires={"max_tokens": {"type": "integer", "minimum": 1}},  # not count_tokens
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
                openai_wire.ChatCompletionRequest,
                openai_reply.ChatCompletion,
                True,
            )
        },
        "/v1/completions": {
            "post": _operation(
                "OpenAI text completions (raw text or token ids, no chat template)",
                OpenAIError,
                completions.CompletionRequest,
                completions.Completion,
                True,
            )
        },
        "/v1/models": {"get": _operation("Configured models", OpenAIError)},
        "/v1/models/{model_id}": {
            "parameters": [
                {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "get": _operation("One configured model, by name or alias", OpenAIError),
        },
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
        "/health": {"get": _operation("The process answers (as /health/live)", AgentError)},
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
        "/admin/models/load": {"post": _operation("Switch the loaded model", AgentError, LoadModelBody)},
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
