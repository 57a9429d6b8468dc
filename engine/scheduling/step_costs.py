"""What a decode step costs here, by its rows and width, timed as the engine runs.

A step that verifies drafts feeds each row its pending token and its drafts, padded to the widest:
rows x width tokens in one forward pass. On a GPU, where a step reads the weights once whatever it
feeds, a 3 x 5 step should cost about what a 3 x 1 step does; on a CPU it costs more (and a narrower
step does not always cost less than a wider one), so drafts that are seldom kept cost more than they
give. The speculation weighs each width against these figures (`speculation.py`), so it is the
machine, not a constant, that decides what drafting is worth. Sizes are kept by rows and width, not
by tokens: a 1 x 3 verify waits for its logits where a 3 x 1 step overlaps the engine's work, so the
two cost differently.

A step's time is from the decode batch's call to its next call: mlx-lm's one-token step returns the
last step's tokens while computing this one's, so that interval is one step's compute (the engine's
own work overlaps it); a verify step waits for its logits, and its interval holds that wait. A step
whose interval held other work too (a prompt's chunk, a restore) is an outlier, so each figure is
the median of the last few.
"""

from __future__ import annotations

import statistics
from collections import deque

NUM_RECENT = 9  # steps per size in the median: two outliers in a row move it little


class StepCosts:
    """Seconds per decode step, by its rows and width (1: mlx-lm's one-token step)."""

    def __init__(self, num_recent: int = NUM_RECENT) -> None:
        self._num_recent = num_recent
        self._recent_by_size: dict[tuple[int, int], deque[float]] = {}

    def observe(self, num_rows: int, width: int, seconds: float) -> None:
        if num_rows <= 0 or width <= 0 or seconds < 0:
            raise ValueError(f"need rows, width > 0 and seconds >= 0, got {num_rows}, {width}, {seconds}")
        recent = self._recent_by_size.setdefault((num_rows, width), deque(maxlen=self._num_recent))
        recent.append(seconds)

    def seconds(self, num_rows: int, width: int) -> float | None:
        """A step of this size: the median of its last few where measured; else a one-token step's
        and, per token of width beyond it, the median slope of the widths measured with these rows
        (none yet: 0, so a first verify is tried and measured); None where not even a one-token step
        of these rows was measured."""
        plain = self._median(num_rows, 1)
        if width == 1 or plain is None:
            return plain
        measured = self._median(num_rows, width)
        if measured is not None:
            return measured
        slopes = [
            (self._median(rows, wider) - plain) / (wider - 1)  # type: ignore[operator]
            for rows, wider in self._recent_by_size
            if rows == num_rows and wider > 1
        ]
        return plain + max(0.0, statistics.median(slopes) if slopes else 0.0) * (width - 1)

    def _median(self, num_rows: int, width: int) -> float | None:
        recent = self._recent_by_size.get((num_rows, width))
        return None if recent is None else statistics.median(recent)
