"""The asyncio side of one request: read its events; `cancel` frees its batch slot.

One queue carries a request's events to its one reader. An owner that must make the turn durable
first (an agent actor saving a kept conversation) calls `hold_final`: the engine's `Finished` then
resolves `done` but is not read; the owner `finish`es the stream with it once committed, or with
the error that stopped the commit, so the reader sees one final event and it means durable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from semantic.engine.loop.messages import Event, EventChannel, Finished, FinishReason, GenerationRequest


class RequestStream:
    def __init__(
        self, request: GenerationRequest, events: EventChannel, cancel: Callable[[str], None]
    ) -> None:
        self.request = request
        self._events = events
        self._cancel = cancel
        self.finished: Finished | None = None
        self.observers: list[Callable[[Event], None]] = []  # see every event as it is read
        self._holds_final = False
        self._released: Finished | None = None  # the owner's final event, the one the reader reads

    @property
    def done(self) -> asyncio.Future[Finished | BaseException]:
        """Resolves with the engine's last event when it is done with this request, whoever reads."""
        return self._events.done

    def hold_final(self) -> None:
        """Keep the engine's Finished from the reader until `finish` (before handing the stream out)."""
        self._holds_final = True

    def finish(self, final: Finished | BaseException) -> None:
        """The owner's last word: the engine's Finished once the turn is durable, or the error that
        kept it from being so (raised to the reader)."""
        if isinstance(final, Finished):
            self._released = final
        self._events.queue.put_nowait(final)

    def cancel(self) -> None:
        if self.finished is None:
            self._cancel(self.request.request_id)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (raised to its reader) and free its batch slot."""
        if self.finished is None:
            self._events.put(error)
            self.cancel()

    async def read(self) -> Event:
        """The next event; an error event is raised. Safe to cancel (a keep-alive's timeout): only
        the wait is cancelled, no event is lost."""
        while True:
            event = await self._events.queue.get()
            held = isinstance(event, Finished) and self._holds_final and event is not self._released
            if not held:  # the engine's Finished of a held stream: its owner finishes the stream
                break
        for observe in self.observers:
            observe(event)
        if isinstance(event, BaseException):
            self.finished = Finished(FinishReason.CANCELLED, None, 0, 0, 0)
            raise event
        if isinstance(event, Finished):
            self.finished = event
        return event

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while self.finished is None:
                yield await self.read()
        finally:
            self.cancel()
