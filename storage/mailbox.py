"""One actor's mailbox: asks queued with their reply futures, read in order by the actor's one task.

The rules, after pykka (`_actor.py`, `_envelope.py`): an ask's answer or failure goes to its
caller's future, unless the caller left (cancelled it), and the actor lives on either way; a full
mailbox refuses an ask at once; a closed one refuses new asks and fails every queued one, so no
caller waits for ever. The agent and persistence actors read one; the engine thread reads a thread
queue instead and shares only `PendingAsk`'s reply rule (`reply_to`, see engine/loop/commands.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from semantic.engine.loop.commands import reply_to

M = TypeVar("M")


@dataclass(slots=True)
class Envelope(Generic[M]):
    """A message and where its answer goes: None for a tell, which nobody awaits."""

    message: M
    reply: asyncio.Future[Any] | None = None


class Mailbox(Generic[M]):
    def __init__(self, capacity: int | None = None, full: Callable[[], Exception] | None = None) -> None:
        """`full` makes the error an ask gets while `capacity` messages wait (None: unbounded)."""
        self.capacity = capacity
        self._full = full
        self._queue: deque[Envelope[M]] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the actor's task, waiting in `get`
        self._closed: Callable[[], BaseException] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def is_closed(self) -> bool:
        return self._closed is not None

    def ask(self, message: M) -> asyncio.Future[Any]:
        """Queue `message`; its answer comes in the returned future. Raises when full or closed."""
        if self.capacity is not None and len(self._queue) >= self.capacity and self._closed is None:
            raise self._full() if self._full is not None else RuntimeError("the mailbox is full")
        return self.post(message)

    def post(self, message: M) -> asyncio.Future[Any]:
        """An ask past the bound (a delete or a stop always gets in); raises only when closed."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._put(Envelope(message, reply))
        return reply

    def tell(self, message: M) -> None:
        """A message nobody awaits an answer to, past the bound."""
        self._put(Envelope(message))

    def take(self, which: Callable[[M], bool]) -> list[Envelope[M]]:
        """Remove the queued messages `which` picks, in order, and hand them to the caller to answer."""
        taken = [envelope for envelope in self._queue if which(envelope.message)]
        kept = [envelope for envelope in self._queue if not which(envelope.message)]
        self._queue = deque(kept)
        return taken

    async def get(self) -> Envelope[M] | None:
        """The next message, in order; None once closed. Safe to cancel (an idle timeout)."""
        while not self._queue:
            if self._closed is not None:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def close(self, error: Callable[[], BaseException]) -> None:
        """Refuse later asks with `error()` and fail every queued one with it; `get` returns None."""
        if self._closed is None:
            self._closed = error
        while self._queue:
            reply_to(self._queue.popleft().reply, error=error())
        self._wake()

    def _put(self, envelope: Envelope[M]) -> None:
        if self._closed is not None:
            raise self._closed()
        self._queue.append(envelope)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
