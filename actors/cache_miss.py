"""Why a turn reused less than its agent's cached history: where the prompt parted and what changed.

Each named agent's finished turn leaves a note: the history its cache holds (prompt and reply, as
token ids) and digests of the request that made it (per message and content block, and the
tools). The next turn's prompt is compared with that history token by token; where it parts
before the history's end, the two requests' digests say what changed, and the chat template
rendered over the leading messages says which message the parting token falls in. The notes and
the counts are kept in cache_notes.py; the report goes out as the `x-semantic-cache` header, in
the request's log line, `GET /v1/agents/{id}` and `/metrics`.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from semantic.actors.prompting.chat_format import ChatFormat, ChatMessage, ChatTemplateError
from semantic.engine.cache_store.cache_matching import common_prefix_length

if TYPE_CHECKING:  # turns.py imports CacheReport from here
    from semantic.actors.turns import TurnRequest


class Reason(StrEnum):
    """How a turn's prompt met its agent's cached history: a bounded set (a /metrics label)."""

    HIT = "hit"  # the prompt continues the whole history
    FIRST_TURN = "first-turn"  # no turn of this agent seen since the server started
    NO_AGENT = "no-agent"  # an anonymous request: matched by content, no history of its own
    MODEL = "model"  # the history is another model's
    SYSTEM = "system"  # the system prompt changed
    TOOLS = "tools"  # the tool definitions changed
    DATE_LINE = "date-line"  # the system prompt or a message differs only in a date or time
    EDITED_MESSAGE = "edited-message"  # an earlier message was changed or removed
    TEMPLATE = "template"  # the earlier messages are the same; their rendered tokens are not
    REWOUND = "rewound"  # the prompt ends inside the history: a retry, or messages taken off the end
    OTHER = "other"  # a raw prompt (text or token ids): no messages to compare


@dataclass(frozen=True, slots=True)
class CacheReport:
    reason: Reason
    num_reused_tokens: int = 0
    num_history_tokens: int = 0
    parted_at: int | None = None  # the first prompt token that differs from the history
    message: int | None = None  # the message it falls in (the messages' count: after the last)
    block: int | None = None  # that message's content block: its text parts, then its tool calls

    @property
    def is_miss(self) -> bool:
        return self.parted_at is not None

    def served(self, num_cached_tokens: int) -> CacheReport:
        """The report with what the engine reused (`PromptStarted`): the tokens the turn resumed
        from may stop short of where the prompt parted (a sliding or recurrent model resumes where
        it kept a point), and the request's log line states the same figure."""
        return replace(self, num_reused_tokens=num_cached_tokens)

    def fields(self) -> list[tuple[str, object]]:
        shown: list[tuple[str, object]] = [("parted", self.parted_at), ("message", self.message)]
        shown += [("block", self.block), ("reason", self.reason.value)]
        return [(name, value) for name, value in shown if value is not None]

    def header(self) -> str:
        """`reused=1234/1500; parted=1234; message=3; block=0; reason=edited-message`"""
        reused = f"reused={self.num_reused_tokens}/{self.num_history_tokens}"
        return "; ".join([reused, *(f"{name}={value}" for name, value in self.fields())])

    def as_json(self) -> dict[str, object]:
        shown: dict[str, object] = {"reused_tokens": self.num_reused_tokens}
        shown["history_tokens"] = self.num_history_tokens
        return shown | dict(self.fields())


_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DATE_OR_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
    r"|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b"
    r"|\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp]\.?[Mm]\.?)?"
    rf"|\b{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?(?:,? \d{{4}})?"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)? {_MONTH},? \d{{4}}"
    r"|\b(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b"
)


def mask_dates(text: str) -> str:
    """`text` with every date, time and weekday name replaced by one mark."""
    return _DATE_OR_TIME.sub("\x00", text)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=8).digest()


def _as_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def content_blocks(message: ChatMessage) -> list[str]:
    """A chat message's blocks as text: its content (each part of a list), then each tool call."""
    content = message.get("content")
    parts = content if isinstance(content, list) else [content or ""]
    calls = [call.get("function", call) for call in message.get("tool_calls") or ()]
    return [_as_text(part) for part in [*parts, *calls]]


@dataclass(frozen=True, slots=True)
class MessageDigest:
    role: str
    blocks: tuple[bytes, ...]
    undated: tuple[bytes, ...]  # the same blocks with dates and times masked

    @classmethod
    def of(cls, message: ChatMessage) -> MessageDigest:
        texts = content_blocks(message)
        undated = tuple(_digest(mask_dates(text)) for text in texts)
        return cls(str(message.get("role")), tuple(_digest(text) for text in texts), undated)

    def first_changed_block(self, other: MessageDigest) -> int:
        if self.role != other.role:
            return 0
        pairs = enumerate(zip(self.blocks, other.blocks, strict=False))
        return next((at for at, (a, b) in pairs if a != b), min(len(self.blocks), len(other.blocks)))


