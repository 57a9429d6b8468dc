"""What a batch hands the agent cache store once a tick's events are out.

A prompt's full blocks are shared as soon as its first token exists, not when its reply ends:
agents that arrive together with one system prompt then prefill it once, not once each. A
sequence that ended has its whole cache kept. Both read the batch's arrays through views
(`kv_seams.cache_views`), so only the blocks the pool lacks are copied, and both wait for the
tick's events to be posted: reading a cache waits for the step MLX already queued, and a first
token should not.

A model with recurrent layers cannot resume anywhere else than where their state was kept: the
keeper keeps it where a prompt's generation prompt begins (the agent's next turn may not continue
its reply, or that header, token for token; `GenerationRequest.own_point`), with a sliding model's
windows there, and where its prefill stopped at the end of a system
prompt other agents share or a new agent's last full block (a segment end, `Batch.insert`), shared
with them under that block's hash once its blocks are.
"""

from __future__ import annotations

from loguru import logger

from semantic.engine.cache_store.agent_cache import AgentCacheStore, Checkpoint
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_spec import ModelCacheSpec
from semantic.engine.cache_store.layer_caches import kv_run, state_point_of
from semantic.engine.decoding.sequence import FinishedCache, Sequence
from semantic.engine.mlx_adapter import kv_seams
from semantic.engine.mlx_adapter.api import BatchGenerator


class CacheKeeper:
    def __init__(self, spec: ModelCacheSpec, store: AgentCacheStore, pool: BlockPool) -> None:
        self._spec = spec
        self._store = store
        self._pool = pool
        self._prefilled_uids: list[int] = []
        self._checkpoint_uids: list[int] = []
        self._ended: list[FinishedCache] = []

    def prompts_prefilled(self, uids: list[int]) -> None:
        """Sequences whose prompts the generator has run: share their blocks."""
        self._prefilled_uids += uids

    def checkpoint_reached(self, uid: int) -> None:
        """A prompt whose prefill stopped where its recurrent state is to be kept (this tick)."""
        self._checkpoint_uids.append(uid)

    def ended(self, ended: FinishedCache) -> None:
        """A sequence that ended with its cache: keep it, then release its blocks."""
        self._ended.append(ended)

    def keep(self, generator: BatchGenerator, running: dict[int, Sequence]) -> None:
        """Share the blocks of prompts prefilled this tick and keep the caches of sequences that ended."""
        checkpoints, self._checkpoint_uids = self._checkpoint_uids, []
        for uid in checkpoints:
            if uid in running:
                self._keep_checkpoint(generator, uid, running[uid])
        prefilled, self._prefilled_uids = self._prefilled_uids, []
        for uid in prefilled:
            sequence = running.get(uid)
            if sequence is None:  # ended, cancelled or failed since
                continue
            if sequence.generated_token_ids:
                self._publish_prompt(generator, uid, sequence)
            else:  # reading its cache would wait for the step computing its first token
                self._prefilled_uids.append(uid)
        ended, self._ended = self._ended, []
        for finished in ended:
            self._keep(finished)
            self.release(finished.sequence)

    def _keep_checkpoint(self, generator: BatchGenerator, uid: int, running: Sequence) -> None:
        held = kv_seams.sequence_caches(generator, uid)
        if held is None:
            return
        caches, num_tokens = held
        if num_tokens in running.state_checkpoints:
            spec = self._spec
            runs = [
                kv_run(caches[layer], num_tokens) if slides else (None, None, num_tokens)
                for layer, slides in zip(spec.attention_layer_ids, spec.window_slots_mask, strict=True)
            ]
            state = state_point_of(spec, caches, num_tokens)
            running.checkpoints.append(Checkpoint(num_tokens, state, runs))
            if num_tokens == running.request.own_point:
                # The agent's next turn may resume here: its sliding windows are kept with the point
                # (the blocks keep only the window where the reply ends).
                running.prompt_state = state_point_of(spec, caches, num_tokens, with_windows=True)

    def _publish_prompt(self, generator: BatchGenerator, uid: int, running: Sequence) -> None:
        spec = self._spec
        prompt = running.request.prompt_tokens
        checkpoints, running.checkpoints = running.checkpoints, []  # shared with the blocks, or never
        num_blocks = (len(prompt) - 1) // spec.block_size  # blocks whose tokens are all in the cache by now
        if num_blocks <= running.num_cached_tokens // spec.block_size:
            return
        held = kv_seams.sequence_caches(generator, uid)
        if held is None:
            return
        try:
            running.published_block_ids = self._store.publish_prefix(
                prompt[: num_blocks * spec.block_size],
                held[0],
                running.reserved_block_ids,
                running.request.cache_salt,
            )
            for checkpoint in checkpoints:
                self._store.share_checkpoint(
                    prompt[: checkpoint.num_tokens], checkpoint, running.request.cache_salt
                )
        except Exception:
            logger.exception("could not share the prompt blocks of request {}", running.request.request_id)

    def _keep(self, ended: FinishedCache) -> None:
        running = ended.sequence
        try:
            running.reserved_block_ids = self._store.store(
                running.agent_id,
                ended.token_ids,
                ended.layer_caches,
                running.reserved_block_ids,
                running.request.cache_salt,
                [running.prompt_state] if running.prompt_state is not None else [],
                resumes_from=len(running.request.prompt_tokens),
            )
        except Exception:
            logger.exception("could not keep the cache of agent {}", running.agent_id)

    def release(self, running: Sequence) -> None:
        """Free a sequence's blocks and let its agent's cache be evicted again."""
        self._pool.free(running.reserved_block_ids)
        self._pool.free(running.published_block_ids)
        running.reserved_block_ids = running.published_block_ids = []
        self._store.unpin(running.agent_id)
