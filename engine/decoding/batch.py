"""The running sequences: each joins mlx-lm's BatchGenerator, gets its tokens each step, and ends.

The batch ends every sequence itself: at a stop token, its token limit or a stop string, when
cancelled, or failed with the rest of the batch. On a normal end its cache is kept in the agent
cache store (`cache_keeper.py`); the sequences take their tokens, and every end frees its
reserved blocks and posts its last events, in `running.py`. A prompt part-way through its prefill
can be set aside with its cache and inserted again behind a shorter turn (the scheduler decides
when).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import mlx.core as mx
from loguru import logger

from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_keeper import CacheKeeper
from semantic.engine.decoding.running import RunningSequences
from semantic.engine.decoding.sampling import make_processors, make_sampler
from semantic.engine.decoding.sequence import Sequence, SetAside
from semantic.engine.decoding.text_stream import reply_text_stream
from semantic.engine.decoding.token_logprobs import TokenTexts
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.errors import EngineError, UnsteppableCacheError
from semantic.engine.loop.messages import (
    FinishReason,
    GenerationRequest,
    PromptStarted,
)
from semantic.engine.loop.outbox import Outbox
from semantic.engine.mlx_adapter import generator_seams, kv_seams
from semantic.engine.mlx_adapter.mixing_generator import GeneratorFactory
from semantic.engine.model.loading import LoadedModel
from semantic.engine.scheduling.prefill_budget import PrefillBudget, per_prompt_chunk
from semantic.engine.speculation.drafting import Speculation


class Batch:
    def __init__(
        self,
        loaded: LoadedModel,
        pool: BlockPool,
        store: AgentCacheStore,
        config: EngineConfig,
        stream: mx.Stream,
        stats: EngineStats,
        outbox: Outbox,
        speculation: Speculation | None = None,
    ) -> None:
        self._loaded = loaded
        self._pool = pool
        self._store = store
        self._config = config
        self._stats = stats
        self._outbox = outbox
        self.speculation = speculation  # drafts verified in the decode batch's pass; None: none
        # No stop tokens and (at insert) a token limit past the request's: the batch ends every
        # sequence itself (`_end`), reading its cache as views rather than as the copy of the whole
        # sequence that the generator makes of the sequences it ends.
        self._generators = GeneratorFactory(
            loaded.model,
            stream,
            # a pipelined or sharded model's ranks step in lockstep: never folded
            fold=config.profile.last_token_fold and loaded.layout is None,
            mixed_step=config.profile.mixed_step,
            joining_cache=config.profile.joining_cache,
            speculation=self.speculation,
            completion_batch_size=config.max_batch_size,
            prefill_batch_size=config.num_prefilled_together,
            prefill_step_size=config.num_tokens_per_prefill_step,
        )
        self._generator = self._generators()
        self.prefill_budget = PrefillBudget(
            config.num_tokens_per_prefill_step, config.prefill_stall_ratio, config.num_short_turn_tokens
        )
        stats.prefill_token_s = 0.0  # this model's, once its budget has measured it
        keeper = CacheKeeper(loaded.spec, store, pool)
        self.running = RunningSequences(keeper, outbox, TokenTexts(loaded.tokenizer), stats)

    def __len__(self) -> int:
        return len(self.running)

    @property
    def is_prefilling(self) -> bool:
        """Whether a prompt batch is still being prefilled (in chunks of `prefill_step_size`).

        A prompt inserted now would join that batch left-padded to the tokens it has already
        processed, which costs more than waiting for its last chunk: prompts arriving a moment apart
        finish later that way than had they arrived together.
        """
        return generator_seams.is_prefilling(self._generator)

    @property
    def num_generating(self) -> int:
        return generator_seams.num_generating(self._generator)

    def close(self) -> None:
        self._generator.close()

    def _xtc_kept_token_ids(self, request: GenerationRequest) -> list[int]:
        """The tokens XTC never drops, as mlx_lm.server keeps them: a newline and the end tokens."""
        if not request.sampling.xtc_probability:
            return []
        newline = self._loaded.tokenizer.encode("\n", add_special_tokens=False)
        return [*newline, *self._loaded.eos_token_ids]

    def insert(self, submit: Submit, reserved: list[int]) -> None:
        """Join the batch with the longest cached prefix; frees `reserved` if it cannot."""
        request = submit.request
        store = self._store
        try:
            salt = request.cache_salt
            agent_id = store.resolve_agent_id(request.agent_id, request.prompt_tokens, salt)
            returning = agent_id in store.agents
            prepared = store.prepare(agent_id, request.prompt_tokens, salt)
            salt = store.turn_salt(agent_id, prepared.num_cached_tokens, salt)
            if salt != request.cache_salt:  # the sequence's blocks are filed and published under it
                request = dataclasses.replace(request, cache_salt=salt)
            sampler = make_sampler(
                request.sampling, self._loaded.num_token_ids, self._xtc_kept_token_ids(request)
            )
            processors = make_processors(request.sampling, self._loaded.num_token_ids)
            processors += [request.grammar] if request.grammar is not None else []  # the mask last
            text = reply_text_stream(request, self._loaded.tokenizer, self._loaded.eos_token_ids)
            checkpoints = self._state_checkpoints(request, prepared.num_cached_tokens, returning)
            uid = self._insert(
                request, prepared.num_cached_tokens, prepared.caches, sampler, processors, checkpoints
            )
            if len(request.prompt_tokens) - 1 in checkpoints:
                self._unfolded_uids.add(uid)
            self._may_draft(uid, request, processors)
        except BaseException:
            self._pool.free(reserved)
            raise
        store.pin(agent_id)
        store.note_pins(request.prompt_tokens, request.cache_pins, salt)
        sequence = Sequence(
            request,
            submit.events,
            agent_id,
            text,
            reserved,
            prepared.num_cached_tokens,
            queued_at=submit.queued_at,
            sampler=sampler,
            logits_processors=processors,
            state_checkpoints=checkpoints,
        )
        self.running.add(uid, sequence)
        self._stats.num_prompt_tokens += len(request.prompt_tokens)
        self._stats.num_cached_tokens += prepared.num_cached_tokens
        self._outbox.post(
            submit.events,
            PromptStarted(
                len(request.prompt_tokens),
                prepared.num_cached_tokens,
                prepared.tier,
                submit.queued_at,
                time.monotonic() - submit.queued_at,
            ),
        )

    def _state_checkpoints(self, request: GenerationRequest, num_cached: int, returning: bool) -> list[int]:
        """Where the prefill of `request` stops to keep what resuming there takes (a recurrent
        model's state, a sliding model's windows) for other agents: the last block boundary of its
        shared head (the system prompt and tools) and, for an agent new to the cache, the end of the
        blocks other agents' prompts already share with it and its prompt's last full block (the
        next agent to share them, or to repeat the prompt, resumes there); and the agent's own
        (`request.own_point`). None for a model of full-attention layers only."""
        spec = self._loaded.spec
        if not spec.has_state_layers and not spec.has_sliding_layers:
            return []
        size, prompt = spec.block_size, request.prompt_tokens
        positions = {request.shared_head_tokens // size * size}
        if not returning:  # a returning agent's blocks are its own history: it resumes from its own
            positions.add(len(self._store.held_block_ids(prompt[:-1], request.cache_salt)) * size)
            # Its last full block: the next new agent to repeat the prompt resumes where a
            # full-attention model's would, with no system prompt to mark a shared head. Only where
            # that saves at least the tokens whose KV the point's bytes would hold instead.
            last_block = (len(prompt) - 1) // size
            if last_block >= self._store.num_blocks_per_point:
                positions.add(last_block * size)
        # Where its generation prompt begins (or else before its last token): a template that
        # re-renders the reply rewrites what follows, a reasoning header or the header's newline.
        positions.add(request.own_point)
        return sorted(p for p in positions if num_cached < p <= len(prompt) - 1)

    def _insert(
        self,
        request: GenerationRequest,
        num_cached: int,
        caches: list[Any],
        sampler: Any,
        processors: list[Any],
        checkpoints: list[int] | None = None,
    ) -> int:
        """Hand the generator the prompt past its first `num_cached` tokens (which `caches` hold), in
        segments that end at `checkpoints` (the generator's chunks stop at a segment's end)."""
        prompt = request.prompt_tokens
        checkpoints = [p for p in checkpoints or [] if p < len(prompt) - 1]  # the last token is one anyway
        ends = [*checkpoints, len(prompt)]
        starts = [num_cached, *checkpoints]
        (uid,) = self._generator.insert_segments(
            [[prompt[start:end] for start, end in zip(starts, ends, strict=True)]],
            max_tokens=[request.sampling.max_tokens + 1],
            caches=[caches],
            all_tokens=[list(prompt[:num_cached])],
            samplers=[sampler],
            logits_processors=[processors],
        )
        return int(uid)

    def set_aside(self, uid: int) -> SetAside | None:
        """Take a prompt out of the generator part-way through its prefill, with the cache it has so
        far; None where its cache cannot be read as views (then it stays)."""
        views = kv_seams.cache_views(self._generator, uid)
        if views is None:
            return None
        self._generator.remove([uid])
        self._stop_drafting(uid)
        return SetAside(self.running.take(uid), views)

    def resume(self, aside: SetAside) -> None:
        """Insert a set-aside prompt again, behind the prompts inserted since; it goes on from its cache."""
        sequence = aside.sequence
        num_in_cache = aside.layer_caches[0].offset
        try:
            caches, processors = aside.layer_caches, sequence.logits_processors
            uid = self._insert(sequence.request, num_in_cache, caches, sequence.sampler, processors)
        except Exception as error:
            logger.exception("could not resume request {}", sequence.request.request_id)
            self.running.fail(sequence, EngineError(f"resuming the prefill failed: {error}"))
            return
        self._may_draft(uid, sequence.request, sequence.logits_processors)
        sequence.prefill_offset = num_in_cache - sequence.num_cached_tokens
        sequence.num_left_to_prefill = len(sequence.request.prompt_tokens) - num_in_cache
        self.running.add(uid, sequence)

    def _may_draft(self, uid: int, request: GenerationRequest, processors: list[Any]) -> None:
        if self.speculation is not None:
            others = [p for p in processors if p is not request.grammar]  # a grammar masks each draft
            self.speculation.add(uid, request.prompt_tokens, request.sampling, bool(others), request.grammar)

    def _stop_drafting(self, uid: int) -> None:
        """A sequence leaves the generator: its drafting counts go with it."""
        if self.speculation is None:
            return
        drafted, accepted = self.speculation.remove(uid)
        sequence = self.running.get(uid)
        if sequence is not None:
            sequence.num_drafted_tokens += drafted
            sequence.num_accepted_tokens += accepted

    def next_chunk(self) -> int:
        """The prompt tokens the next step may prefill for each prompt it prefills (mlx-lm's chunk is
        per prompt): the budget's choice for what decodes now, for the prompts it will prefill (the
        first inserted, as many as are prefilled together), shared among them."""
        prefilling = self.running.uncached_prompts(self._config.num_prefilled_together)
        tokens = self.prefill_budget.tokens_for_tick(
            generator_seams.num_generating(self._generator), max(prefilling, default=0)
        )
        return per_prompt_chunk(tokens, len(prefilling), self.prefill_budget.max_tokens)

    def step(self, chunk: int | None = None) -> None:
        """One generator step: one token for each decoding sequence, a prefill chunk (`chunk`, or
        sized by the budget), and the ends. Prompts admitted since the chunk was chosen that are all
        short turns go in whole chunks, as the budget has them (a returning agent's turn is not
        started in a small chunk): that depends on the prompts alone, so every rank of a group
        decides the same."""
        generator, budget = self._generator, self.prefill_budget
        num_decoding = generator_seams.num_generating(generator)
        if chunk is None:
            chunk = self.next_chunk()
        prefilling = self.running.uncached_prompts(self._config.num_prefilled_together)
        chunk = budget.whole_for_short_turns(chunk, prefilling)
        generator_seams.set_prefill_chunk(generator, chunk)
        self._stats.prefill_chunk_tokens = chunk
        prefilled_before = generator_seams.num_prompt_tokens_processed(generator)
        started = time.perf_counter()
        try:
            prompt_responses, generation_responses = generator.next()
        except Exception as error:
            logger.exception("batch step failed with {} sequences", len(self.running))
            self._recover(generator, EngineError(f"generation failed: {error}"))
            return
        elapsed = time.perf_counter() - started
        num_prefilled = generator_seams.num_prompt_tokens_processed(generator) - prefilled_before
        budget.observe(elapsed, num_decoding, num_prefilled)
        if budget.token_s is not None:  # restore by cost weighs it against a read (actors/restore_cost.py)
            self._stats.prefill_token_s = budget.token_s
        logger.debug(
            "step: {} decoding, {} prompt tokens (chunk {}), {:.1f} ms",
            num_decoding,
            num_prefilled,
            chunk,
            elapsed * 1e3,
        )
        self._stats.num_steps += 1
        ended_prompts = self.running.read_prompt_progress(prompt_responses)
        self._unfolded_uids.difference_update(ended_prompts)
        ending = self.running.read_tokens(generation_responses)
        # mlx-lm returns a token one step after computing it, so that its next step overlaps the
        # caller's work; a first token would wait that whole step for nothing: it is taken as soon
        # as it exists. On a GPU that waits for the queued step: the overlap is lost once per prompt
        # (bench/results/cuda-h100/agent_replay.json against agent_replay_before_early_first_token.json).
        if ended_prompts:
            ending |= self.running.take_first_tokens(generator_seams.first_tokens(generator, ended_prompts))
        if ending:
            self._end(ending)

    def _recover(self, failed_generator: Any, error: EngineError) -> None:
        """A step raised: the sequences that had not run in the decode batch yet (one of them holds
        the cache that cannot be stepped) fail, and their agents' caches are dropped; the others go
        on in a fresh generator where their caches can be cut back (not sliding windows or recurrent
        states). With no new sequence, the step's failure is no cache's: all fail."""
        self._generator = self._generators()
        suspects = [uid for uid, sequence in self.running.items() if sequence.is_prefilling]
        spec = self._loaded.spec
        if not suspects:
            self._fail_running(error)
            return
        for uid in suspects:
            self._stop_drafting(uid)
            sequence = self.running.take(uid)
            cause = UnsteppableCacheError(str(error), is_sole_suspect=len(suspects) == 1)
            self.running.fail(sequence, cause)
            self._store.drop(sequence.agent_id)
        if spec.has_sliding_layers or spec.has_state_layers:
            self._fail_running(error)
            return
        for uid in self.running.uids():
            self._rejoin(failed_generator, uid, error)

    def _rejoin(self, failed_generator: Any, uid: int, error: EngineError) -> None:
        """Insert a decoding sequence into the fresh generator with its cache cut back to before its
        last token, which is fed again: the failed step may have written some layers past it."""
        self._stop_drafting(uid)
        sequence = self.running.take(uid)
        tokens = [*sequence.request.prompt_tokens, *sequence.generated_token_ids]
        num_kept = len(tokens) - 1
        held = kv_seams.sequence_caches(failed_generator, uid)
        if held is None or sequence.request.grammar is not None or min(c.offset for c in held[0]) < num_kept:
            self.running.fail(sequence, error)  # a grammar has taken its last token already
            return
        caches = [kv_seams.trimmed([layer], layer.offset - num_kept)[0] for layer in held[0]]
        sequence.early_token, sequence.is_prefilling = None, True
        max_tokens = sequence.request.sampling.max_tokens + 2 - len(sequence.generated_token_ids)
        (new_uid,) = self._generator.insert_segments(
            [[tokens[num_kept:]]],
            max_tokens=[max(1, max_tokens)],
            caches=[caches],
            all_tokens=[tokens[:num_kept]],
            samplers=[sequence.sampler],
            logits_processors=[sequence.logits_processors],
        )
        self._may_draft(int(new_uid), sequence.request, sequence.logits_processors)
        self.running.add(int(new_uid), sequence)

    def _end(self, ending: dict[int, FinishReason]) -> None:
        """Take sequences out of the generator (at once: each removal gathers the rest of the
        batch), their caches as views into the batch's arrays: only the blocks the pool lacks are
        then copied (mostly the reply's), not the whole history."""
        held = {uid: kv_seams.sequence_caches(self._generator, uid) for uid in ending}
        self._generator.remove(list(ending))
        for uid, reason in ending.items():
            self._stop_drafting(uid)
            caches = held[uid]
            if caches is None:
                self.running.finish(uid, reason)
                continue
            layer_caches, num_tokens = caches
            running = self.running[uid]
            # The cache holds every token fed to the model so far: the last one taken may not be yet,
            # and drafts kept past the token that ended it were fed but never taken.
            tokens = [*running.request.prompt_tokens, *running.generated_token_ids][:num_tokens]
            if len(tokens) < num_tokens:
                layer_caches = kv_seams.trimmed(layer_caches, num_tokens - len(tokens))
            self.running.finish(uid, reason, (layer_caches, tokens))

    @property
    def _unfolded_uids(self) -> set[int]:
        """The generator's prompts that must stop before their last token (none where it never folds)."""
        unfolded: set[int] = getattr(self._generator, "unfolded_uids", set())
        return unfolded

    def cancel(self, request_id: str) -> bool:
        for uid, running in self.running.items():
            if running.request.request_id == request_id:
                self._unfolded_uids.discard(uid)
                self._generator.remove([uid])
                self._stop_drafting(uid)
                self.running.finish(uid, FinishReason.CANCELLED)
                return True
        return False

    def cancel_all(self) -> None:
        if self.speculation is not None:
            self.speculation.clear()
        for uid in self.running.uids():
            self.running.finish(uid, FinishReason.CANCELLED)

    def fail_all(self, error: BaseException) -> int:
        """End every running sequence with `error`; returns how many there were."""
        if self.running:
            self._generator.remove(self.running.uids())
        return self._fail_running(error)

    def _fail_running(self, error: BaseException) -> int:
        """End every running sequence with `error`, their drafting with them (the generator's rows
        are the caller's to remove, or already gone with a failed generator)."""
        if self.speculation is not None:
            self.speculation.clear()
        return self.running.fail_all(error)

    def flush(self) -> None:
        """Post every sequence's events of this tick."""
        self.running.flush()

    def keep_caches(self) -> None:
        """Share the blocks of prompts prefilled this tick and keep the caches of sequences that
        ended; the engine calls it once the tick's events are posted."""
        self.running.keep_caches(self._generator)
