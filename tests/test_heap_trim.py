"""The heap is given back once in each quiet spell of `idle_s`, never while requests are in flight."""

from __future__ import annotations

import asyncio

import pytest

from semantic import launch


def test_the_heap_is_trimmed_once_per_quiet_spell_and_not_while_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[float] = []
    now = [1000.0]  # the trimmer's clock, moved by the test
    quiet_since: list[float | None] = [None]  # when the current quiet spell began; None while busy
    monkeypatch.setattr(launch, "give_memory_back", lambda: trims.append(now[0]) or True)

    def quiet_for_s() -> float:
        since = quiet_since[0]
        return 0.0 if since is None else now[0] - since

    async def polls(n: int = 10) -> None:
        for _ in range(n):
            await asyncio.sleep(0.001)

    async def wait_for_trims(count: int) -> None:
        while len(trims) < count:
            await asyncio.sleep(0.001)

    async def run() -> None:
        trimmer = asyncio.create_task(
            launch.give_memory_back_when_idle(quiet_for_s, idle_s=60, poll_s=0.0005, clock=lambda: now[0])
        )
        await polls()
        assert trims == []  # busy
        quiet_since[0] = now[0]
        now[0] += 30
        await polls()
        assert trims == []  # quiet, not long enough
        now[0] += 31
        await wait_for_trims(1)
        now[0] += 100
        await polls()
        assert trims == [1061.0]  # once in this spell, however long it lasts
        quiet_since[0] = None
        now[0] += 5
        await polls()
        quiet_since[0] = now[0]  # a new spell
        now[0] += 61
        await wait_for_trims(2)
        assert trims == [1061.0, 1227.0]
        trimmer.cancel()

    asyncio.run(run())
