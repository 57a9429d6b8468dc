"""Waiting for a condition in tests: poll until it holds, for as long as a busy machine may need.

The bound is generous on purpose (the per-test timeout is the real limit): a test checks that a
thing happens, never how fast. Speed belongs to `bench/`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

PATIENCE_S = 300.0


def wait_until(condition: Callable[[], bool], what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {PATIENCE_S:.0f} s")
        time.sleep(interval_s)


async def wait_until_async(
    condition: Callable[[], Awaitable[bool]], what: str, interval_s: float = 0.05
) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so after {PATIENCE_S:.0f} s")
        await asyncio.sleep(interval_s)
