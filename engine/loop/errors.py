"""What the engine raises to its callers."""

from __future__ import annotations

import asyncio


class EngineError(RuntimeError):
    pass


class ModelChangedError(EngineError):
    """The request was tokenized for a model that has since been swapped out; retry it."""


class UnsteppableCacheError(EngineError):
    """A batch step raised while this request was new to the batch: its cache is dropped. Where it
    was the only new one (`is_sole_suspect`), its agent quarantines the file the cache came from."""

    def __init__(self, message: str, is_sole_suspect: bool) -> None:
        super().__init__(message)
        self.is_sole_suspect = is_sole_suspect


class PoolExhaustedError(EngineError):
    """The KV block pool has too few free blocks, even after evicting every idle cache it may."""


class PromptTooLongError(ValueError):
    """`is_lower_bound`: refused by its length before tokenizing, so `num_tokens` is a minimum."""

    def __init__(self, num_tokens: int, limit: int, is_lower_bound: bool = False) -> None:
        super().__init__(
            f"prompt has {'at least ' if is_lower_bound else ''}{num_tokens} tokens; "
            f"the model's context holds {limit} (at least 1 must be left to generate)"
            + ("; counted from its length, before tokenizing" if is_lower_bound else "")
        )
        self.num_tokens = num_tokens
        self.limit = limit


class LibraryPanic(RuntimeError):
    """A library's panic (pyo3's PanicException, from tokenizers or llguidance, derives from
    BaseException), raised again as an ordinary error: it fails the request it came from, not the
    engine thread or the task group it would otherwise escape into."""


_STOPS = KeyboardInterrupt | SystemExit | GeneratorExit | asyncio.CancelledError


def as_ordinary(error: BaseException) -> Exception:
    """`error` as an ordinary Exception: itself, or a library's panic as LibraryPanic. A way to stop
    (interrupt, exit, cancellation, a generator's close) is raised again."""
    if isinstance(error, Exception):
        return error
    if isinstance(error, _STOPS):
        raise error
    return LibraryPanic(f"{type(error).__name__}: {error}")
