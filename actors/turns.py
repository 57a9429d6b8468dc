"""A turn as every protocol hands it over, and how it becomes prompt token ids.

Protocol handlers parse their wire format into one `TurnRequest` (chat messages in the Hugging Face
form, tools as JSON-schema function specs, sampling); the agent actor renders it through the
model's chat template in the tokenizer worker and submits it; the handler gets a `TurnStarted`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from semantic.actors.cache_miss import CacheReport
from semantic.actors.prompting.chat_format import ChatFormat, ChatMessage
from semantic.actors.prompting.output_grammars import (
    json_schema_grammar,
    loosened,
    strict_calls_grammar,
    tool_call_grammar,
)
from semantic.actors.prompting.prompt_pins import CacheBreakpoint, prompt_pins
from semantic.actors.prompting.tool_call_grammars import Mode, Tools, call_grammars
from semantic.actors.prompting.tool_format import HERMES, ToolFormat
from semantic.actors.request_stream import RequestStream
from semantic.actors.restore_cost import RestoreDecision
from semantic.engine.cache_store.prefix_pins import CachePin
from semantic.engine.decoding.grammar_matcher import GrammarError
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.errors import PromptTooLongError
from semantic.engine.model.loading import LoadedModel
from semantic.storage.agent_id import AgentId


class UnsupportedContentError(ValueError):
    """The request holds something the served model cannot read (images, no text at all)."""


class PromptLimitError(ValueError):
    """`is_lower_bound`: refused by its length before tokenizing, so `num_tokens` is a minimum."""

    def __init__(self, num_tokens: int, limit: int, is_lower_bound: bool = False) -> None:
        super().__init__(
            f"prompt tokens: {'at least ' if is_lower_bound else ''}{num_tokens} is more than this "
            f"server allows ({limit}, set by limits.max_prompt_tokens)"
            + ("; counted from its length, before tokenizing" if is_lower_bound else "")
        )
        self.num_tokens = num_tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class PromptBound:
    """The token limits a prompt must fit, checked on its rendered text before it is tokenized: no
    token spans more than `max_chars_per_token` characters, so a text longer than that many times
    the limit is over it whatever it holds, and is refused without paying to tokenize it."""

    max_chars_per_token: int
    context_length: int
    max_prompt_tokens: int | None = None

    @classmethod
    def of(cls, loaded: LoadedModel, max_prompt_tokens: int | None) -> PromptBound:
        return cls(loaded.max_chars_per_token, loaded.context_length, max_prompt_tokens)

    def refuse_obviously_long(self, text: str, num_kept_tokens: int = 0) -> None:
        at_least = num_kept_tokens + len(text) // self.max_chars_per_token
        if self.max_prompt_tokens is not None and at_least > self.max_prompt_tokens:
            raise PromptLimitError(at_least, self.max_prompt_tokens, is_lower_bound=True)
        if at_least >= self.context_length:
            raise PromptTooLongError(at_least, self.context_length, is_lower_bound=True)


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
    # Whether the turn may load another model than the loaded (or last loaded) one: with an API
    # keys file only admin namespaces may, since a switch drains every namespace's requests.
    may_switch_model: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    prefill: str = ""  # a final assistant message's text: the reply continues it
    # The direct agent API: `messages` are only what is new; the agent keeps the conversation.
    keeps_conversation: bool = False
    # Already tokenized (embedding apps, benchmarks, the completions API): used as is instead of
    # rendering `messages`.
    prompt_token_ids: list[int] | None = None
    # The completions API's text: continued as is, without the chat template (the tokenizer adds
    # what it adds to any text, a BOS say), its reply plain text (no tool calls, no reasoning).
    raw_prompt: str | None = None
    # The JSON schema the whole reply must follow (OpenAI `response_format`, Anthropic
    # `output_config.format`); enforced by a grammar while decoding.
    output_schema: dict[str, Any] | None = None
    # Scopes prefix-block sharing: only turns with the same salt share KV blocks (the edge folds
    # the caller's namespace in; see protocols/tenancy.py).
    cache_salt: str | None = None
    # Anthropic `cache_control`: (message index, offset in its content, ttl_s), kept for the ttl.
    cache_breakpoints: list[tuple[int, int, float]] = field(default_factory=list)
    # Calls the model chooses to write are decoded under their tools' schemas from their opening on
    # (the server's `model.tool_calls`); strict tools are held to theirs either way.
    guided_tool_calls: bool = True


@dataclass(frozen=True, slots=True)
class OutputGrammar:
    """The llguidance grammar (actors/prompting/output_grammars.py) the reply is decoded under: from
    its first token or, with a `trigger`, from each place the reply writes it (a tool call's opening) on.

    Guidance the server chose, not the client, never refuses a turn: where llguidance cannot compile
    it, the turn goes on under `fallback`, or free where `is_optional` and there is none."""

    grammar: str
    trigger: str | None = None
    fallback: OutputGrammar | None = None
    is_optional: bool = False


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: list[int]
    reply_prefix: str  # reply text written into the prompt (a forced tool call's opening)
    parses_tools: bool
    text_tail: str  # the rendered prompt's end, to see whether it leaves the reply in a <think> block
    # A forced call ends the turn: generation stops at the call's closing text (never reported as
    # a client's stop sequence).
    stop_after_call: str | None = None
    grammar: OutputGrammar | None = None
    tool_format: ToolFormat = HERMES  # how the model writes calls, for the reply's tool-call parser
    tools: list[dict[str, Any]] | None = None  # the request's tools: parsers type arguments by them
    is_raw: bool = False  # a completion of raw text or tokens: its reply is all plain text
    prefill: str = ""  # the client's start of the reply: read for a call it opens, never sent back
    shared_head_tokens: int = 0  # its leading system prompt and tools, which other agents may share
    generation_prompt_start: int = 0  # where its generation prompt begins (0: unknown)
    cache_pins: tuple[CachePin, ...] = ()  # the prompt's cache_control breakpoints, as token counts


@dataclass(slots=True)
class TurnStarted:
    """What a handler gets back: the turn's one stream, owned by its actor, whose Finished comes
    only once the turn is durable (a kept conversation written and fsynced), or an error instead."""

    stream: RequestStream
    prompt: PreparedPrompt
    model_name: str
    agent_id: AgentId | None
    cache: CacheReport | None = None  # how the prompt met the agent's cached history (cache_miss.py)
    restore: RestoreDecision | None = None  # its cache read from disk or computed again (restore_cost.py)

    def check_output_complete(self) -> None:
        """At Finished: raises IncompleteOutputError where the reply's grammar ended it unfinished."""
        if self.stream.request.grammar is not None:
            self.stream.request.grammar.check_complete()


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [str(tool["function"]["name"]) for tool in tools or ()]


@dataclass(frozen=True, slots=True)
class ForcedCall:
    """A reply that must open with a tool call: to the tool `name`, or to any tool when None."""

    name: str | None


def forced_call(choice: ToolChoice, names: list[str]) -> ForcedCall | None:
    if choice.mode != "required":
        return None
    if not names:
        raise UnsupportedContentError("tool_choice: it forces a tool call, but the request has no tools")
    if choice.name is not None and choice.name not in names:
        raise UnsupportedContentError(f"tool_choice: no tool named {choice.name!r} among the request's tools")
    return ForcedCall(choice.name or (names[0] if len(names) == 1 else None))


def prepare_stateless(
    chat: ChatFormat, turn: TurnRequest, bound: PromptBound | None = None
) -> PreparedPrompt:
    """Tokenizer worker: the whole conversation the client sent, rendered and encoded."""
    if turn.prompt_token_ids is not None:
        if not turn.prompt_token_ids:
            raise UnsupportedContentError("prompt_token_ids: the prompt is empty")
        return PreparedPrompt(list(turn.prompt_token_ids), "", False, "", is_raw=True)
    if turn.raw_prompt is not None:
        if bound is not None:
            bound.refuse_obviously_long(turn.raw_prompt)
        token_ids = chat.tokenizer.encode(turn.raw_prompt)
        if not token_ids:
            raise UnsupportedContentError("prompt: the prompt is empty")
        return PreparedPrompt(list(token_ids), "", False, "", is_raw=True)
    if not turn.messages:
        raise UnsupportedContentError("messages: none has content the model can read")
    forced = forced_call(turn.tool_choice, tool_names(turn.tools))
    prefix = chat.forced_call_prefix(forced.name) if forced else ""
    text = chat.render(turn.messages, turn.tools) + turn.prefill + prefix
    if bound is not None:
        bound.refuse_obviously_long(text)
    parses_tools = turn.tools is not None and turn.tool_choice.mode != "none"
    stop_after_call = chat.tool_call_closer if prefix else None
    grammar = output_grammar(chat, turn, forced)
    token_ids = chat.encode(text, turn.cache_salt)
    breakpoints = [CacheBreakpoint(*b) for b in turn.cache_breakpoints]
    salt = turn.cache_salt
    return PreparedPrompt(
        token_ids, prefix, parses_tools, text[-512:], stop_after_call, grammar,
        tool_format=chat.tool_format, tools=turn.tools, prefill=turn.prefill,
        shared_head_tokens=chat.head_length(turn.messages, turn.tools, text, token_ids, salt),
        generation_prompt_start=chat.generation_prompt_start(
            turn.messages, turn.tools, text, token_ids, salt
        ),
        cache_pins=prompt_pins(chat, turn.messages, turn.tools, breakpoints, text, token_ids, salt),
    )  # fmt: skip


def output_grammar(chat: ChatFormat, turn: TurnRequest, forced: ForcedCall | None) -> OutputGrammar | None:
    """What the reply is decoded under: a forced call's arguments follow its tool's schema; otherwise
    the reply follows the requested output schema; otherwise each call the model opens follows its
    tool's schema (guided calls), or, with guidance off, calls to `strict` tools follow theirs.
    Raises GrammarError where a client's schema (output, forced or strict) cannot be enforced."""
    tools = turn.tools or []
    strict = [tool for tool in tools if tool["function"].get("strict")]
    if turn.output_schema is not None and forced is None:
        return OutputGrammar(json_schema_grammar(turn.output_schema, "output format"))
    guided = turn.guided_tool_calls and bool(tools) and turn.tool_choice.mode != "none"
    if forced is None and not strict and not guided:
        return None
    arguments_key = _arguments_key(chat.forced_call_prefix("tool") or "")
    if arguments_key is None:  # calls are not JSON objects in this model's format
        return _tagged_calls_grammar(chat, turn, forced, guided)
    closer = chat.tool_call_closer
    if forced is not None:
        return OutputGrammar(tool_call_grammar(forced.name, arguments_key, tools, closer, "tools"))
    if turn.tool_choice.mode == "none":
        return None
    trigger, head = _call_trigger(chat)
    if not guided or trigger is None:  # no marker opens a call (Llama's bare JSON): strict ones only
        if not strict:
            return None
        return OutputGrammar(
            strict_calls_grammar(strict, arguments_key, closer, "tools"), chat.tool_call_opener
        )
    # Strict tools keep their schemas; the others fall back to any JSON object where theirs cannot
    # be enforced, and the turn to free calls where no strict tool needs a grammar.
    loose = [tool if tool["function"].get("strict") else loosened(tool) for tool in tools]
    fallback = OutputGrammar(
        strict_calls_grammar(loose, arguments_key, closer, "tools", head), trigger, is_optional=not strict
    )
    try:
        grammar = strict_calls_grammar(tools, arguments_key, closer, "tools", head)
    except GrammarError:
        return fallback
    return OutputGrammar(grammar, trigger, fallback, is_optional=True)


def _tagged_calls_grammar(
    chat: ChatFormat, turn: TurnRequest, forced: ForcedCall | None, guided: bool
) -> OutputGrammar | None:
    """`output_grammar` for the formats whose arguments are tagged values, not one JSON object
    (actors/prompting/tool_call_grammars.py): strict tools exact, the others as close as the format allows."""
    tools = turn.tools or []
    strict = any(tool["function"].get("strict") for tool in tools)
    grammars = call_grammars(chat.tool_format, chat.tokenizer)
    if grammars is None:
        if strict:
            raise GrammarError("tools: strict calls cannot be enforced in this model's tool-call format")
        return None

    def held(loose: bool) -> Tools:
        others: Mode = "loose" if loose else "best"
        return [(tool, "exact" if tool["function"].get("strict") else others) for tool in tools]

    if forced is not None:
        return OutputGrammar(grammars.forced(forced.name, held(loose=False), "tools"))
    if turn.tool_choice.mode == "none":
        return None
    if not guided:
        only_strict: Tools = [(tool, "exact") for tool in tools if tool["function"].get("strict")]
        return OutputGrammar(grammars.lazy(only_strict, "tools"), grammars.trigger)
    try:
        fallback = OutputGrammar(
            grammars.lazy(held(loose=True), "tools"), grammars.trigger, is_optional=not strict
        )
    except GrammarError:
        if strict:
            raise
        return None
    try:
        grammar = grammars.lazy(held(loose=False), "tools")
    except GrammarError:
        return fallback
    return OutputGrammar(grammar, grammars.trigger, fallback, is_optional=True)


def _call_trigger(chat: ChatFormat) -> tuple[str | None, str]:
    """The marker that opens a call block (what mlx-lm's parser reads for it) and the opening's text
    between it and `{"name": "`; no marker where the format's opening does not begin with one."""
    start, opening = chat.tool_format.start, chat.forced_call_prefix(None)
    if not start or not opening.startswith(start) or not opening.endswith('{"name": "'):
        return None, ""
    return start, opening[len(start) :].removesuffix('{"name": "')


def _arguments_key(named_prefix: str) -> str | None:
    """`arguments` in `{"name": "tool", "arguments": ` (JSON call formats); None for others."""
    head = '"name": "tool", "'
    at = named_prefix.rfind(head)
    if at < 0 or not named_prefix.endswith('": '):
        return None
    return named_prefix[at + len(head) : -3]


def prepare_continuation(
    chat: ChatFormat,
    history: list[int],
    system: str | None,
    turn: TurnRequest,
    bound: PromptBound | None = None,
) -> PreparedPrompt:
    """Tokenizer worker: a kept conversation's token ids plus the template's text for the new turn."""
    suffix = chat.continuation(system, turn.messages) if history else chat.opening(system, turn.messages)
    if bound is not None:
        bound.refuse_obviously_long(suffix, num_kept_tokens=len(history))
    token_ids = history + chat.encode(suffix, turn.cache_salt)
    head = [{"role": "system", "content": system}] if system else []
    shared_head = chat.head_length(head, None, suffix, token_ids, turn.cache_salt) if not history else 0
    return PreparedPrompt(token_ids, "", False, suffix[-512:], shared_head_tokens=shared_head)
