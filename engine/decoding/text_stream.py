"""Turn a request's tokens into text deltas, and stop at stop strings without leaking them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from semantic.engine.loop.messages import GenerationRequest


class TextStream:
    def __init__(
        self,
        detokenizer: Any,
        stop: tuple[str, ...],
        eos_token_ids: Collection[int],
        follows_tokens: Sequence[int] = (),
    ) -> None:
        """`follows_tokens`: the prompt's last tokens, where the reply continues its text (a prefilled
        reply, a raw completion; `text_before`): read first and not shown, so that the reply's first
        token keeps the space it starts with (mlx-lm's detokenizers drop it at the start of a text)."""
        self._detokenizer = detokenizer
        for token in follows_tokens:
            detokenizer.add_token(token)
        if follows_tokens:
            _ = detokenizer.last_segment
        self._stop = stop
        self._eos_token_ids = eos_token_ids
        self._pending = ""
        self.stop_hit: str | None = None

    def add_token(self, token: int) -> str:
        """Feed one generated token; return the text that is now safe to show."""
        if self.stop_hit is not None or self.is_end_token(token):
            return ""
        try:
            self._detokenizer.add_token(token)
        except IndexError:  # a padded embedding's row past the tokenizer's ids: no text to show
            return ""
        self._pending += self._detokenizer.last_segment
        return self._release()

    def is_end_token(self, token: int) -> bool:
        return token in self._eos_token_ids

    def finish(self) -> str:
        """Flush what is left once generation ends."""
        if self.stop_hit is not None:
            return ""
        self._detokenizer.finalize()
        self._pending += self._detokenizer.last_segment
        text = self._release()
        if self.stop_hit is None:
            text, self._pending = text + self._pending, ""
        return text

    def _release(self) -> str:
        if not self._stop:
            text, self._pending = self._pending, ""
            return text
        hits = [(self._pending.find(s), s) for s in self._stop if s in self._pending]
        if hits:
            index, self.stop_hit = min(hits)
            text, self._pending = self._pending[:index], ""
            return text
        hold = max((_overlap(self._pending, s) for s in self._stop), default=0)
        cut = len(self._pending) - hold
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text


def reply_text_stream(
    request: GenerationRequest, tokenizer: Any, eos_token_ids: Collection[int]
) -> TextStream:
    """How a request's reply tokens become text; one that continues the prompt's text reads its end."""
    follows = text_before(request.prompt_tokens, tokenizer.decode) if request.continues_text else []
    return TextStream(tokenizer.detokenizer, request.sampling.stop, eos_token_ids, follows)


def text_before(prompt_tokens: list[int], decode: Callable[[list[int]], str], most: int = 4) -> list[int]:
    """The fewest last prompt tokens (up to `most`) that decode to whole characters with something
    besides spaces: what a reply continuing the prompt is read after (a lone last token can be the
    tail of a split character, or a bare space an SPM tokenizer decodes to nothing)."""
    for count in range(1, min(most, len(prompt_tokens)) + 1):
        text = decode(prompt_tokens[-count:])
        if text.strip() and not text.startswith("\ufffd"):
            return prompt_tokens[-count:]
    return prompt_tokens[-most:]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that begins `stop`."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0
