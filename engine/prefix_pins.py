"""Prefixes a client asked to keep (Anthropic `cache_control`), held in the pool for their ttl.

A pin holds one reference to each full block of its prefix, so the prefix outlives the caches that
share it (an agent evicted to disk leaves it for the next prompt that starts with it) until its ttl
passes. Pins hold at most the eviction policy's share of the pool; past it the least recently
pinned go. A pin whose blocks are not all in the pool yet (a prompt still being prefilled) waits
and takes them once they are. Engine thread only, owned by the `AgentCacheStore`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from semantic.engine.block_pool import BlockHash, BlockPool, hash_prefix_blocks
from semantic.engine.cache_pins import CachePin
from semantic.engine.eviction import EvictionPolicy

MAX_WAITING_PINS = 64  # pins whose blocks are still being computed; the oldest go past it


@dataclass(slots=True)
class PrefixPin:
    token_ids: list[int]  # the pinned prefix, whole blocks
    salt: str | None
    expires_at: float  # on the policy's clock
    block_ids: list[int] = field(default_factory=list)  # held (one reference each) once all are in the pool


class PrefixPins:
    def __init__(self, pool: BlockPool, policy: EvictionPolicy) -> None:
        self._pool = pool
        self._policy = policy
        self.held: OrderedDict[BlockHash, PrefixPin] = OrderedDict()  # least recently pinned first
        self.waiting: OrderedDict[BlockHash, PrefixPin] = OrderedDict()

    @property
    def num_pinned_blocks(self) -> int:
        return len({b for pin in self.held.values() for b in pin.block_ids})

    def note(self, prompt: Sequence[int], pins: Sequence[CachePin], salt: str | None) -> None:
        """A request's pins: each renews its ttl where it is held, else waits for its blocks."""
        size = self._pool.block_size
        for pin in pins:
            num_tokens = pin.num_tokens // size * size
            if not num_tokens:
                continue
            token_ids = list(prompt[:num_tokens])
            key = hash_prefix_blocks(token_ids, size, salt)[-1]
            expires_at = self._policy.pin_expires_at(pin.ttl_s)
            held = self.held.get(key)
            if held is not None:
                held.expires_at = max(held.expires_at, expires_at)
                self.held.move_to_end(key)
                continue
            earlier = self.waiting.pop(key, None)
            if earlier is not None:
                expires_at = max(expires_at, earlier.expires_at)
            self.waiting[key] = PrefixPin(token_ids, salt, expires_at)
            while len(self.waiting) > MAX_WAITING_PINS:
                self.waiting.popitem(last=False)

    def settle(self, held_block_ids: Callable[[list[int], str | None], list[int]]) -> None:
        """Let go of pins whose ttl passed; hold the waiting pins whose blocks are all in the pool
        (`held_block_ids`: the pool's blocks holding a prefix's leading tokens)."""
        for key, pin in list(self.held.items()):
            if not self._policy.is_pin_live(pin.expires_at):
                del self.held[key]
                self._pool.free(pin.block_ids)
        for key, pin in list(self.waiting.items()):
            if not self._policy.is_pin_live(pin.expires_at):
                del self.waiting[key]
                continue
            block_ids = held_block_ids(pin.token_ids, pin.salt)
            if len(block_ids) * self._pool.block_size >= len(pin.token_ids):
                del self.waiting[key]
                self._hold(key, pin, block_ids)

    def _hold(self, key: BlockHash, pin: PrefixPin, block_ids: list[int]) -> None:
        limit = self._policy.max_pinned_blocks(self._pool.num_blocks)
        if len(block_ids) > limit:
            return
        while self.held and len({*block_ids} | {b for p in self.held.values() for b in p.block_ids}) > limit:
            self.drop()
        self._pool.touch(block_ids)
        pin.block_ids = block_ids
        self.held[key] = pin

    def drop(self) -> bool:
        """Let go of the least recently pinned prefix (to make room); whether there was one."""
        if not self.held:
            return False
        _, pin = self.held.popitem(last=False)
        self._pool.free(pin.block_ids)
        return True

    def is_pinned(self, token_ids: Sequence[int], salt: str | None) -> bool:
        """Whether a held pin covers exactly this prefix (whole blocks)."""
        size = self._pool.block_size
        if not token_ids or len(token_ids) % size:
            return False
        return hash_prefix_blocks(token_ids, size, salt)[-1] in self.held
