"""Drains: asks to be answered once nothing runs or waits, or, past their timeout, once what runs and
waits has been failed. The engine thread keeps them and checks them every tick."""

from __future__ import annotations

import time
from dataclasses import dataclass

from semantic.engine.loop.commands import PendingAsk


@dataclass(slots=True)
class PendingDrain:
    deadline: float
    reason: str
    envelope: PendingAsk
    num_failed: int = 0


class Drains:
    def __init__(self) -> None:
        self._pending: list[PendingDrain] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, envelope: PendingAsk, timeout_s: float, reason: str) -> None:
        self._pending.append(PendingDrain(time.monotonic() + timeout_s, reason, envelope))

    def expired_reason(self, now: float, busy: bool) -> str | None:
        """Why this tick fails what runs and waits: a drain whose timeout passed (None: none did)."""
        if not busy:
            return None
        for drain in self._pending:
            if now >= drain.deadline:
                return f"cancelled: {drain.reason}, and the drain timeout passed"
        return None

    def count_failed(self, num_failed: int) -> None:
        """Requests failed for a drain: each drain answers with how many it cost."""
        for drain in self._pending:
            drain.num_failed += num_failed

    def answer_all(self) -> None:
        drains, self._pending = self._pending, []
        for drain in drains:
            drain.envelope.answer(drain.num_failed)

    def fail_all(self, error: BaseException) -> None:
        drains, self._pending = self._pending, []
        for drain in drains:
            drain.envelope.fail(error)
