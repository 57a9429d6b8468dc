"""Anthropic `cache_control` breakpoints as the leading prompt tokens a request pins, and for how long.

A breakpoint names a place in the conversation: a chat message and a character offset in its
content (`CacheBreakpoint`). The prompt is the chat template's render of the messages, so a
breakpoint's token index is found by rendering them once more with a unique mark at each
breakpoint, and encoding the rendered text before each mark. The engine's store keeps the full
blocks of each pinned prefix for the pin's ttl (`engine/cache_store/prefix_pins.py`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from semantic.engine.cache_store.cache_matching import common_prefix_length
from semantic.engine.cache_store.prefix_pins import CachePin

if TYPE_CHECKING:
    from semantic.actors.prompting.chat_format import ChatFormat, ChatMessage

TTL_S = {"5m": 300.0, "1h": 3600.0}  # the ttls Anthropic's cache_control accepts; 5m by default


class CacheBreakpoint(NamedTuple):
    message_index: int  # in the turn's chat messages
    offset: int  # characters of that message's content before the breakpoint
    ttl_s: float


def prompt_pins(
    chat: ChatFormat,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    breakpoints: Sequence[CacheBreakpoint],
    text: str,
    token_ids: list[int],
    scope: str | None,
) -> tuple[CachePin, ...]:
    """The pins of `breakpoints` in a prompt whose text `text` (rendered from `messages` and `tools`)
    encodes to `token_ids` under the cache salt `scope`, fewest tokens first. A breakpoint where the
    template changes the text around it (a trimmed content, say) pins only what the renders share
    up to it."""
    if not breakpoints:
        return ()
    marked: list[dict[str, Any]] = [dict(message) for message in messages]
    marks: dict[str, float] = {}
    # Later offsets first, so the earlier ones in the same message stay where they were.
    for index, offset, ttl_s in sorted(breakpoints, key=lambda b: -b.offset):
        content = marked[index].get("content") if 0 <= index < len(marked) else None
        if not isinstance(content, str) or not 0 <= offset <= len(content):
            continue  # a prefill (taken out of the messages) or a block that renders no text
        mark = f"\u2063pin-{secrets.token_hex(8)}\u2063"  # no client text can spell it
        marked[index]["content"] = content[:offset] + mark + content[offset:]
        marks[mark] = ttl_s
    if not marks:
        return ()
    rendered = chat.render(marked, tools)
    pins: dict[int, float] = {}
    for mark, ttl_s in marks.items():
        at = rendered.find(mark)
        if at < 0:
            continue
        before = rendered[:at]
        for other in marks:
            before = before.replace(other, "")
        num_chars = len(before) if text.startswith(before) else _num_common_chars(text, before)
        num_tokens = common_prefix_length(chat.encode(text[:num_chars], scope), token_ids) if num_chars else 0
        if num_tokens:
            pins[num_tokens] = max(ttl_s, pins.get(num_tokens, 0.0))
    return tuple(CachePin(n, pins[n]) for n in sorted(pins))


def _num_common_chars(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def block_aligned(pins: Sequence[CachePin], block_size: int) -> tuple[CachePin, ...]:
    """The pins as whole blocks (what a pool can keep); a pin shorter than a block keeps nothing."""
    aligned = [CachePin(p.num_tokens // block_size * block_size, p.ttl_s) for p in pins]
    return tuple(p for p in aligned if p.num_tokens)
