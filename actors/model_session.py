"""What one loaded model gives a turn (`ModelSession`), what a transition reports, and its errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from semantic.actors.engine_client import EngineError
from semantic.actors.prompting.chat_format import ChatFormat
from semantic.engine.decoding.grammar_matcher import GrammarCompiler
from semantic.engine.model.loading import LoadedModel
from semantic.storage.persistence import PersistenceActor


class ModelUnavailableError(EngineError):
    """No model could be made ready in time for a request (a swap failed or took too long)."""


class ModelLoadError(ModelUnavailableError):
    """The requested model failed to load (the previous one, if any, was loaded back)."""


class ModelSwitchForbiddenError(Exception):
    """A request named another model than the loaded one and may not switch (not an admin)."""

    def __init__(self, requested: str, loaded: str) -> None:
        super().__init__(
            f"model {requested!r} is not loaded ({loaded!r} is) and this API key may not switch "
            "models, which drains every namespace's requests; ask an admin key (the API keys "
            "file's `admin`) to load it"
        )


@dataclass(frozen=True, slots=True)
class SwapReport:
    """What one model transition did and how long each phase took."""

    from_model: str | None
    to_model: str | None
    drain_s: float = 0.0
    num_cancelled: int = 0
    flush_s: float = 0.0
    num_flushed: int = 0
    unload_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    active_memory_before_unload: int = 0
    active_memory_after_unload: int = 0
    active_memory_after_load: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ModelSession:
    """One loaded model and what belongs to it; valid until the next transition."""

    loaded: LoadedModel
    chat: ChatFormat
    persistence: PersistenceActor | None
    grammars: GrammarCompiler


class Holds:
    """How many tasks hold something, and a way to wait until none does."""

    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.count += 1
        self._none.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._none.set()

    async def none_held(self) -> None:
        await self._none.wait()
