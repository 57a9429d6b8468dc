"""Agents' KV caches in the block pool: token-exact prefix reuse, sharing, LRU eviction.

Runs on the engine thread only. An agent's cache is its token ids plus pool blocks: full blocks
are hashed (parent hash + tokens, the chain rooted in the request's cache salt) and shared by
every agent with the same prefix and salt; the last, partial block is private. An agent reuses
its own cache whatever the salt: agent ids are already scoped per namespace at the edge. A block's
payload holds, for each full-attention layer, that block's keys and values. Sliding-window
layers cannot be cut at an arbitrary token, so their state is kept as a snapshot taken where the
agent's tokens end and reused only by a prompt that extends all of those tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from loguru import logger

from semantic.engine.block_filing import file_blocks, publish_blocks
from semantic.engine.block_pool import BlockPool, hash_prefix_blocks
from semantic.engine.cache_matching import ANONYMOUS_PREFIX, common_prefix_length, is_anonymous
from semantic.engine.cache_spec import ModelCacheSpec
from semantic.engine.cache_tensors import CacheSnapshot, HostSnapshot
from semantic.engine.errors import PoolExhaustedError
from semantic.engine.layer_caches import (
    BlockCodec,
    HistoryKVCache,
    full_layers_of,
    kv_of,
    layer_caches,
    rotating_can_trim,
    sliding_state,
)


@dataclass(slots=True)
class AgentCache:
    agent_id: str
    token_ids: list[int]
    block_ids: list[int]
    sliding_states: list[tuple[Any, ...]]
    last_used: float = field(default_factory=time.monotonic)
    num_running: int = 0
    salt: str | None = None  # the cache salt its full blocks are filed under
    from_disk: bool = False  # restored from a file and not used by a turn since: its tier is "disk"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class PreparedPrompt:
    agent_id: str
    caches: list[Any]
    num_cached_tokens: int
    tier: str


class AgentCacheStore:
    def __init__(
        self,
        spec: ModelCacheSpec,
        pool: BlockPool,
        new_caches: Callable[[], list[Any]],
        codec: BlockCodec | None = None,
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.codec = codec or BlockCodec()
        self._new_caches = new_caches
        self.agents: dict[str, AgentCache] = {}
        # The ids in `agents`, replaced (never changed) as one is filed, evicted or dropped: the
        # loop side reads it to skip asking the engine thread whether a cache is in memory.
        self.held_agent_ids: frozenset[str] = frozenset()
        # Evicted caches wait here until the engine hands them to persistence.
        self.evicted: list[CacheSnapshot] = []
        self._anonymous_ids = itertools.count()

    def resolve_agent_id(self, agent_id: str | None, prompt: list[int], salt: str | None = None) -> str:
        """An explicit id wins; otherwise the cached agent (same salt) whose tokens the prompt extends."""
        if agent_id is not None:
            return agent_id
        best, best_len = None, 0
        for agent in self.agents.values():
            if is_anonymous(agent.agent_id) and agent.num_running == 0 and agent.salt == salt:
                shared = common_prefix_length(agent.token_ids, prompt)
                if shared == agent.num_tokens and shared > best_len:
                    best, best_len = agent.agent_id, shared
        return best or f"{ANONYMOUS_PREFIX}{next(self._anonymous_ids)}"

    def prepare(self, agent_id: str, prompt: list[int], salt: str | None = None) -> PreparedPrompt:
        """Build per-layer caches holding the longest reusable prefix of `prompt`."""
        agent = self.agents.get(agent_id)
        if agent is None:
            return self._prepare_shared_prefix(agent_id, prompt, salt)
        agent.last_used = time.monotonic()
        shared = common_prefix_length(agent.token_ids, prompt)
        # At least one prompt token must be prefilled to produce the next token's logits.
        num_reused = min(shared, len(prompt) - 1)
        divergence = shared if shared < agent.num_tokens else None
        if divergence is not None:
            logger.info(
                "agent {} prompt diverges from its cache at token {} (block {}) of {}",
                agent_id,
                divergence,
                divergence // self.spec.block_size,
                agent.num_tokens,
            )
        if self.spec.has_sliding_layers and num_reused < agent.num_tokens:
            trim = agent.num_tokens - num_reused
            if not all(rotating_can_trim(state, trim) for state in agent.sliding_states):
                logger.info(
                    "agent {}: full prefill; sliding-window layers cannot drop the last {} cached tokens",
                    agent_id,
                    trim,
                )
                return PreparedPrompt(agent_id, self._new_caches(), 0, "none")
        caches = self._build_caches(agent, num_reused, len(prompt))
        tier = ("disk" if agent.from_disk else "memory") if num_reused else "none"
        agent.from_disk = False
        return PreparedPrompt(agent_id, caches, num_reused, tier)

    def num_reusable(self, agent_id: str | None, prompt: list[int], salt: str | None = None) -> int:
        """How many leading prompt tokens `prepare` would take from memory (for scheduling)."""
        agent = self.agents.get(agent_id) if agent_id is not None else None
        if agent is None:
            return len(self._shared_block_ids(prompt, salt)) * self.spec.block_size
        return min(common_prefix_length(agent.token_ids, prompt), len(prompt) - 1)

    def _shared_block_ids(self, prompt: list[int], salt: str | None) -> list[int]:
        """The pool's full blocks that hold `prompt`'s leading tokens (none for sliding-window models)."""
        # Not the last prompt token: at least one must be prefilled for the next token's logits.
        return self.held_block_ids(prompt[:-1], salt)

    def held_block_ids(self, token_ids: list[int], salt: str | None) -> list[int]:
        """The pool's full blocks that hold `token_ids`' leading tokens (none for sliding-window models)."""
        if self.spec.has_sliding_layers:
            return []
        size = self.spec.block_size
        block_ids: list[int] = []
        for index, block_hash in enumerate(hash_prefix_blocks(token_ids, size, salt)):
            block_id = self.pool.get_cached_block(block_hash, token_ids[index * size : (index + 1) * size])
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def _prepare_shared_prefix(self, agent_id: str, prompt: list[int], salt: str | None) -> PreparedPrompt:
        """A new agent still reuses full blocks another agent published under the same salt
        (full-attention models)."""
        block_ids = self._shared_block_ids(prompt, salt)
        if not block_ids:
            return PreparedPrompt(agent_id, self._new_caches(), 0, "none")
        num_reused = len(block_ids) * self.spec.block_size
        probe = AgentCache(agent_id, prompt[:num_reused], block_ids, [])
        return PreparedPrompt(
            agent_id, self._build_caches(probe, num_reused, len(prompt)), num_reused, "memory"
        )

    def _build_caches(self, agent: AgentCache, num_tokens: int, prompt_length: int) -> list[Any]:
        """Per-layer caches holding the agent's first `num_tokens` tokens, with room for the rest of
        a `prompt_length`-token prompt and its first generated token."""
        if num_tokens == 0:
            return self._new_caches()
        block_ids = agent.block_ids[: self.spec.num_blocks_for(num_tokens)]
        in_blocks = min(len(block_ids) * self.spec.block_size, agent.num_tokens)
        step = HistoryKVCache.step
        capacity = -(-(prompt_length + 1) // step) * step
        full_layers = full_layers_of(
            self.pool, self.spec, block_ids, self.codec, room=max(0, capacity - in_blocks)
        )
        sliding_trim = agent.num_tokens - num_tokens
        return layer_caches(
            self.spec, self._new_caches(), full_layers, num_tokens, agent.sliding_states, sliding_trim
        )

    def store(
        self,
        agent_id: str,
        token_ids: list[int],
        layer_caches: list[Any],
        reserved: list[int],
        salt: str | None = None,
    ) -> list[int]:
        """Keep a finished turn's cache, its full blocks filed under `salt`; returns the reserved
        blocks it did not use."""
        assert len(layer_caches) == self.spec.num_layers, "cache layers do not match the spec: engine bug"
        full_kv = [kv_of(layer_caches[layer], len(token_ids)) for layer in self.spec.full_layer_ids]
        sliding = [layer_caches[layer].state for layer in self.spec.sliding_layer_ids]
        return self._file_blocks(
            agent_id, token_ids, full_kv, sliding, reserved, salt, self.codec.encode, self._allocate_one
        )

    def _file_blocks(
        self,
        agent_id: str,
        token_ids: list[int],
        full_kv: list[tuple[Any, Any]],
        sliding: list[Any],
        reserved: list[int],
        salt: str | None,
        encode: Callable[[Any], Any],
        allocate: Callable[[], int],
    ) -> list[int]:
        """The agent's cache as pool blocks (shared ones reused, the rest copied out by `encode`
        into blocks from `reserved`, then from `allocate`)."""
        spare = list(reserved)
        block_size = self.spec.block_size
        block_ids = file_blocks(self.pool, block_size, token_ids, full_kv, spare, salt, encode, allocate)
        previous = self.agents.get(agent_id)
        num_running = previous.num_running if previous else 0
        self.agents[agent_id] = AgentCache(
            agent_id, list(token_ids), block_ids, sliding, num_running=num_running, salt=salt
        )
        if previous is not None:
            self.pool.free(previous.block_ids)
        else:
            self.held_agent_ids = frozenset(self.agents)
        return spare

    def publish_prefix(
        self, token_ids: list[int], layer_caches: list[Any], spare: list[int], salt: str | None = None
    ) -> list[int]:
        """Publish the full blocks of `token_ids` that the pool lacks, in blocks taken from `spare`
        (a running request's reservation), so other prompts share them before this one finishes.
        Returns the blocks it filled; each keeps the reference it had in `spare` until freed."""
        if self.spec.has_sliding_layers:
            return []
        num_full = len(token_ids) // self.spec.block_size * self.spec.block_size
        full_kv = [kv_of(layer_caches[layer], num_full) for layer in self.spec.full_layer_ids]
        return publish_blocks(
            self.pool, self.spec.block_size, token_ids[:num_full], full_kv, spare, salt, self.codec.encode
        )

    def _allocate_one(self) -> int:
        if not self.pool.can_allocate(1):
            self.evict_until(1)
        return self.pool.allocate(1)[0]

    def _allocate_unevicting(self) -> int:
        return self.pool.allocate(1)[0]

    def pin(self, agent_id: str) -> None:
        if agent_id in self.agents:
            self.agents[agent_id].num_running += 1

    def unpin(self, agent_id: str) -> None:
        if agent_id in self.agents:
            self.agents[agent_id].num_running = max(0, self.agents[agent_id].num_running - 1)

    def evictable(self) -> list[AgentCache]:
        return sorted((a for a in self.agents.values() if a.num_running == 0), key=lambda a: a.last_used)

    def evict_until(self, num_free_blocks: int) -> list[CacheSnapshot]:
        """Evict least-recently-used idle agents until `num_free_blocks` are free."""
        evicted = []
        for agent in self.evictable():
            if self.pool.can_allocate(num_free_blocks):
                break
            evicted.append(self.evict(agent.agent_id))
        return evicted

    def evict(self, agent_id: str) -> CacheSnapshot:
        snapshot = self.snapshot(agent_id)
        agent = self.agents.pop(agent_id)
        self.held_agent_ids = frozenset(self.agents)
        self.pool.free(agent.block_ids)
        self.evicted.append(snapshot)
        return snapshot

    def drop(self, agent_id: str) -> None:
        agent = self.agents.pop(agent_id, None)
        if agent is not None:
            self.held_agent_ids = frozenset(self.agents)
            self.pool.free(agent.block_ids)

    def snapshot(self, agent_id: str) -> CacheSnapshot:
        agent = self.agents[agent_id]
        full_layers: list[tuple[Any, Any]] = (
            full_layers_of(self.pool, self.spec, agent.block_ids, self.codec)
            if agent.block_ids
            else [(None, None)] * len(self.spec.full_layer_ids)
        )
        return CacheSnapshot(agent_id, list(agent.token_ids), full_layers, list(agent.sliding_states))

    def restore(self, snapshot: HostSnapshot, salt: str | None = None) -> None:
        """Put a snapshot read from disk back into the pool as this agent's cache, its full blocks
        (copied once, from the file's arrays) filed under the salt of the turn that needs it. It
        evicts nothing (the engine makes room first, sparing queued requests' caches): without
        enough free blocks it raises PoolExhaustedError and takes none."""
        self.drop(snapshot.agent_id)
        num_tokens = len(snapshot.token_ids)
        needed = self.spec.num_blocks_for(num_tokens) - len(self.held_block_ids(snapshot.token_ids, salt))
        if not self.pool.can_allocate(needed):
            raise PoolExhaustedError(f"{needed} blocks needed, {self.pool.num_free_blocks} free")
        full_kv = [
            (keys[..., :num_tokens, :], values[..., :num_tokens, :])
            for keys, values in snapshot.full_layers
            if keys is not None and values is not None
        ]
        assert not num_tokens or len(full_kv) == len(self.spec.full_layer_ids), "layers missing: engine bug"
        sliding = [sliding_state(state) for state in snapshot.sliding_layers]

        def encode(array: np.ndarray) -> Any:
            return self.codec.encode_host(array, snapshot.dtype)

        allocate = self._allocate_unevicting
        self._file_blocks(snapshot.agent_id, snapshot.token_ids, full_kv, sliding, [], salt, encode, allocate)
        self.agents[snapshot.agent_id].from_disk = True
