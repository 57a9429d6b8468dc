"""The OpenAI reply shapes the SDK reads (chat completions, chunks, usage, log-probabilities)."""

from __future__ import annotations

from typing import Literal

import msgspec

from semantic.actors.interface import Finished, FinishReason
from semantic.actors.interface import TokenLogprob as EngineTokenLogprob
from semantic.protocols.openai_wire import ToolCall

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a reasoning model's <think> block, as DeepSeek and vLLM send it


class Choice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET  # only in the usage chunk
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


def usage_of(finished: Finished) -> Usage:
    return Usage(
        prompt_tokens=finished.num_prompt_tokens,
        completion_tokens=finished.num_generated_tokens,
        total_tokens=finished.num_prompt_tokens + finished.num_generated_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=finished.num_cached_tokens),
    )


LOWEST_LOGPROB = -9999.0  # what OpenAI sends for a token the model ruled out; JSON has no -inf


def wire_logprobs(tokens: list[EngineTokenLogprob]) -> ChoiceLogprobs:
    def entry(text: str, raw: bytes, logprob: float) -> tuple[str, float, list[int]]:
        return text, max(logprob, LOWEST_LOGPROB), list(raw)

    return ChoiceLogprobs(
        [
            TokenLogprob(
                *entry(token.text, token.raw, token.logprob),
                [TopLogprob(*entry(t.text, t.raw, t.logprob)) for t in token.top],
            )
            for token in tokens
        ]
    )
