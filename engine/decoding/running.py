"""The batch's running sequences by generator uid: the tokens each takes, and how each one ends.

Each step's tokens are taken here (a first token as soon as it is computed, a step before mlx-lm
returns it), and the ones that end a sequence are reported back to the batch. A sequence's events
gather in its outbox during a tick and are posted at the tick's end (`flush`). It ends once:
finished with its cache (kept by the `CacheKeeper` once the tick's events are out), finished
without one, or failed; either way its blocks are released and its last events posted.
"""

from __future__ import annotations

from collections.abc import ItemsView, ValuesView
from typing import Any

import mlx.core as mx

from semantic.engine.cache_store.cache_keeper import CacheKeeper
from semantic.engine.decoding.sequence import FinishedCache, Sequence
from semantic.engine.decoding.token_logprobs import TokenTexts
from semantic.engine.group.lockstep import next_digest
from semantic.engine.loop.config import EngineStats
from semantic.engine.loop.messages import FinishReason
from semantic.engine.loop.outbox import Outbox
from semantic.engine.mlx_adapter.api import BatchGenerator


class RunningSequences:
    def __init__(
        self,
        keeper: CacheKeeper,
        outbox: Outbox,
        texts: TokenTexts | None,  # for requests that ask for log-probabilities; None: no texts
        stats: EngineStats,  # counts the tokens taken
    ) -> None:
        self._by_uid: dict[int, Sequence] = {}
        self._keeper = keeper
        self._outbox = outbox
        self._texts = texts
        self._stats = stats
        self.token_digest = 0  # of every token taken, in order: ranks of a group compare it

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

    def lone_prefill(self) -> tuple[int, Sequence, int] | None:
        """The prompt part-way through its prefill, if it is the only prompt here: its uid, itself,
        and how many of its tokens are left to prefill."""
        prefilling = [(uid, s) for uid, s in self._by_uid.items() if s.is_prefilling]
        if len(prefilling) != 1:
            return None
        uid, sequence = prefilling[0]
        num_left = sequence.num_left_to_prefill
        return None if num_left is None else (uid, sequence, num_left)

    def uncached_prompts(self, most: int) -> list[int]:
        """The uncached tokens of each of the first `most` prompts still prefilling (in the order
        they were inserted: the generator prefills them together, first)."""
        return [s.num_uncached_tokens for s in self._by_uid.values() if s.is_prefilling][:most]

    def read_prompt_progress(self, prompt_responses: list[Any]) -> list[int]:
        """Note each prefilling prompt's progress (mlx-lm's reports of a step); returns the uids of
        those whose prompts ended, whose blocks are then shared."""
        ended_prompts: list[int] = []
        shared: list[int] = []
        for progress in prompt_responses:
            prefilling = self._by_uid.get(progress.uid)
            if prefilling is None:
                continue
            if progress.end_of_prompt:
                prefilling.is_prefilling = False
                ended_prompts.append(progress.uid)
                if not prefilling.generated_token_ids:  # a sequence rejoining after a failed step has
                    shared.append(progress.uid)  # shared its prompt already
            else:
                prefilling.prefilled(*progress.progress)
                if progress.end_of_segment and prefilling.num_prefilled in prefilling.state_checkpoints:
                    self._keeper.checkpoint_reached(progress.uid)
        self._keeper.prompts_prefilled(shared)
        return ended_prompts

    def read_tokens(self, generation_responses: list[Any]) -> dict[int, FinishReason]:
        """Take each decoding sequence's tokens (mlx-lm's responses of a step, one per token: several
        where drafts were kept); returns the sequences that end with them, by uid."""
        ending: dict[int, FinishReason] = {}
        for response in generation_responses:
            running = self._by_uid.get(response.uid)
            if running is None or response.uid in ending:  # a verify step's drafts past its end
                continue
            if running.early_token is None:
                self._take(running, response.token, response.logprobs)
            else:
                assert running.early_token == response.token, "an early first token changed: engine bug"
                running.early_token = None
            if response.finish_reason is not None:  # the generator's own limit: not reached
                self.finish(response.uid, FinishReason.LENGTH, (response.prompt_cache, response.all_tokens))
            elif (reason := running.end_reason()) is not None:
                ending[response.uid] = reason
        return ending

    def take_first_tokens(self, first: dict[int, tuple[int, mx.array]]) -> dict[int, FinishReason]:
        """Take the first tokens of prompts that ended this step, before the generator returns them
        (it will, with its next step); returns the sequences that end with them, by uid."""
        ending: dict[int, FinishReason] = {}
        for uid, (token, logprobs) in first.items():
            running = self._by_uid[uid]  # it cannot have ended since its prompt did, this step
            running.early_token = token
            self._take(running, token, logprobs)
            if (reason := running.end_reason()) is not None:
                ending[uid] = reason
        return ending

    def _take(self, running: Sequence, token: int, logprobs: mx.array) -> None:
        running.take_token(token, logprobs, self._texts)
        self.token_digest = next_digest(self.token_digest, token)
        self._stats.num_generated_tokens += 1

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
