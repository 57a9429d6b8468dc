"""Split a reply into the model's reasoning (`<think>…</think>`) and its answer, as it streams.

Reasoning models (Qwen3, DeepSeek-R1 and their distills) open their reply with `<think>`; some
chat templates write the `<think>` into the generation prompt themselves, so the reply starts
inside it. Only a `<think>` at the start of the reply counts: later ones are answer text.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass(slots=True)
class ThinkingPart:
    text: str


@dataclass(slots=True)
class ThinkingEnd:
    pass


ReasoningPart = ThinkingPart | ThinkingEnd | str  # str: answer text


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt (with any prefill) leaves the reply inside a `<think>` block."""
    tail = prompt_text[-512:]
    return tail.rfind(OPEN_TAG) > tail.rfind(CLOSE_TAG)


class ReasoningSplitter:
    def __init__(self, inside: bool = False) -> None:
        self._state = "inside" if inside else "start"  # start -> inside -> after, or start -> after
        self._buffer = ""

    def feed(self, text: str) -> list[ReasoningPart]:
        if self._state == "after":
            return [text] if text else []
        self._buffer += text
        parts: list[ReasoningPart] = []
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(OPEN_TAG):
                self._state, self._buffer = "inside", stripped[len(OPEN_TAG) :]
            elif OPEN_TAG.startswith(stripped):
                return parts  # could still become the opening tag
            else:
                self._state, answer, self._buffer = "after", self._buffer, ""
                return [answer]
        end = self._buffer.find(CLOSE_TAG)
        if end >= 0:
            thinking, answer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
            self._state, self._buffer = "after", ""
            if thinking:
                parts.append(ThinkingPart(thinking))
            parts.append(ThinkingEnd())
            if answer:
                parts.append(answer)
            return parts
        keep = _partial_tag_suffix(self._buffer, CLOSE_TAG)
        ready, self._buffer = (
            self._buffer[: len(self._buffer) - keep],
            self._buffer[len(self._buffer) - keep :],
        )
        if ready:
            parts.append(ThinkingPart(ready))
        return parts

    def finish(self) -> list[ReasoningPart]:
        """End of the reply: a reasoning block cut short (max_tokens) is closed."""
        buffer, self._buffer = self._buffer, ""
        if self._state == "inside":
            self._state = "after"
            return [*([ThinkingPart(buffer)] if buffer else []), ThinkingEnd()]
        self._state = "after"
        return [buffer] if buffer else []


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag` (held back until known)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
