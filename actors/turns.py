"""A turn as every protocol hands it over, and how it becomes prompt token ids.

Protocol handlers parse their wire format into one `TurnRequest` (chat messages in the Hugging Face
form, tools as JSON-schema function specs, sampling); the agent actor renders it through the
model's chat template in the tokenizer worker and submits it; the handler gets a `TurnStarted`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

from semantic.actors.agent_id import AgentId
from semantic.engine.chat_format import ChatFormat, ChatMessage
from semantic.engine.request_stream import RequestStream
from semantic.engine.sampling import SamplingParams


class UnsupportedContentError(ValueError):
    """The request holds something the served model cannot read (images, no text at all)."""


class PromptLimitError(ValueError):
    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(
            f"prompt tokens: {num_tokens} is more than this server allows "
            f"({limit}, set by limits.max_prompt_tokens)"
        )
        self.num_tokens = num_tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`auto` lets the model decide; `required` forces a call (to `name` when given); `none` forbids."""

    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None


@dataclass(slots=True)
class TurnRequest:
    request_id: str
    agent_id: AgentId | None
    messages: list[ChatMessage]
    sampling: SamplingParams
    model: str | None = None  # a configured name or alias; None: the loaded model
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    prefill: str = ""  # a final assistant message's text: the reply continues it
    # The direct agent API: `messages` are only what is new; the agent keeps the conversation.
    keeps_conversation: bool = False
    # Already tokenized (embedding apps, benchmarks): used as is instead of rendering `messages`.
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: list[int]
    reply_prefix: str  # reply text written into the prompt (a forced tool call's opening)
    parses_tools: bool
    text_tail: str  # the rendered prompt's end, to see whether it leaves the reply in a <think> block
    # A forced call ends the turn: generation stops at the call's closing text (never reported as
    # a client's stop sequence).
    stop_after_call: str | None = None


@dataclass(slots=True)
class TurnStarted:
    """What a handler gets back: the engine stream, and `committed`, resolved once the turn is
    durable (a kept conversation written and fsynced); acknowledge the turn only after it."""

    stream: RequestStream
    prompt: PreparedPrompt
    model_name: str
    agent_id: AgentId | None
    committed: asyncio.Future[None]


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [str(tool["function"]["name"]) for tool in tools or ()]


def forced_prefix(chat: ChatFormat, choice: ToolChoice, names: list[str]) -> str:
    """Text to start the reply with so the model must call a tool (any, or the named one)."""
    if choice.mode != "required" or not names:
        return ""
    name = choice.name or (names[0] if len(names) == 1 else None)
    return chat.forced_call_prefix(name)


def prepare_stateless(chat: ChatFormat, turn: TurnRequest) -> PreparedPrompt:
    """Tokenizer worker: the whole conversation the client sent, rendered and encoded."""
    if turn.prompt_token_ids is not None:
        if not turn.prompt_token_ids:
            raise UnsupportedContentError("prompt_token_ids: the prompt is empty")
        return PreparedPrompt(list(turn.prompt_token_ids), "", False, "")
    if not turn.messages:
        raise UnsupportedContentError("messages: none has content the model can read")
    prefix = forced_prefix(chat, turn.tool_choice, tool_names(turn.tools))
    text = chat.render(turn.messages, turn.tools) + turn.prefill + prefix
    parses_tools = turn.tools is not None and turn.tool_choice.mode != "none"
    stop_after_call = chat.tool_call_closer if prefix else None
    return PreparedPrompt(chat.encode(text), prefix, parses_tools, text[-512:], stop_after_call)


def prepare_continuation(
    chat: ChatFormat, history: list[int], system: str | None, turn: TurnRequest
) -> PreparedPrompt:
    """Tokenizer worker: a kept conversation's token ids plus the template's text for the new turn."""
    suffix = chat.continuation(system, turn.messages) if history else chat.opening(system, turn.messages)
    return PreparedPrompt(history + chat.encode(suffix), "", False, suffix[-512:])
