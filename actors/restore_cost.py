"""Whether a returning agent's cache is read from disk or computed again: decided per restore, by cost.

On a CPU a cache file reads far faster than its tokens prefill; on a GPU it can be the other way
(bench/results/cuda-h200/agent_resume.json: from disk slower than cold). So each restore compares two
estimates: the file's bytes at the read bandwidth of this server's own cache-file reads, and the
history's tokens at the prefill speed of the engine's own steps on this backend. Until both are
known the cache is read: a probe at start-up would time a small file out of the page cache (not
the disk) and a prefill of no real prompt.

Read bandwidth is an exponentially weighted mean of what the persistence actor's counters
(`num_read_bytes`, `read_s_total`) gained between decisions. Prefill speed is the slope the
engine's prefill budget fits through its chunks' times (`EngineStats.prefill_token_s`, weighted
towards the newest): what one more token costs. Not the mean time per token: the turn's new tokens
pay a chunk's fixed cost either way, and on a GPU that fixed cost is most of a short turn's time,
so a mean over short turns would price a 3K-token history several times too high.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the newest measurement in a mean
# A read estimated under this is taken whatever computing would cost: the estimates' noise is then
# larger than what is at stake, and a turn's tier should not flip between read and computed on it.
ALWAYS_READ_S = 0.02


@dataclass(slots=True)
class RateMean:
    """An exponentially weighted mean of a rate (units per second); None until measured."""

    per_s: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.per_s = rate if self.per_s is None else (1 - SMOOTHING) * self.per_s + SMOOTHING * rate


@dataclass(frozen=True, slots=True)
class Totals:
    """A counter pair as its owner keeps it: what was done (bytes, tokens) and the seconds it took."""

    amount: float
    seconds: float


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    """Read the file or compute the history again, with the two estimates it was made on (None: a
    rate not measured yet)."""

    reads: bool
    read_s: float | None
    compute_s: float | None

    def summary(self) -> str:
        """For the request's log line: `read(0.004s<3.915s)`, `computed(0.1s<0.3s)`, `read(unmeasured)`."""
        if self.read_s is None or self.compute_s is None:
            return "read(unmeasured)"
        read, compute = _seconds(self.read_s), _seconds(self.compute_s)
        return f"read({read}<={compute})" if self.reads else f"computed({compute}<{read})"

    def __str__(self) -> str:
        read, compute = _seconds(self.read_s), _seconds(self.compute_s)
        if self.read_s is None or self.compute_s is None:
            return f"cache: read from disk (not measured yet: read {read}, computed {compute})"
        if self.reads:
            return f"cache: read from disk (est. {read}) rather than computed (est. {compute})"
        return f"cache: computed again (est. {compute}) rather than read from disk (est. {read})"


def decide_restore(
    num_bytes: int, num_tokens: int, read_bytes_per_s: float | None, prefill_tokens_per_s: float | None
) -> RestoreDecision:
    """Read a cache file of `num_bytes` holding `num_tokens`, or prefill those tokens again: read
    unless both rates are known, the read is estimated at `ALWAYS_READ_S` or more, and computing is
    estimated faster (a tie reads: the read runs on the persistence thread, beside the engine's
    work, and computing takes the engine's)."""
    read_s = num_bytes / read_bytes_per_s if read_bytes_per_s else None
    compute_s = num_tokens / prefill_tokens_per_s if prefill_tokens_per_s else None
    reads = read_s is None or compute_s is None or read_s < ALWAYS_READ_S or read_s <= compute_s
    return RestoreDecision(reads, read_s, compute_s)


class RestoreCosts:
    """The learnt rates, shared by an agent system's actors (on the event loop only).

    `read_bytes_per_s` and `prefill_tokens_per_s` are the rates to start from (None: not measured);
    with `learns=False` they stay as given, which is how tests pick a decision without a slow disk."""

    def __init__(
        self,
        read_bytes_per_s: float | None = None,
        prefill_tokens_per_s: float | None = None,
        learns: bool = True,
    ) -> None:
        self.read = RateMean(read_bytes_per_s)
        self.prefill = RateMean(prefill_tokens_per_s)
        self.learns = learns
        # the read counters as last seen, with whose they were: a new persistence actor (a model
        # swap) counts from 0
        self._reads_seen: tuple[int, Totals] | None = None

    def learn(self, reader: object, reads: Totals, prefill_token_s: float) -> None:
        """Fold in what the read counters of `reader` (a persistence actor) gained since last seen,
        and take the engine's prefill time per token (0: not measured for this model yet)."""
        if not self.learns:
            return
        self.prefill = RateMean(1 / prefill_token_s if prefill_token_s > 0 else None)
        seen_reads, self._reads_seen = self._reads_seen, (id(reader), reads)
        if seen_reads is not None and seen_reads[0] == id(reader):
            _add_gain(self.read, seen_reads[1], reads)
        else:  # a reader not seen before counted from 0
            self.read.add(reads.amount, reads.seconds)

    def decide(self, num_bytes: int, num_tokens: int) -> RestoreDecision:
        return decide_restore(num_bytes, num_tokens, self.read.per_s, self.prefill.per_s)


def _add_gain(mean: RateMean, before: Totals, now: Totals) -> None:
    mean.add(now.amount - before.amount, now.seconds - before.seconds)


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f} s"
