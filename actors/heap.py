"""The process heap under the launcher's malloc settings: a reserve kept ready, the rest given back.

On Linux MLX's CPU allocator mallocs every array, and the launcher (semantic/launch.py) keeps glibc
from handing freed memory back to the kernel, so arrays reuse pages that are already mapped. What
was never touched costs a page fault per 4 KB on first use (docs/benchmarks.md, "Linux CPU speed"):
a returning agent's first turn after a restart reads its cache file, fills its blocks and builds its
history in one array, about three times its KV bytes, and would pay those faults before its first
token. So the server faults a reserve in before it listens (`cache.heap_reserve_mb`); once idle, it
keeps the heap as it is while no more than the reserve is free, and otherwise gives the free pages
back and faults the reserve in again: an idle daemon holds the reserve, not its busiest moment.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import sys
import time
from collections.abc import Callable

from loguru import logger

HEAP_TRIM_IDLE_S = 60.0
RESERVE_PIECE_BYTES = 4 << 20


MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc with the signatures used here declared once; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if hasattr(libc, "mallinfo2"):  # glibc 2.33 and later
        libc.mallinfo2.restype = _MallInfo2
    return libc


def free_heap_bytes() -> int | None:
    """Bytes free in the heap (glibc's `mallinfo2().fordblks`); None where it cannot be read."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


def keep_heap_ready(num_bytes: int) -> bool:
    """Fault `num_bytes` of heap in and free them again: they stay mapped, and the next arrays that
    fit take them without a page fault. False where the heap would not keep them."""
    libc = _libc()
    # freed memory stays in the heap only under the launcher's settings (no `mmap` for large blocks)
    if num_bytes <= 0 or libc is None or os.environ.get("MALLOC_MMAP_MAX_") != "0":
        return False
    pieces = []
    for _ in range(-(-num_bytes // RESERVE_PIECE_BYTES)):
        piece = libc.malloc(RESERVE_PIECE_BYTES)
        if not piece:
            break
        ctypes.memset(piece, 0, RESERVE_PIECE_BYTES)  # a write maps every page (a read, the zero page)
        pieces.append(piece)
    for piece in pieces:
        libc.free(piece)
    return bool(pieces)


def give_memory_back() -> bool:
    """Return the heap's free pages to the kernel (glibc `malloc_trim`), after a huge request.

    The launcher's malloc setting keeps the heap at its peak size, which is what decoding wants;
    a 30 MB prompt tokenized and refused would otherwise leave gigabytes behind for good.
    """
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


def trim_to_reserve(reserve_bytes: int) -> int | None:
    """Give the heap's free pages back and fault `reserve_bytes` in again, unless no more than that
    is free; the bytes that were free where it trimmed, else None."""
    free = free_heap_bytes()
    if free is not None and free <= reserve_bytes:
        return None  # no more than the reserve: keep it
    give_memory_back()
    keep_heap_ready(reserve_bytes)
    return free or 0


async def give_memory_back_when_idle(
    quiet_for_s: Callable[[], float],
    reserve_bytes: int = 0,
    idle_s: float = HEAP_TRIM_IDLE_S,
    poll_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Once `quiet_for_s()` (seconds with no request in flight) reaches `idle_s`, trim the heap to
    `reserve_bytes` (`trim_to_reserve`) in a worker thread, once for each quiet spell; for as long as
    it runs.

    The launcher keeps the heap at its peak while work runs (decoding wants it), but a daemon is
    idle most of the time and would otherwise hold its busiest moment's memory for good (the soak's
    heap trims: bench/results/soak.json).
    Under load it does nothing: the next steps would only fault the same pages in again.
    """
    loop = asyncio.get_running_loop()
    trimmed_at = -float("inf")
    while True:
        await asyncio.sleep(poll_s)
        quiet_s = quiet_for_s()
        if quiet_s < idle_s or clock() - quiet_s <= trimmed_at:
            continue  # busy, or trimmed already in this quiet spell
        trimmed_at = clock()
        started = time.perf_counter()
        free = await loop.run_in_executor(None, trim_to_reserve, reserve_bytes)
        if free is not None:
            logger.debug("trimmed the heap to its reserve in {:.1f} ms ({} MB were free)",
                         (time.perf_counter() - started) * 1e3, free >> 20)  # fmt: skip
