"""The decode batch's caches, with sequences joining and leaving it at one copy of each history.

mlx-lm keeps a batch's keys and values in one array per layer, every sequence a row right-aligned
at a shared write index, so a sequence joining or leaving the batch rewrites every row. Its
`BatchKVCache.extend` does that in two or three copies: it pads both batches, then concatenates the
padded arrays, leaving no room when the longest joiner had none, so the next step grows the array
by concatenating again. Here a join is one copy into a fresh array with room after the write index
(up to a step of it), and a leave gathers the kept rows from their shifted start (mlx-lm gathers
whole rows, then shifts a view).

With long histories those copies are most of a join's or a leave's time, so one copy instead of two
or three is the gain. Each sequence's history up to the write index, and every field mlx-lm's
methods set, come out as mlx-lm's would (`check_joins_match_mlx_lm`, run at load). Written against
mlx-lm 0.32.2's `BatchKVCache` (its fields `_idx`, `left_padding`, `offset`, `step`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from semantic.engine.mlx_adapter.seam_check import require


class JoiningBatchKVCache(BatchKVCache):
    """mlx-lm's `BatchKVCache` whose `extend` (a join) and `filter` (a leave) copy each sequence's
    history once."""

    @classmethod
    def adopt(cls, cache: Any) -> Any:
        """`cache` as a JoiningBatchKVCache over the same arrays (no copy) if it is a plain
        BatchKVCache; any other cache as it is."""
        if type(cache) is not BatchKVCache:
            return cache
        joining = cls([])
        joining.__dict__.update(cache.__dict__)
        return joining

    def extend(self, other: Any) -> None:
        if self.keys is None or other.keys is None or self.keys.dtype != other.keys.dtype:
            super().extend(other)
            return
        write_index = max(self._idx, other._idx)
        length = (write_index // self.step + 1) * self.step  # room for 1 to `step` tokens, as a step grows it
        num_rows = self.keys.shape[0]

        def joined(ours: mx.array, theirs: mx.array) -> mx.array:
            shape = (num_rows + theirs.shape[0], ours.shape[1], length, ours.shape[3])
            rows = mx.zeros(shape, dtype=ours.dtype)
            rows[:num_rows, :, write_index - self._idx : write_index] = ours[..., : self._idx, :]
            rows[num_rows:, :, write_index - other._idx : write_index] = theirs[..., : other._idx, :]
            return rows

        self.keys = joined(self.keys, other.keys)
        self.values = joined(self.values, other.values)
        self.left_padding = mx.concatenate(
            [self.left_padding + (write_index - self._idx), other.left_padding + (write_index - other._idx)]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = write_index

    def filter(self, batch_indices: Any) -> None:
        if self.keys is None:
            super().filter(batch_indices)
            return
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        keys, values = self.keys, self.values
        if shift > 0:
            keys, values = keys[..., shift:, :], values[..., shift:, :]
            self._idx -= shift
            self.left_padding -= shift
        # One gather of the shifted rows: a fresh contiguous array that the next step writes in place.
        self.keys, self.values = keys[batch_indices], values[batch_indices]


def check_joins_match_mlx_lm() -> None:
    """A join and a leave leave every field mlx-lm's own `extend` and `filter` would, and the same
    keys and values up to the write index; a step after them writes where mlx-lm's writes."""

    def same_as_mlx_lm() -> bool:
        ours, theirs = _probe_batch(JoiningBatchKVCache), _probe_batch(BatchKVCache)
        joiner_length = 7  # longer than the batch's rows: every row moves right
        ours.extend(_probe_joiner(joiner_length))
        theirs.extend(_probe_joiner(joiner_length))
        if not _same(ours, theirs):
            return False
        ours.filter([1, 2])  # the row with the least padding leaves: the rest shift left
        theirs.filter([1, 2])
        new = mx.full((2, 2, 1, 3), 9.0)
        ours.update_and_fetch(new, new)
        theirs.update_and_fetch(new, new)
        return _same(ours, theirs)

    require(
        "BatchKVCache keeps `keys`, `values`, `left_padding`, `offset`, `_idx` and `step`, extend "
        "right-aligns both batches at the larger write index and filter drops the padding all kept "
        "rows share (JoiningBatchKVCache does both in one copy)",
        same_as_mlx_lm,
    )


def _probe_batch(cls: type[BatchKVCache]) -> Any:
    batch = cls(left_padding=[2, 0])
    keys = mx.arange(2 * 2 * 5 * 3, dtype=mx.float32).reshape(2, 2, 5, 3)
    batch.update_and_fetch(keys, keys + 100)
    return batch


def _probe_joiner(length: int) -> Any:
    joiner = BatchKVCache(left_padding=[0])
    keys = mx.arange(2 * length * 3, dtype=mx.float32).reshape(1, 2, length, 3) + 1000
    joiner.update_and_fetch(keys, keys + 100)
    return joiner


def _same(ours: Any, theirs: Any) -> bool:
    return (
        ours._idx == theirs._idx
        and ours.offset.tolist() == theirs.offset.tolist()
        and ours.left_padding.tolist() == theirs.left_padding.tolist()
        and all(bool(mx.array_equal(a, b)) for a, b in zip(_history(ours), _history(theirs), strict=True))
    )


def _history(batch: Any) -> tuple[mx.array, mx.array]:
    return batch.keys[..., : batch._idx, :], batch.values[..., : batch._idx, :]
