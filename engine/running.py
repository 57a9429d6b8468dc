"""The batch's running sequences by generator uid, and how each one ends.

A sequence's events gather in its outbox during a tick and are posted at the tick's end (`flush`).
It ends once: finished with its cache (kept by the `CacheKeeper` once the tick's events are out),
finished without one, or failed; either way its blocks are released and its last events posted.
"""

from __future__ import annotations

from collections.abc import ItemsView, ValuesView
from typing import Any

from mlx_lm.generate import BatchGenerator

from semantic.engine.cache_keeper import CacheKeeper
from semantic.engine.messages import FinishReason
from semantic.engine.outbox import Outbox
from semantic.engine.sequence import FinishedCache, Sequence


class RunningSequences:
    def __init__(self, keeper: CacheKeeper, outbox: Outbox) -> None:
        self._by_uid: dict[int, Sequence] = {}
        self._keeper = keeper
        self._outbox = outbox

    def __len__(self) -> int:
        return len(self._by_uid)

    def __getitem__(self, uid: int) -> Sequence:
        return self._by_uid[uid]

    def get(self, uid: int) -> Sequence | None:
        return self._by_uid.get(uid)

    def items(self) -> ItemsView[int, Sequence]:
        return self._by_uid.items()

    def values(self) -> ValuesView[Sequence]:
        return self._by_uid.values()

    def uids(self) -> list[int]:
        return list(self._by_uid)

    def add(self, uid: int, sequence: Sequence) -> None:
        self._by_uid[uid] = sequence

    def take(self, uid: int) -> Sequence:
        """Take a sequence out without ending it (its prefill set aside, to be inserted again)."""
        return self._by_uid.pop(uid)

    def read_prompt_progress(self, prompt_responses: list[Any]) -> list[int]:
        """Note each prefilling prompt's progress (mlx-lm's reports of a step); returns the uids of
        those whose prompts ended, whose blocks are then shared."""
        ended_prompts = []
        for progress in prompt_responses:
            prefilling = self._by_uid.get(progress.uid)
            if prefilling is None:
                continue
            if progress.end_of_prompt:
                prefilling.is_prefilling = False
                ended_prompts.append(progress.uid)
            else:
                prefilling.prefilled(*progress.progress)
        self._keeper.prompts_prefilled(ended_prompts)
        return ended_prompts

    def finish(self, uid: int, reason: FinishReason, cache: tuple[Any, Any] | None = None) -> None:
        """End a sequence the generator no longer holds and post its last events; its cache (layer
        caches, tokens), if given, is kept by `keep_caches` before its blocks are released."""
        sequence = self._by_uid.pop(uid)
        sequence.finish(reason)
        if cache is not None and cache[0] is not None:
            self._keeper.ended(FinishedCache(sequence, cache[0], list(cache[1])))
        else:
            self._keeper.release(sequence)
        self._post(sequence)

    def fail(self, sequence: Sequence, error: BaseException) -> None:
        """End a sequence (no longer held here) with `error` after the events it has gathered."""
        self._keeper.release(sequence)
        sequence.outbox.append(error)
        self._post(sequence)

    def fail_all(self, error: BaseException) -> int:
        """End every sequence with `error`; returns how many there were."""
        sequences, self._by_uid = list(self._by_uid.values()), {}
        for sequence in sequences:
            self.fail(sequence, error)
        return len(sequences)

    def flush(self) -> None:
        """Post every sequence's events of this tick."""
        for sequence in self._by_uid.values():
            if sequence.outbox:
                self._post(sequence)

    def keep_caches(self, generator: BatchGenerator) -> None:
        """Share the blocks of prompts prefilled this tick and keep the caches of sequences that
        ended; once the tick's events are posted."""
        self._keeper.keep(generator, self._by_uid)

    def _post(self, sequence: Sequence) -> None:
        self._outbox.post_many(sequence.events, sequence.outbox)
        sequence.outbox = []
