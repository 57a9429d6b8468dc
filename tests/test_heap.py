"""The heap: a reserve faulted in stays mapped once freed (under the launcher's malloc settings), and
the free pages beyond it are given back once in each quiet spell, never while requests are in flight."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from semantic.actors import heap
from semantic.launch import MALLOC_TUNING

RESERVE = 64 << 20
SHOW_RSS = """
import sys
from semantic.actors.heap import keep_heap_ready, give_memory_back
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
kept = keep_heap_ready(int(sys.argv[1]))
ready = rss()
give_memory_back()
print(kept, ready - before, rss() - before)
"""


def rss_growth(environ: dict[str, str]) -> list[str]:
    """What a fresh process printed: whether it kept the reserve, and its RSS growth once the reserve
    was faulted in and freed, then after a trim."""
    command = [sys.executable, "-c", SHOW_RSS, str(RESERVE)]
    return subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=120, env=environ
    ).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_freed_reserve_stays_mapped_under_the_launchers_malloc_settings_until_trimmed() -> None:
    plain = {name: value for name, value in os.environ.items() if name not in MALLOC_TUNING}
    kept, ready, trimmed = rss_growth(plain | MALLOC_TUNING)
    assert kept == "True"
    assert int(ready) >= RESERVE * 0.9  # freed, and still mapped: the next arrays take these pages
    assert int(trimmed) < RESERVE * 0.5  # a trim gives them back
    kept, ready, _ = rss_growth(plain)  # without the settings glibc would unmap a freed 4 MB block
    assert kept == "False" and int(ready) < RESERVE * 0.5


def test_the_heap_is_trimmed_once_per_quiet_spell_and_not_while_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[float] = []
    reserves: list[int] = []
    now = [1000.0]  # the trimmer's clock, moved by the test
    quiet_since: list[float | None] = [None]  # when the current quiet spell began; None while busy
    free = [RESERVE * 2]
    monkeypatch.setattr(heap, "give_memory_back", lambda: trims.append(now[0]) or True)
    monkeypatch.setattr(heap, "keep_heap_ready", lambda num_bytes: reserves.append(num_bytes) or True)
    monkeypatch.setattr(heap, "free_heap_bytes", lambda: free[0])

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
            heap.give_memory_back_when_idle(
                quiet_for_s, RESERVE, idle_s=60, poll_s=0.0005, clock=lambda: now[0]
            )
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
        assert reserves == [RESERVE, RESERVE]  # faulted in again after each trim
        free[0] = RESERVE  # no more than the reserve is free: kept as it is
        quiet_since[0] = None
        now[0] += 5
        await polls()
        quiet_since[0] = now[0]
        now[0] += 61
        await polls(50)
        assert trims == [1061.0, 1227.0] and reserves == [RESERVE, RESERVE]
        trimmer.cancel()

    asyncio.run(run())
