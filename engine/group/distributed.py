"""One model over several processes: the group `mlx.launch` starts, and what the ranks say to each other.

Under `mlx.launch` (ring over TCP or Thunderbolt, MPI, JACCL, NCCL) every rank runs
`semantic serve`; `mx.distributed.init()` returns the group it set up. Rank 0 runs the daemon and
its engine leads: before each tick it shares the tick's plan (`engine/group/group_tick.py`), and the other
ranks apply the same plan, so every rank makes the same model calls in the same order and
mlx-lm's sharded layers meet in their collectives. Everything here is a collective: every rank
calls it at the same point of the same tick.

A rank that dies breaks the ring at once (the next collective raises `GroupLostError`); one that
stalls is caught by `Watchdog`, which ends the process with a clear error instead of a hang.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from loguru import logger

EXIT_GROUP_LOST = 3  # the process status when a rank is lost or stalls


class GroupLostError(RuntimeError):
    """Another rank is gone: a collective failed. Nothing more can run on this group."""


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """How a model is split: `parallel` is "tensor" (heads and MLP columns) or "pipeline" (layers)."""

    rank: int
    size: int
    parallel: str
    backend: str

    @property
    def name(self) -> str:
        """Same on every rank: part of the model's fingerprint, so caches of other layouts never match."""
        return f"{self.parallel}x{self.size}"

    @property
    def shard(self) -> str:
        """This rank's part: written into its cache files and checked when they are read back."""
        return f"{self.parallel} rank {self.rank} of {self.size}"


def launched_group() -> mx.distributed.Group | None:
    """The group this process was launched into, or None when it runs alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def backend_name(environ: dict[str, str] | None = None) -> str:
    """Which of mlx.launch's backends set up the group, from the environment it passes."""
    env = os.environ if environ is None else environ
    if "MLX_IBV_DEVICES" in env or "MLX_JACCL_COORDINATOR" in env:
        return "jaccl"
    if "MLX_HOSTFILE" in env:
        return "ring"
    if "OMPI_COMM_WORLD_SIZE" in env or "MLX_MPI_LIBNAME" in env:
        return "mpi"
    if "NCCL_HOST_IP" in env or "MLX_WORLD_SIZE" in env:
        return "nccl"
    return "unknown"


def layout_of(group: mx.distributed.Group, pipeline: bool) -> GroupLayout:
    return GroupLayout(group.rank(), group.size(), "pipeline" if pipeline else "tensor", backend_name())


def heartbeat_s(rank_timeout_s: float) -> float:
    """How often an idle rank 0 tells the others it is alive: well within their timeout."""
    return max(0.05, min(2.0, rank_timeout_s / 10))


class Watchdog:
    """Ends the process when the group keeps this rank waiting longer than an allowance.

    A collective blocks in MLX's C++ code, where no Python timeout reaches, and a peer that dies
    in the middle of a model step can leave it blocked for good; a thread watches the clock
    instead. Allowances nest (a tick, the collectives inside it); the innermost one counts. When
    one runs out, `on_stall` (rank 0: fail every open request, so clients get an error) gets
    `grace_s` to let the process end on its own, then `os._exit`: with a rank gone the group
    cannot write a consistent set of shards, and every file already on disk was written atomically.
    """

    def __init__(
        self, rank: int, on_stall: Callable[[str], None] | None = None, grace_s: float = 5.0
    ) -> None:
        self._rank = rank
        self.on_stall = on_stall
        self._grace_s = grace_s
        self._allowances: list[tuple[str, float]] = []  # (what, deadline), innermost last
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="semantic-rank-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def allow(self, what: str, timeout_s: float) -> Iterator[None]:
        self._allowances.append((what, time.monotonic() + timeout_s))
        self._wake.set()
        try:
            yield
        finally:
            self._allowances.pop()

    def _watch(self) -> None:
        while True:
            allowances = self._allowances
            if not allowances:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            what, deadline = allowances[-1]
            if time.monotonic() >= deadline:
                self._fire(what)
                return
            time.sleep(min(0.2, max(0.01, deadline - time.monotonic())))

    def _fire(self, what: str) -> None:
        message = f"a rank of the model's group did not answer in time ({what}): it stalled or is gone"
        logger.error("rank {}: {}; stopping (cache files already on disk stay valid)", self._rank, message)
        if self.on_stall is not None:
            try:
                self.on_stall(message)
            except Exception:
                logger.exception("failing open requests after the stall failed")
            time.sleep(self._grace_s)
        logger.complete()
        os._exit(EXIT_GROUP_LOST)


class Collectives:
    """The few things ranks tell each other besides the model's own collectives, each bounded by
    the watchdog: rank 0's bytes to every rank, a flag all ranks must agree on, one number each."""

    def __init__(self, group: mx.distributed.Group, timeout_s: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.timeout_s = timeout_s
        self.watchdog = Watchdog(self.rank)

    def _sum(self, values: mx.array, what: str, timeout_s: float | None = None) -> mx.array:
        with self.watchdog.allow(what, timeout_s or self.timeout_s):
            try:
                total = mx.distributed.all_sum(values, group=self.group, stream=mx.cpu)
                mx.eval(total)
            except RuntimeError as error:
                raise GroupLostError(f"{what}: {error}") from None
        return total

    def share_header(
        self, header: list[int] | None, length: int, timeout_s: float | None = None
    ) -> list[int]:
        """Rank 0 passes `header` (`length` int64s); every rank gets rank 0's."""
        values = np.zeros(length, dtype=np.int64)
        if self.rank == 0:
            assert header is not None and len(header) == length, "rank 0 shares a whole header"
            values[:] = header
        what = "waiting for rank 0's next tick" if self.rank else "sharing the next tick with the other ranks"
        total = self._sum(mx.array(values), what, timeout_s)
        return [int(v) for v in np.array(total)]

    def share_bytes(self, data: bytes | None, num_bytes: int) -> bytes:
        """Rank 0 passes `data`; every rank gets it (its length went in the header)."""
        values = np.zeros(num_bytes, dtype=np.uint8)
        if self.rank == 0:
            assert data is not None and len(data) == num_bytes, "rank 0 shares all its bytes"
            values[:] = np.frombuffer(data, dtype=np.uint8)
        return bytes(np.array(self._sum(mx.array(values), "sharing a tick plan")))

    def agree(self, ok: bool, what: str) -> bool:
        """True only if every rank passes True."""
        votes = self._sum(mx.array([1 if ok else 0], dtype=mx.int32), what)
        return int(np.array(votes)[0]) == self.size

    def gather(self, value: int, what: str) -> list[int]:
        """Every rank's `value`, by rank."""
        values = np.zeros(self.size, dtype=np.int64)
        values[self.rank] = value
        return [int(v) for v in np.array(self._sum(mx.array(values), what))]
