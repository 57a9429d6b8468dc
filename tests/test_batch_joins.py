"""The decode batch's caches (mlx_adapter/batch_joins.py): any run of joins, leaves and steps leaves every
sequence's history, padding, offset and write index as mlx-lm's `BatchKVCache` leaves them, with
room after the write index after a join; the load-time check fails on a join that is wrong."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache

from semantic.engine.mlx_adapter.batch_joins import JoiningBatchKVCache, check_joins_match_mlx_lm
from semantic.engine.mlx_adapter.seam_check import SeamError

HEADS, DIM, STEP = 2, 3, 4  # a small step: joins and steps cross the arrays' ends often


@st.composite
def batches(draw: st.DrawFn, max_rows: int = 3) -> tuple[list[int], int]:
    """A batch as mlx-lm builds one: each row's left padding, and the tokens written so far."""
    num_rows = draw(st.integers(1, max_rows))
    length = draw(st.integers(1, 12))
    padding = [draw(st.integers(0, length - 1)) for _ in range(num_rows)]
    return padding, length


def build(cls: type[BatchKVCache], padding: list[int], length: int, seed: int) -> Any:
    cache = cls(left_padding=padding)
    cache.step = STEP
    keys = mx.random.normal((len(padding), HEADS, length, DIM), key=mx.random.key(seed))
    cache.update_and_fetch(keys, keys * 2 + 1)
    return cache


def assert_same(ours: Any, theirs: Any) -> None:
    assert ours._idx == theirs._idx
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.keys.shape[:2] == theirs.keys.shape[:2]
    assert mx.array_equal(ours.keys[..., : ours._idx, :], theirs.keys[..., : theirs._idx, :])
    assert mx.array_equal(ours.values[..., : ours._idx, :], theirs.values[..., : theirs._idx, :])
    assert mx.array_equal(ours.make_mask(1), theirs.make_mask(1))


operations = st.one_of(
    st.tuples(st.just("join"), batches(max_rows=2)),
    st.tuples(st.just("leave"), st.lists(st.booleans(), min_size=1, max_size=6)),
    st.tuples(st.just("step"), st.integers(1, 5)),
)


@settings(max_examples=150, deadline=None)
@given(start=batches(), steps=st.lists(operations, min_size=1, max_size=8))
def test_joins_leaves_and_steps_leave_what_mlx_lm_s_batch_cache_leaves(
    start: tuple[list[int], int], steps: list[tuple[str, Any]]
) -> None:
    ours = JoiningBatchKVCache.adopt(build(BatchKVCache, *start, seed=0))
    theirs = build(BatchKVCache, *start, seed=0)
    assert type(ours) is JoiningBatchKVCache
    for seed, (kind, arg) in enumerate(steps, start=1):
        if kind == "join":
            ours.extend(build(BatchKVCache, *arg, seed=seed))
            theirs.extend(build(BatchKVCache, *arg, seed=seed))
            # Room for the next step to write in place, and no more than a step of it.
            assert ours._idx < ours.keys.shape[2] <= ours._idx + STEP
        elif kind == "leave":
            num_rows = ours.keys.shape[0]
            keep = [i for i in range(num_rows) if arg[i % len(arg)]] or [num_rows - 1]
            ours.filter(keep)
            theirs.filter(keep)
        else:
            rows = ours.keys.shape[0]
            new = mx.random.normal((rows, HEADS, arg, DIM), key=mx.random.key(1000 + seed))
            ours_kv = ours.update_and_fetch(new, -new)
            theirs_kv = theirs.update_and_fetch(new, -new)
            assert all(mx.array_equal(a, b) for a, b in zip(ours_kv, theirs_kv, strict=True))
        assert_same(ours, theirs)


def test_only_mlx_lm_s_plain_batch_cache_is_adopted() -> None:
    plain = build(BatchKVCache, [1, 0], 3, seed=0)
    adopted = JoiningBatchKVCache.adopt(plain)
    assert type(adopted) is JoiningBatchKVCache and adopted.keys is plain.keys  # the same arrays
    assert JoiningBatchKVCache.adopt(adopted) is adopted
    other = object()
    assert JoiningBatchKVCache.adopt(other) is other


def test_the_load_time_check_fails_on_a_join_that_misplaces_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    check_joins_match_mlx_lm()  # holds for the installed mlx-lm

    def left_aligned(self: Any, other: Any) -> None:
        BatchKVCache.extend(self, other)
        self.left_padding = self.left_padding * 0  # as if rows had not moved

    monkeypatch.setattr(JoiningBatchKVCache, "extend", left_aligned)
    with pytest.raises(SeamError, match="extend right-aligns"):
        check_joins_match_mlx_lm()
