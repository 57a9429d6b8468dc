"""Events the engine thread produced, delivered to the event loop in one call per tick."""

from __future__ import annotations

import asyncio

from semantic.engine.loop.messages import Event, EventChannel


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: list[tuple[EventChannel, list[Event]]] = []

    def __bool__(self) -> bool:
        """Whether events wait for the next flush."""
        return bool(self._pending)

    def post(self, events: EventChannel, event: Event) -> None:
        self._pending.append((events, [event]))

    def post_many(self, events: EventChannel, batch: list[Event]) -> None:
        if batch:
            self._pending.append((events, list(batch)))

    def flush(self) -> None:
        """Hand everything posted so far to the loop, in posting order."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._loop.call_soon_threadsafe(_deliver, pending)


def _deliver(pending: list[tuple[EventChannel, list[Event]]]) -> None:
    for events, batch in pending:
        for event in batch:
            events.put(event)
