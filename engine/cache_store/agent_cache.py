"""Agents' KV caches in the block pool: token-exact prefix reuse, sharing, LRU eviction.

Runs on the engine thread only. An agent's cache is its token ids plus pool blocks: full blocks
are hashed (parent hash + tokens, the chain rooted in the request's cache salt) and shared by
every agent with the same prefix and salt; the last, partial block is private. An agent reuses
its own cache whatever the salt: agent ids are already scoped per namespace at the edge. A block's
payload holds, for each attention layer, that block's keys and values (None for a sliding layer
whose window had passed the block when it was filed). A turn resumes at any token of its agent's
cache (a new agent at a shared block boundary) where every sliding layer's blocks hold the window
before that token, so a sliding-window model reuses what a full-attention one does whenever the
prompt diverges near the end (a reply that does not re-tokenize the same), and shares prefixes.
Recurrent layers (Mamba, Gated DeltaNet, convolutions) cannot be cut back at all: their state is
kept as snapshots (`StatePoint`) where turns end, and a turn resumes only at one of those.

Which idle cache goes first is the eviction policy's (`eviction.py`); the store tells it which are
superseded and which a running sequence started from. A new agent's running sequence holds a
reference to the blocks it started from, and `cache_control` pins hold theirs (`prefix_pins.py`),
so those prefixes stay while it runs, or for the pin's ttl.

An agent imported from an archive holds another person's KV: its blocks, and every block its turns
compute on top of them, are filed under a salt of its own (`imported_salt`), so no other agent's
prompt finds them, until a turn computes its cache from scratch.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from loguru import logger

from semantic.engine.cache_store.block_filing import file_blocks, fill_missing, publish_blocks
from semantic.engine.cache_store.block_pool import BlockPool, hash_prefix_blocks
from semantic.engine.cache_store.cache_matching import ANONYMOUS_PREFIX, common_prefix_length, is_anonymous
from semantic.engine.cache_store.cache_spec import ModelCacheSpec
from semantic.engine.cache_store.cache_tensors import CacheSnapshot, HostSnapshot, LayerKV, StatePoint
from semantic.engine.cache_store.eviction import LRU, EvictionPolicy
from semantic.engine.cache_store.layer_caches import (
    BlockCodec,
    HistoryKVCache,
    attention_kv_of,
    can_resume_at,
    kv_run,
    layer_caches,
    state_point_of,
    window_start,
)
from semantic.engine.cache_store.prefix_pins import CachePin, PrefixPins
from semantic.engine.cache_store.retention import RunningShares, idle_caches
from semantic.engine.loop.errors import PoolExhaustedError

# Shared recurrent states kept at once: each is one sequence's whole state (tens of MB in a large
# hybrid model); a few system prompts and the prompts new agents repeat are what agents share.
MAX_SHARED_STATES = 16


def imported_salt(agent_id: str) -> str:
    """The salt an imported agent's blocks are filed under: its own; no client salt starts with NUL
    once scoped to a namespace, and an unscoped client that sends it could reach the agent anyway."""
    return f"\0imported\0{agent_id}"


@dataclass(slots=True)
class AgentCache:
    agent_id: str
    token_ids: list[int]
    block_ids: list[int]
    state_points: list[StatePoint] = field(default_factory=list)  # recurrent models: where turns may resume
    state_block_ids: list[int] = field(default_factory=list)  # the pool blocks charged for them
    last_used: float = field(default_factory=time.monotonic)
    num_running: int = 0
    salt: str | None = None  # the cache salt its full blocks are filed under
    from_disk: bool = False  # restored from a file and not used by a turn since: its tier is "disk"
    is_imported: bool = False  # its KV came from an archive: filed under `imported_salt` only

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SharedState:
    """Where other agents' prompts are expected to resume: a block boundary, with the recurrent
    state there (charged `block_ids` in the pool; None for a model without recurrent layers). The
    sliding layers of the blocks in the window before it are kept for it."""

    point: StatePoint | None
    block_ids: list[int]


@dataclass(slots=True)
class Checkpoint:
    """What a prompt's prefill held where it stopped at a segment's end: its recurrent state and
    its attention layers' runs (`kv_run`: a sliding layer's window before `num_tokens`)."""

    num_tokens: int
    state: StatePoint | None
    kv_runs: list[tuple[Any, Any, int]]


@dataclass(slots=True)
class StartingCache:
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
        policy: EvictionPolicy = LRU,
    ) -> None:
        self.spec = spec
        self.pool = pool
        self.codec = codec or BlockCodec()
        self.policy = policy  # which idle caches go first, which are spared, which go to disk
        self._new_caches = new_caches
        self.agents: dict[str, AgentCache] = {}
        # The ids in `agents`, replaced (never changed) as one is filed, evicted or dropped: the
        # loop side reads it to skip asking the engine thread whether a cache is in memory.
        self.held_agent_ids: frozenset[str] = frozenset()
        # Evicted caches wait here until the engine hands them to persistence.
        self.evicted: list[CacheSnapshot] = []
        # Recurrent states kept where prompts other agents share end, by that block's chained hash.
        self.shared_states: OrderedDict[bytes, SharedState] = OrderedDict()
        self.pins = PrefixPins(pool, policy)
        self.running_shares = RunningShares(pool)  # the prefixes new agents' sequences started from
        self._anonymous_ids = itertools.count()
        self.num_blocks_per_point = _num_blocks_per_point(spec)

    def resolve_agent_id(self, agent_id: str | None, prompt: list[int], salt: str | None = None) -> str:
        """An explicit id wins; otherwise the cached agent (same salt) whose tokens the prompt extends,
        or, for a model with recurrent or sliding layers, the one it can resume the most of: a client
        that sends its whole conversation back re-renders the last reply, which may not re-tokenize
        the same, and only the agent's own points (where its prompt ended) let the turn resume short
        of the end (a full-attention model resumes from the shared blocks instead)."""
        if agent_id is not None:
            return agent_id
        return self.find_anonymous(prompt, salt) or f"{ANONYMOUS_PREFIX}{next(self._anonymous_ids)}"

    def find_anonymous(self, prompt: list[int], salt: str | None = None) -> str | None:
        """The idle anonymous agent `resolve_agent_id` gives a prompt without an id; None for a new one."""
        best, best_len = None, 0
        for agent in self.agents.values():
            if is_anonymous(agent.agent_id) and agent.num_running == 0 and agent.salt == salt:
                shared = common_prefix_length(agent.token_ids, prompt)
                if shared < agent.num_tokens and agent.state_points:
                    shared = self._resume_point(agent, min(shared, len(prompt) - 1))
                elif shared < agent.num_tokens:
                    continue
                if shared > best_len:
                    best, best_len = agent.agent_id, shared
        return best

    def prepare(self, agent_id: str, prompt: list[int], salt: str | None = None) -> StartingCache:
        """Build per-layer caches holding the longest reusable prefix of `prompt`."""
        self.running_shares.note(agent_id, [])
        agent = self.agents.get(agent_id)
        if agent is None:
            return self._prepare_shared_prefix(agent_id, prompt, salt)
        agent.last_used = time.monotonic()
        shared = common_prefix_length(agent.token_ids, prompt)
        # At least one prompt token must be prefilled to produce the next token's logits.
        num_reused = self._resume_point(agent, min(shared, len(prompt) - 1))
        if shared < agent.num_tokens or num_reused < min(shared, len(prompt) - 1):
            logger.info(
                "agent {} prompt diverges from its cache at token {} (block {}) of {}; resumes at {}",
                agent_id,
                shared,
                shared // self.spec.block_size,
                agent.num_tokens,
                num_reused,
            )
        caches = self._build_caches(agent, num_reused, len(prompt))
        tier = ("disk" if agent.from_disk else "memory") if num_reused else "none"
        agent.from_disk = False
        return StartingCache(agent_id, caches, num_reused, tier)

    def _resume_point(self, agent: AgentCache, limit: int) -> int:
        """The most tokens of the agent's cache, at most `limit`, that a turn can start from: any
        token of a full-attention model's; where sliding layers still hold the window before it; and
        for recurrent layers, a point where their state was kept."""
        spec = self.spec
        # Points whose windows are kept with them (or that need none) resume whatever the blocks hold.
        windowed = {
            p.num_tokens
            for p in agent.state_points
            if p.num_tokens <= limit and (p.windows or not spec.has_sliding_layers)
        }
        if spec.has_state_layers:
            own = {p.num_tokens for p in agent.state_points if p.num_tokens <= limit}
            shared = {n for n, p in self._shared_points(agent.token_ids[:limit], agent.salt) if p is not None}
            candidates = own | shared
        elif spec.has_sliding_layers:
            boundaries = range(limit // spec.block_size * spec.block_size, 0, -spec.block_size)
            candidates = {limit, *boundaries, *windowed}
        else:
            return limit
        for candidate in sorted(candidates, reverse=True):
            if candidate and (
                candidate in windowed
                or can_resume_at(self.pool, self.codec, spec, agent.block_ids, candidate, agent.num_tokens)
            ):
                return candidate
        return 0

    def num_reusable(self, agent_id: str | None, prompt: list[int], salt: str | None = None) -> int:
        """How many leading prompt tokens `prepare` would take from memory (for scheduling)."""
        agent = self.agents.get(agent_id) if agent_id is not None else None
        if agent is None:
            return self._shared_prefix_length(prompt, salt)[0]
        return self._resume_point(agent, min(common_prefix_length(agent.token_ids, prompt), len(prompt) - 1))

    def turn_salt(self, agent_id: str, num_cached_tokens: int, salt: str | None) -> str | None:
        """The salt a turn's blocks are filed under: an imported agent's own while the turn starts
        from its cache (every later block attends to that KV), else the request's `salt`."""
        agent = self.agents.get(agent_id)
        if agent is not None and agent.is_imported and num_cached_tokens:
            return imported_salt(agent_id)
        return salt

    def held_block_ids(self, token_ids: list[int], salt: str | None) -> list[int]:
        """The pool's full blocks that hold `token_ids`' leading tokens."""
        size = self.spec.block_size
        block_ids: list[int] = []
        for index, block_hash in enumerate(hash_prefix_blocks(token_ids, size, salt)):
            block_id = self.pool.get_cached_block(block_hash, token_ids[index * size : (index + 1) * size])
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def _shared_prefix_length(self, prompt: list[int], salt: str | None) -> tuple[int, list[int]]:
        """The most leading tokens of `prompt` a new agent can start from in blocks other agents
        published under `salt` (a block boundary where every layer can resume), and those blocks."""
        # Not the last prompt token: at least one must be prefilled for the next token's logits.
        block_ids = self.held_block_ids(prompt[:-1], salt)
        size = self.spec.block_size
        if self.spec.has_state_layers:
            shared = self._shared_points(prompt[: len(block_ids) * size], salt)
            candidates = [n for n, p in shared if p is not None]
        else:
            candidates = [n * size for n in range(len(block_ids), 0, -1)]
        for num_tokens in candidates:
            if can_resume_at(self.pool, self.codec, self.spec, block_ids, num_tokens, len(block_ids) * size):
                return num_tokens, block_ids[: num_tokens // size]
        return 0, []

    def _shared_points(self, token_ids: list[int], salt: str | None) -> list[tuple[int, StatePoint | None]]:
        """The shared states kept at block boundaries of `token_ids`, latest first (each as its
        token count and state)."""
        if not self.shared_states:
            return []
        size = self.spec.block_size
        found = []
        for index, block_hash in enumerate(hash_prefix_blocks(token_ids, size, salt)):
            shared = self.shared_states.get(block_hash)
            if shared is not None:
                found.append(((index + 1) * size, shared.point))
        return found[::-1]

    def share_checkpoint(self, token_ids: list[int], checkpoint: Checkpoint, salt: str | None) -> None:
        """Keep what resuming at the end of `token_ids` (a block boundary whose blocks the pool holds)
        takes, for other agents' prompts that start with them: the sliding layers of the blocks in
        the window before it, and the recurrent state there, if the pool has free blocks for them;
        the least recently kept or resumed from goes past MAX_SHARED_STATES."""
        size, spec = self.spec.block_size, self.spec
        num_blocks = len(token_ids) // size
        if len(token_ids) % size or not num_blocks or checkpoint.num_tokens != len(token_ids):
            return
        block_ids = self.held_block_ids(token_ids, salt)
        if len(block_ids) < num_blocks:
            return
        if spec.has_sliding_layers:
            first = max(0, len(token_ids) - (spec.sliding_window or 0)) // size
            for index in range(first, num_blocks):
                fill_missing(self.pool, block_ids[index], checkpoint.kv_runs, index * size, self.codec.encode)
        block_hash = hash_prefix_blocks(token_ids, size, salt)[-1]
        num_charged = spec.num_blocks_per_state if checkpoint.state is not None else 0
        if block_hash in self.shared_states or not self.pool.can_allocate(num_charged):
            return
        self.shared_states[block_hash] = SharedState(checkpoint.state, self.pool.allocate(num_charged))
        while len(self.shared_states) > MAX_SHARED_STATES:
            self.drop_shared_state()

    def drop_shared_state(self) -> bool:
        """Drop the least recently kept or resumed from shared state, or else pin; whether there was one."""
        if not self.shared_states:
            return self.pins.drop()
        _, shared = self.shared_states.popitem(last=False)
        self.pool.free(shared.block_ids)
        return True

    def droppable_block_ids(self) -> list[list[int]]:
        """The blocks of each shared state and pin, in the order `drop_shared_state` drops them."""
        shared = [state.block_ids for state in self.shared_states.values()]
        return shared + [self.pins.held[key].block_ids for key in self.pins.drop_order()]

    def _prepare_shared_prefix(self, agent_id: str, prompt: list[int], salt: str | None) -> StartingCache:
        """A new agent still reuses full blocks another agent published under the same salt."""
        num_reused, block_ids = self._shared_prefix_length(prompt, salt)
        if not num_reused:
            return StartingCache(agent_id, self._new_caches(), 0, "none")
        probe = AgentCache(agent_id, prompt[:num_reused], block_ids, salt=salt)
        self.running_shares.note(agent_id, block_ids)
        return StartingCache(
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
        state = next((p for p in agent.state_points if p.num_tokens == num_tokens), None)
        attention = attention_kv_of(
            self.pool,
            self.spec,
            block_ids,
            self.codec,
            num_tokens,
            room=max(0, capacity - in_blocks),
            num_held=agent.num_tokens,
            windows=state.windows if state is not None else (),
        )
        if state is None and self.spec.has_state_layers:
            shared = self._shared_points(agent.token_ids[:num_tokens], agent.salt)
            state = next(p for n, p in shared if n == num_tokens and p is not None)
        self._touch_shared_state(agent.token_ids[:num_tokens], agent.salt)
        return layer_caches(self.spec, self._new_caches(), attention, num_tokens, state)

    def _touch_shared_state(self, token_ids: list[int], salt: str | None) -> None:
        """A turn resumes at the end of `token_ids`: a shared state kept there goes last in the drop
        order, so the points agents do resume from outlast those kept for prompts never repeated."""
        if not self.shared_states or len(token_ids) % self.spec.block_size:
            return
        block_hash = hash_prefix_blocks(token_ids, self.spec.block_size, salt)[-1]
        if block_hash in self.shared_states:
            self.shared_states.move_to_end(block_hash)

    def store(
        self,
        agent_id: str,
        token_ids: list[int],
        layer_caches: list[Any],
        reserved: list[int],
        salt: str | None = None,
        earlier_points: list[StatePoint] | None = None,
        resumes_from: int | None = None,
    ) -> list[int]:
        """Keep a finished turn's cache, its full blocks filed under `salt`; returns the reserved
        blocks it did not use. A recurrent model's state is kept where the cache ends and at
        `earlier_points` (where the turn's prompt ended); sliding layers where the next turn may
        resume, from `resumes_from` (where the prompt ended: a reply may not re-tokenize the same)."""
        assert len(layer_caches) == self.spec.num_layers, "cache layers do not match the spec: engine bug"
        num_tokens = len(token_ids)
        kv_runs = [kv_run(layer_caches[layer], num_tokens) for layer in self.spec.attention_layer_ids]
        point = state_point_of(self.spec, layer_caches, num_tokens)
        points = [p for p in earlier_points or [] if p.num_tokens < num_tokens]
        points += [point] if point is not None else []
        # Reserved blocks past those the tokens can take go back first: the window layers' charge is
        # taken from the free blocks as blocks are filed.
        keep = self.spec.num_blocks_for(num_tokens) + len(points) * self.num_blocks_per_point
        given_back = reserved[keep:]
        del reserved[keep:]  # the caller's list: it frees what is left of it whatever happens here
        self.pool.free(given_back)
        spare = self._file_blocks(
            agent_id, token_ids, kv_runs, points, reserved, salt, self.codec.encode, self._allocate_one
        )
        if self.spec.window_extra:
            self._strip_windows(self.agents[agent_id], num_tokens if resumes_from is None else resumes_from)
        self.pins.settle(self.held_block_ids)
        return spare

    def _strip_windows(self, agent: AgentCache, resumes_from: int) -> None:
        """Drop the sliding layers of the agent's blocks no turn is expected to resume near: those
        before the window ahead of `resumes_from`, unless another cache holds the block too or it
        lies in the window before a shared boundary."""
        size, window = self.spec.block_size, self.spec.sliding_window or 0
        first_kept = max(0, resumes_from - window) // size
        window_blocks = self.spec.num_blocks_for(window)
        kept: set[int] = set()
        if self.shared_states:
            for index, block_hash in enumerate(
                hash_prefix_blocks(agent.token_ids[: first_kept * size], size, agent.salt)
            ):
                if block_hash in self.shared_states:
                    kept.update(range(max(0, index + 1 - window_blocks), index + 1))
        for index, block_id in enumerate(agent.block_ids[:first_kept]):
            if index not in kept and self.pool.blocks[block_id].ref_count == 1:
                self.pool.strip_window(block_id)

    def _file_blocks(
        self,
        agent_id: str,
        token_ids: list[int],
        kv_runs: list[tuple[Any, Any, int]],
        points: list[StatePoint],
        reserved: list[int],
        salt: str | None,
        encode: Callable[[Any], Any],
        allocate: Callable[[], int],
    ) -> list[int]:
        """The agent's cache as pool blocks (shared ones reused, the rest copied out by `encode`
        into blocks from `reserved`, then from `allocate`), and its state points charged blocks."""
        spare = list(reserved)
        block_size = self.spec.block_size
        block_ids = file_blocks(self.pool, block_size, token_ids, kv_runs, spare, salt, encode, allocate)
        state_block_ids: list[int] = []
        try:
            for _ in range(len(points) * self.num_blocks_per_point):
                state_block_ids.append(spare.pop() if spare else allocate())
        except BaseException:
            self.pool.free(block_ids)
            self.pool.free(state_block_ids)
            raise
        previous = self.agents.get(agent_id)
        num_running = previous.num_running if previous else 0
        self.agents[agent_id] = AgentCache(
            agent_id,
            list(token_ids),
            block_ids,
            points,
            state_block_ids,
            num_running=num_running,
            salt=salt,
            is_imported=salt == imported_salt(agent_id),
        )
        if previous is not None:
            self._free(previous)
        else:
            self.held_agent_ids = frozenset(self.agents)
        return spare

    def _free(self, agent: AgentCache) -> None:
        self.pool.free(agent.block_ids)
        self.pool.free(agent.state_block_ids)

    def publish_prefix(
        self, token_ids: list[int], layer_caches: list[Any], spare: list[int], salt: str | None = None
    ) -> list[int]:
        """Publish the full blocks of `token_ids` that the pool lacks, in blocks taken from `spare`
        (a running request's reservation), so other prompts share them before this one finishes.
        Returns the blocks it filled; each keeps the reference it had in `spare` until freed."""
        num_full = len(token_ids) // self.spec.block_size * self.spec.block_size
        num_held = self._num_held(layer_caches)
        kv_runs = [kv_run(layer_caches[layer], num_held) for layer in self.spec.attention_layer_ids]
        filled = publish_blocks(
            self.pool, self.spec.block_size, token_ids[:num_full], kv_runs, spare, salt, self.codec.encode
        )
        self.pins.settle(self.held_block_ids)
        return filled

    def _num_held(self, layer_caches: list[Any]) -> int:
        """How many tokens a running sequence's caches hold (read from its first attention layer)."""
        return int(layer_caches[self.spec.attention_layer_ids[0]].offset)

    def _allocate_one(self) -> int:
        if not self.pool.can_allocate(1):
            self.evict_until(1)
        return self.pool.allocate(1)[0]

    def _allocate_unevicting(self) -> int:
        return self.pool.allocate(1)[0]

    def pin(self, agent_id: str) -> None:
        """A sequence of the agent joined the batch (after `prepare`)."""
        if agent_id in self.agents:
            self.agents[agent_id].num_running += 1
        self.running_shares.start(agent_id)

    def unpin(self, agent_id: str) -> None:
        """A sequence of the agent left the batch."""
        if agent_id in self.agents:
            self.agents[agent_id].num_running = max(0, self.agents[agent_id].num_running - 1)
        self.running_shares.end(agent_id)

    def note_pins(self, prompt: list[int], pins: tuple[CachePin, ...], salt: str | None) -> None:
        """A request's `cache_control` pins, held once their blocks are in the pool."""
        if pins:
            self.pins.note(prompt, pins, salt)
            self.pins.settle(self.held_block_ids)

    def evictable(self) -> list[AgentCache]:
        """Idle agents' caches in the order the eviction policy evicts them (pins past their ttl are
        let go first, so what they held counts as the idle caches' own)."""
        self.pins.settle(self.held_block_ids)
        facts = idle_caches(self.agents.values(), self.spec.block_size, self.running_shares.tips)
        return [self.agents[cache.agent_id] for cache in self.policy.order_idle(facts)]

    def evict_until(self, num_free_blocks: int) -> list[CacheSnapshot]:
        """Evict idle agents in the policy's order (and then shared states) until `num_free_blocks`
        are free."""
        evicted = []
        for agent in self.evictable():
            if self.pool.can_allocate(num_free_blocks):
                break
            evicted.append(self.evict(agent.agent_id))
        while not self.pool.can_allocate(num_free_blocks) and self.drop_shared_state():
            pass
        return evicted

    def evict(self, agent_id: str) -> CacheSnapshot:
        snapshot = self.snapshot(agent_id)
        agent = self.agents.pop(agent_id)
        self.held_agent_ids = frozenset(self.agents)
        self._free(agent)
        self.evicted.append(snapshot)
        return snapshot

    def drop(self, agent_id: str) -> None:
        agent = self.agents.pop(agent_id, None)
        if agent is not None:
            self.held_agent_ids = frozenset(self.agents)
            self._free(agent)

    def snapshot(self, agent_id: str) -> CacheSnapshot:
        agent = self.agents[agent_id]
        spec, size = self.spec, self.spec.block_size
        layers: list[LayerKV] = []
        starts: list[int] = []
        for slot, layer in enumerate(spec.attention_layer_ids):
            start = 0
            if spec.layer_windows[layer] is not None:
                start = window_start(self.pool, self.codec, spec, agent.block_ids, slot, agent.num_tokens)
            held = agent.block_ids[start // size :] if start < agent.num_tokens else []
            if not held:
                layers.append((None, None))
                starts.append(agent.num_tokens)
                continue
            payloads = [self.pool.payload(b)[slot] for b in held]
            keys = mx.concatenate([self.codec.decode(p[0]) for p in payloads], axis=2)
            values = mx.concatenate([self.codec.decode(p[1]) for p in payloads], axis=2)
            layers.append((keys, values))
            starts.append(start)
        return CacheSnapshot(
            agent_id, list(agent.token_ids), layers, starts, list(agent.state_points), agent.is_imported
        )

    def restore(self, snapshot: HostSnapshot, salt: str | None = None) -> None:
        """Put a snapshot read from disk back into the pool as this agent's cache, its full blocks
        (copied once, from the file's arrays) filed under the salt of the turn that needs it. It
        evicts nothing (the engine makes room first, sparing queued requests' caches): without
        enough free blocks it raises PoolExhaustedError and takes none. An imported cache's blocks
        are filed under its own salt instead."""
        salt = imported_salt(snapshot.agent_id) if snapshot.imported else salt
        self.drop(snapshot.agent_id)
        num_tokens = len(snapshot.token_ids)
        needed = self.num_blocks_to_restore(
            snapshot.token_ids, len(snapshot.state_points), snapshot.kv_starts, salt
        )
        if not self.pool.can_allocate(needed):
            raise PoolExhaustedError(f"{needed} blocks needed, {self.pool.num_free_blocks} free")
        kv_runs: list[tuple[Any, Any, int]] = []
        for (keys, values), start in zip(snapshot.attention_layers, snapshot.kv_starts, strict=True):
            if keys is None or values is None:
                kv_runs.append((None, None, num_tokens))
            else:
                kv_runs.append(
                    (keys[..., : num_tokens - start, :], values[..., : num_tokens - start, :], start)
                )
        assert not num_tokens or len(kv_runs) == len(self.spec.attention_layer_ids), (
            "layers missing: engine bug"
        )

        def encode(array: np.ndarray) -> Any:
            return self.codec.encode_host(array, snapshot.dtype)

        allocate = self._allocate_unevicting
        points = [p for p in snapshot.state_points if p.num_tokens <= num_tokens]
        self._file_blocks(snapshot.agent_id, snapshot.token_ids, kv_runs, points, [], salt, encode, allocate)
        self.agents[snapshot.agent_id].from_disk = True

    def num_blocks_to_restore(
        self, token_ids: list[int], num_state_points: int, kv_starts: list[int], salt: str | None
    ) -> int:
        """The free blocks restoring a cache of `token_ids` takes: its blocks the pool lacks, the
        window charge of those holding sliding layers (each layer from its `kv_starts` on; [] for
        all from 0), and its state points'."""
        spec = self.spec
        num_blocks = spec.num_blocks_for(len(token_ids))
        num_new = num_blocks - len(self.held_block_ids(token_ids, salt))
        starts = kv_starts or [0] * len(spec.attention_layer_ids)
        slides = spec.window_slots_mask
        window_start = min(
            (start for start, sliding in zip(starts, slides, strict=True) if sliding), default=len(token_ids)
        )
        num_windowed = num_blocks - window_start // spec.block_size if spec.window_extra else 0
        return num_new + spec.window_extra * num_windowed + num_state_points * self.num_blocks_per_point


def _num_blocks_per_point(spec: ModelCacheSpec) -> int:
    """Pool blocks an agent's state point is charged: its recurrent state and its sliding layers'
    windows (each as wide as the layer's window: a point short of one is charged as if it were)."""
    window_bytes = 0
    for layer, (heads, key_dim, value_dim) in zip(spec.attention_layer_ids, spec.kv_widths, strict=True):
        window_bytes += (spec.layer_windows[layer] or 0) * heads * (key_dim + value_dim) * spec.dtype_size
    return -(-(spec.state_bytes + window_bytes) // spec.bytes_per_block)
