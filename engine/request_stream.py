"""The asyncio side of one request: iterate its events; `cancel` frees its batch slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from semantic.engine.messages import Event, EventChannel, Finished, FinishReason, GenerationRequest


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
        """Resolves with the last event when the engine is done with this request, whoever reads."""
        return self._events.done

    def cancel(self) -> None:
        if self.finished is None:
            self._cancel(self.request.request_id)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (raised to its reader) and free its batch slot."""
        if self.finished is None:
            self._events.put(error)
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while self.finished is None:
                event = await self._events.queue.get()
                for observe in self.observers:
                    observe(event)
                if isinstance(event, BaseException):
                    self.finished = Finished(FinishReason.CANCELLED, None, 0, 0, 0)
                    raise event
                if isinstance(event, Finished):
                    self.finished = event
                yield event
        finally:
            self.cancel()
