"""A loaded model and what lives exactly as long as it: the block pool, agents' caches, the batch.

Built on the engine thread when a model loads and dropped when it unloads; the cache commands'
answers are computed here, on the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from loguru import logger

from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_matching import is_anonymous
from semantic.engine.cache_store.cache_spec import describe_layers
from semantic.engine.cache_store.cache_tensors import (
    CacheSnapshot,
    SerializedCache,
    from_tensors,
    to_tensors,
    tokens_digest,
)
from semantic.engine.cache_store.eviction import EvictionPolicy
from semantic.engine.cache_store.layer_caches import BlockCodec
from semantic.engine.decoding.batch import Batch
from semantic.engine.group.distributed import Collectives, GroupLayout
from semantic.engine.loop.commands import CachedAgent, PoolReport
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.outbox import Outbox
from semantic.engine.mlx_adapter import checks
from semantic.engine.mlx_adapter.api import make_prompt_cache, stream_generate
from semantic.engine.mlx_adapter.model_hooks import install_kernel_hooks
from semantic.engine.model.loading import LoadedModel, load_draft_model, load_model
from semantic.engine.speculation.drafting import Speculation, drafter_maker


def speculation_for(config: EngineConfig, loaded: LoadedModel) -> Speculation | None:
    """The batch's drafting, as `backend.speculate` chose (loading a draft model); None where off
    and in a group, whose ranks step in lockstep."""
    choice = config.profile.speculate
    if choice == "off" or loaded.layout is not None:
        return None
    draft_model = None
    if choice != "ngram":
        draft_model = load_draft_model(choice, loaded, config.default_dtype, config.models_dir)
    return Speculation(drafter_maker(choice, draft_model, loaded.num_token_ids))


@dataclass(slots=True)
class ServedModel:
    loaded: LoadedModel
    pool: BlockPool
    store: AgentCacheStore
    batch: Batch

    @classmethod
    def load(
        cls,
        source: str,
        name: str | None,
        config: EngineConfig,
        stream: mx.Stream,
        stats: EngineStats,
        outbox: Outbox,
        layout: GroupLayout | None = None,
        collectives: Collectives | None = None,
    ) -> ServedModel:
        """Load a model and check mlx-lm's internals we rely on; call on the engine thread. In a
        group every rank calls this in the same tick: each loads its shard, and the pool holds as
        many blocks on every rank (the fewest any rank's budget allows)."""
        checks.check_version()
        loaded = load_model(source, config.block_size, config.default_dtype, name, config.models_dir, layout)
        checks.check_seams(loaded.model)
        checks.check_batchable(loaded.model)
        install_kernel_hooks(config.profile.cpu_kernels, packed_passes=config.profile.mixed_step)
        spec = loaded.spec
        codec = BlockCodec.for_spec(spec, config.idle_kv_bits)
        budget_bytes = config.cache_budget_mb * 2**20
        if collectives is not None:
            num_blocks = min(collectives.gather(budget_bytes // codec.bytes_per_block(spec), "pool size"))
            budget_bytes = num_blocks * codec.bytes_per_block(spec)
        pool = BlockPool.from_budget(
            budget_bytes, codec.bytes_per_block(spec), spec.block_size, spec.window_slots, spec.window_extra
        )
        model = loaded.model
        policy = EvictionPolicy(pinned_share=config.cache_pinned_share)
        store = AgentCacheStore(spec, pool, lambda: make_prompt_cache(model), codec, policy)
        batch = Batch(loaded, pool, store, config, stream, stats, outbox, speculation_for(config, loaded))
        logger.info("{}", config.profile.describe())
        logger.info(
            "loaded {} ({} layers: {}; {} KV heads, head dim {}, {}); "
            "pool {} blocks of {} tokens = {:.0f} MiB{}",
            loaded.name,
            spec.num_layers,
            describe_layers(spec),
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            pool.num_blocks,
            spec.block_size,
            pool.budget_bytes / 2**20,
            f", idle caches at {codec.bits} bits" if codec.bits else "",
        )
        return cls(loaded, pool, store, batch)

    def take_evicted(self) -> list[CacheSnapshot]:
        evicted, self.store.evicted = self.store.evicted, []
        return evicted

    def holds(self, agent_id: str, fingerprint: str) -> bool:
        """Whether the agent's cache for model `fingerprint` is in memory; safe from another thread
        (the store's id set is replaced whole, never changed)."""
        return self.loaded.fingerprint == fingerprint and agent_id in self.store.held_agent_ids

    def restore(self, cache: SerializedCache, salt: str | None = None) -> None:
        spec = self.loaded.spec
        self.store.restore(from_tensors(cache, spec), salt)

    def take(self, agent_id: str) -> SerializedCache | None:
        agent = self.store.agents.get(agent_id)
        if agent is None or agent.num_running:
            return None
        serialized = to_tensors(self.store.snapshot(agent_id))
        self.store.drop(agent_id)
        return serialized

    def snapshot_named(self, agent_id: str, file_digest: str) -> list[SerializedCache]:
        """A named agent's cache, unless it has none or its tokens digest is `file_digest` (its file
        holds it already)."""
        agent = self.store.agents.get(agent_id)
        if agent is None or is_anonymous(agent_id):
            return []
        if file_digest and file_digest == tokens_digest(agent.token_ids):
            return []  # its file holds it
        return [to_tensors(self.store.snapshot(agent_id))]

    def list_caches(self, agent_id: str | None) -> list[CachedAgent]:
        agents = self.store.agents
        if agent_id is None:
            cached = list(agents.values())
        else:
            cached = [agents[agent_id]] if agent_id in agents else []
        now = time.monotonic()
        return [CachedAgent(a.agent_id, a.num_tokens, now - a.last_used) for a in cached]

    def inspect(self) -> PoolReport:
        pool = self.pool
        agents = self.store.agents.values()
        return PoolReport(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            used_bytes=pool.used_bytes,
            num_running=len(self.batch),
            num_in_batch=self.batch.num_generating,
            ref_counts=sorted(b.ref_count for b in pool.blocks if b.ref_count),
            agent_id_to_block_ids={a.agent_id: list(a.block_ids) for a in agents},
            agent_id_to_num_tokens={a.agent_id: a.num_tokens for a in agents},
            window_block_ids=[
                b.block_id for b in pool.blocks if b.ref_count and pool.holds_window(b.block_id)
            ],
            num_shared_states=len(self.store.shared_states),
        )

    def reference_generate(self, prompt_tokens: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens from mlx-lm's own single-sequence loop, outside the batch (a test oracle)."""
        loaded = self.loaded
        steps = stream_generate(loaded.model, loaded.tokenizer, prompt_tokens, max_tokens=max_tokens)
        return [step.token for step in steps if step.token not in loaded.eos_token_ids]
