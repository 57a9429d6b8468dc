"""Prompt text to token ids one chat segment at a time, so a long conversation's earlier turns come
out of a cache instead of the tokenizer.

A fast tokenizer cuts its input at added tokens before its model runs, so text cut at the markers
the chat template writes (`<|im_start|>`, `<|im_end|>`) encodes piece by piece to the same ids as
the whole. Where a tokenizer breaks that (a strip flag on a marker, a prefix space only at the start
of the text), the probes at construction see it and every text is encoded whole, as before.

The cache is scoped like the prefix blocks: a segment is found again only under the cache salt it
was encoded under, so how fast a text tokenizes never tells one tenant what another sent.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from loguru import logger

DEFAULT_MAX_CACHED_CHARS = 1 << 22  # ~4M characters: a few dozen long agent conversations

_PROBE_CONTENTS = (
    "Hi there!",
    " spaces around ",
    "line one\n\n  indented\ttab\n",
    "naïve café, 日本語, 🙂",
    "3.14159 + 42 = 45.14159",
    "",
)


class SegmentEncoder:
    """`tokenizer.encode(text, add_special_tokens=False)`, cached per segment between chat markers
    and per scope (a turn's cache salt: texts are shared only where its prefix blocks are).

    Safe to share between threads: the cache is behind a lock, the tokenizer runs outside it.
    """

    def __init__(self, tokenizer: Any, max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_cached_chars = max_cached_chars
        self.num_cache_hits = 0
        self.num_cache_misses = 0
        self._segment_to_ids: OrderedDict[tuple[str | None, str], array[int]] = OrderedDict()
        self._num_cached_chars = 0
        self._lock = threading.Lock()
        self.markers: tuple[str, ...] = ()  # none: every text is encoded whole
        self._splitter: re.Pattern[str] | None = None
        markers = _template_markers(tokenizer)
        if not markers:
            logger.info("prompt segments off: the chat template writes no plain added tokens to split at")
            return
        self.markers = tuple(markers)  # none overlaps another, so the order of the alternatives is moot
        self._splitter = re.compile("(" + "|".join(map(re.escape, self.markers)) + ")")
        for probe in _probe_texts(tokenizer, self.markers):
            pieces = [i for segment in self.segments(probe) for i in self._encode_whole(segment)]
            if pieces != self._encode_whole(probe):
                logger.info(f"prompt segments off: cut at chat markers, {probe[:160]!r} encodes differently")
                self.markers, self._splitter = (), None
                return

    @property
    def num_cached_chars(self) -> int:
        return self._num_cached_chars

    def encode(self, text: str, scope: str | None) -> list[int]:
        """The ids `tokenizer.encode(text, add_special_tokens=False)` gives, with the segments
        already encoded under `scope` (the turn's cache salt) taken from the cache."""
        if self._splitter is None:
            return self._encode_whole(text)
        ids: list[int] = []
        for segment in self.segments(text):
            ids.extend(self._cached_ids(segment, scope))
        return ids

    def segments(self, text: str) -> Iterator[str]:
        """The text between markers and the markers themselves, in order; the whole text if none."""
        if self._splitter is None:
            yield text
            return
        yield from (segment for segment in self._splitter.split(text) if segment)

    def _cached_ids(self, segment: str, scope: str | None) -> array[int]:
        key = (scope, segment)
        with self._lock:
            ids = self._segment_to_ids.get(key)
            if ids is not None:
                self._segment_to_ids.move_to_end(key)
                self.num_cache_hits += 1
                return ids
            self.num_cache_misses += 1
        ids = array("I", self._encode_whole(segment))  # unlocked, so the other worker is not held up
        if len(segment) > self.max_cached_chars:
            return ids
        with self._lock:
            if key not in self._segment_to_ids:
                self._segment_to_ids[key] = ids
                self._num_cached_chars += len(segment)
            while self._num_cached_chars > self.max_cached_chars:
                (_, evicted), _ = self._segment_to_ids.popitem(last=False)
                self._num_cached_chars -= len(evicted)
        return ids

    def _encode_whole(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids


def _template_markers(tokenizer: Any) -> list[str]:
    """Added tokens the chat template writes that the tokenizer matches exactly where they stand:
    no strip or word flags, no edge whitespace, and no overlap with any other added token."""
    rendered = _render(tokenizer, _PROBE_CONTENTS)
    added = [token for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.content]
    return [
        token.content
        for token in added
        if token.content in rendered
        and token.content == token.content.strip()
        and not any(getattr(token, flag, False) for flag in ("lstrip", "rstrip", "single_word", "normalized"))
        and not any(
            _overlaps(token.content, other.content) for other in added if other.content != token.content
        )
    ]


def _overlaps(a: str, b: str) -> bool:
    """Whether some text could hold `a` and `b` sharing characters: one inside the other, or one's end
    the other's start (then the tokenizer may match the other where we cut at `a`)."""
    if a in b or b in a:
        return True
    return any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, min(len(a), len(b))))


def _probe_texts(tokenizer: Any, markers: tuple[str, ...]) -> list[str]:
    quoted = [f"{content}{marker}\n {marker} x{marker}" for content in _PROBE_CONTENTS for marker in markers]
    run_together = "".join(f"{content}{marker}" for content in _PROBE_CONTENTS for marker in markers)
    return [_render(tokenizer, _PROBE_CONTENTS), _render(tokenizer, quoted), run_together + " tail"]


def _render(tokenizer: Any, contents: Sequence[str]) -> str:
    """A user/assistant conversation of `contents`, with a system message where the template takes one."""
    turns = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    if len(turns) % 2 == 0:
        turns.append({"role": "user", "content": "Thanks."})  # templates may want a user turn last
    for messages in ([{"role": "system", "content": "Be brief.\n"}, *turns], turns):
        try:
            text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return text
        except Exception:
            continue
    return ""
