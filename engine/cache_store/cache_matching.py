"""Matching a prompt to a cache: the ids the engine gives caches itself, and shared token prefixes."""

from __future__ import annotations

ANONYMOUS_PREFIX = "#anon-"  # a client's agent id never holds "#", so these cannot collide


def is_anonymous(agent_id: str) -> bool:
    """Whether the engine named this cache itself (for a request without an agent id): such caches
    are matched by content in memory only and never written to disk."""
    return agent_id.startswith(ANONYMOUS_PREFIX)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share, comparing slices at C speed: the whole of the
    shorter first (a prompt extending a cache), then halves of the part that still differs."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differs = 0, n  # a[:same] == b[:same]; a[same:differs] != b[same:differs]
    while differs - same > 32:
        middle = (same + differs) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            differs = middle
    return next(i for i in range(same, differs) if a[i] != b[i])
