"""The asyncio side of one request: read its events; `cancel` frees its batch slot.

One queue carries a request's events to its one reader. An owner that must make the turn durable
first (an agent actor saving a kept conversation) calls `hold_final` as it submits: the engine's
`Finished` then resolves `done` and never enters the queue; the owner `finish`es the stream with it
once committed, or with the error that stopped the commit, so the final event travels once and
the reader's means durable.
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

    @property
    def done(self) -> asyncio.Future[Finished | BaseException]:
        """Resolves with the engine's last event when it is done with this request, whoever reads."""
        return self._events.done

    def hold_final(self) -> None:
        """Keep the engine's Finished from the reader until `finish`: called before any event can
        arrive (before the submitting task yields), as one already queued would be the reader's."""
        assert self._events.queue.empty() and not self.done.done(), "final held too late: caller bug"
        self._events.holds_final = True

    def finish(self, final: Finished | BaseException) -> None:
        """The owner's last word: the engine's Finished once the turn is durable, or the error that
        kept it from being so (raised to the reader)."""
        assert self._events.holds_final, "finish of a stream whose final event is not held: caller bug"
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
        event = await self._events.queue.get()
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
