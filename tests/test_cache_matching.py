"""common_prefix_length against its definition, for lists that share long prefixes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from semantic.engine.cache_store.cache_matching import common_prefix_length


def shared_by_definition(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(st.lists(st.integers(0, 2), max_size=200), st.lists(st.integers(0, 2), max_size=200))
def test_any_two_lists(a: list[int], b: list[int]) -> None:
    assert common_prefix_length(a, b) == shared_by_definition(a, b)


@given(
    st.lists(st.integers(0, 50_000), min_size=0, max_size=3_000),
    st.lists(st.integers(0, 3), min_size=0, max_size=40),
    st.lists(st.integers(4, 7), min_size=0, max_size=40),
)
def test_a_long_shared_prefix_then_a_difference(
    prefix: list[int], tail_a: list[int], tail_b: list[int]
) -> None:
    a, b = prefix + tail_a, prefix + tail_b  # the tails share no token
    expected = len(prefix)
    assert common_prefix_length(a, b) == expected == common_prefix_length(b, a)