@dataclass(frozen=True, slots=True)
class RequestDigest:
    tools: bytes
    messages: tuple[MessageDigest, ...]

    @classmethod
    def of(cls, messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> RequestDigest:
        return cls(_digest(_as_text(tools or [])), tuple(MessageDigest.of(m) for m in messages))


def first_change(old: RequestDigest, new: RequestDigest) -> tuple[Reason, int | None, int | None]:
    """What changed from `old` to `new`, earliest in the prompt first (system prompt, tools, then
    the messages), with the message and block; TEMPLATE where `new` starts with all of `old`."""
    is_system = [bool(d.messages) and d.messages[0].role == "system" for d in (old, new)]
    if any(is_system) and old.messages[:1] != new.messages[:1]:
        if not all(is_system):
            return Reason.SYSTEM, 0, 0  # added or removed
        was, now = old.messages[0], new.messages[0]
        reason = Reason.DATE_LINE if was.undated == now.undated else Reason.SYSTEM
        return reason, 0, was.first_changed_block(now)
    if old.tools != new.tools:
        return Reason.TOOLS, None, None
    for at, was in enumerate(old.messages):
        if at >= len(new.messages):
            return Reason.REWOUND, len(new.messages), None
        now = new.messages[at]
        if now != was:
            is_dated = now.role == was.role and now.undated == was.undated
            return Reason.DATE_LINE if is_dated else Reason.EDITED_MESSAGE, at, was.first_changed_block(now)
    return Reason.TEMPLATE, None, None


@dataclass(frozen=True, slots=True)
class TurnNote:
    """What a named agent's last turn left cached, for the model `model_fingerprint`."""

    model_fingerprint: str
    history: array[int]  # the prompt and the reply, as token ids
    request: RequestDigest | None  # None: a raw prompt


def explain(
    note: TurnNote | None, model_fingerprint: str, prompt_ids: list[int], request: RequestDigest | None
) -> CacheReport:
    """How `prompt_ids` met the history `note` left; the message is the requests' first change
    (`locate` refines it to where the parting token falls)."""
    if note is None:
        return CacheReport(Reason.FIRST_TURN)
    num_history = len(note.history)
    if note.model_fingerprint != model_fingerprint:
        return CacheReport(Reason.MODEL, 0, num_history, parted_at=0)
    num_reused = common_prefix_length(note.history.tolist(), prompt_ids)
    if num_reused == num_history:
        return CacheReport(Reason.HIT, num_reused, num_history)
    reason, message, block = Reason.OTHER, None, None
    if note.request is not None and request is not None:
        reason, message, block = first_change(note.request, request)
        if reason is Reason.TEMPLATE and num_reused == len(prompt_ids):
            reason = Reason.REWOUND  # the same messages again: a retried turn
    return CacheReport(reason, num_reused, num_history, num_reused, message, block)


def message_at(
    chat: ChatFormat,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    prompt_ids: list[int],
    token_index: int,
    scope: str | None,
) -> int | None:
    """Tokenizer worker: the message whose rendering holds prompt token `token_index` (encoded under
    the turn's cache salt `scope`, as the prompt was): the fewest
    leading messages whose render still matches the prompt past that token, found by bisection
    (len(messages): the token comes after them); None where the template renders no prefix."""

    def covers(num_messages: int) -> bool:
        text = chat.render(messages[:num_messages], tools, add_generation_prompt=False)
        return common_prefix_length(chat.encode(text, scope), prompt_ids) > token_index

    try:
        if not messages or not covers(len(messages)):
            return len(messages) if messages else None
        low, high = 1, len(messages)  # covers(high)
        while low < high:
            middle = (low + high) // 2
            if covers(middle):
                high = middle
            else:
                low = middle + 1
    except ChatTemplateError:
        return None
    return low - 1


def locate(report: CacheReport, message: int | None) -> CacheReport:
    """`report` with the message its parting token falls in; the block is known only where that is
    the message the requests' comparison found changed."""
    if message is None or message == report.message:
        return report
    return replace(report, message=message, block=None)


def history_of(prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> array[int]:
    """The token ids a finished turn leaves in its agent's cache, compactly (4 bytes a token)."""
    history = array("I", prompt_ids)
    history.extend(generated_ids)
    return history


def explain_in_worker(
    chat: ChatFormat,
    note: TurnNote | None,
    model_fingerprint: str,
    turn: TurnRequest,
    prompt_ids: list[int],
) -> tuple[CacheReport, RequestDigest | None]:
    """Tokenizer worker: the turn's report against `note` and its request's digest (None for a raw
    prompt), hashed and rendered here rather than on the event loop."""
    is_raw = turn.prompt_token_ids is not None or turn.raw_prompt is not None
    digest = None if is_raw else RequestDigest.of(turn.messages, turn.tools)
    report = explain(note, model_fingerprint, prompt_ids, digest)
    parted_at = report.parted_at
    if parted_at is not None and report.reason is not Reason.MODEL and not is_raw:
        report = locate(
            report, message_at(chat, turn.messages, turn.tools, prompt_ids, parted_at, turn.cache_salt)
        )
    return report, digest
