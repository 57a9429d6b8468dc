"""Prefixes a client asked to keep (Anthropic `cache_control`), held in the pool for their ttl.

A pin holds one reference to each full block of its prefix, so the prefix outlives the caches that
share it (an agent evicted to disk leaves it for the next prompt that starts with it) until its ttl
passes. Pins hold at most the eviction policy's share of the pool, and each owner (a tenant: the
namespace its cache salts start with) at most an equal part of that among the owners holding pins;
a new pin makes room only from its own owner's least recently pinned, never another owner's, and
where the others fill the room it waits. When the pool itself runs short, the owner holding the
most pinned blocks lets go first (`drop_order`). A pin whose blocks are not all in the pool yet (a prompt
still being prefilled) waits too, and takes them once they are. Engine thread only, owned by the
`AgentCacheStore`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from semantic.engine.cache_store.block_pool import BlockHash, BlockPool, hash_prefix_blocks
from semantic.engine.cache_store.eviction import EvictionPolicy

MAX_WAITING_PINS = 64  # an owner's pins still waiting for blocks or room; its oldest go past it


def pin_owner(salt: str | None) -> str | None:
    """Whose share a pin counts against: the namespace a keys file's tenant has its salts start
    with (`namespace\0salt`, protocols/tenancy.py); without one every caller is the one owner."""
    return salt.partition("\0")[0] if salt is not None and "\0" in salt else None


@dataclass(slots=True)
class PrefixPin:
    token_ids: list[int]  # the pinned prefix, whole blocks
    salt: str | None
    expires_at: float  # on the policy's clock
    block_ids: list[int] = field(default_factory=list)  # held (one reference each) once all are in the pool

    @property
    def owner(self) -> str | None:
        return pin_owner(self.salt)


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
            owner = pin_owner(salt)
            own_waiting = [k for k, p in self.waiting.items() if p.owner == owner]
            for oldest in own_waiting[: len(own_waiting) - MAX_WAITING_PINS]:
                del self.waiting[oldest]

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
            if len(block_ids) * self._pool.block_size < len(pin.token_ids):
                continue  # still being prefilled
            share = self._share_of(pin.owner)
            if len(block_ids) > share:
                del self.waiting[key]  # alone past its owner's share: never held
            elif self._make_room(pin.owner, block_ids, share):
                del self.waiting[key]
                self._pool.touch(block_ids)
                pin.block_ids = block_ids
                self.held[key] = pin

    def _share_of(self, owner: str | None) -> int:
        """The blocks `owner`'s pins may hold: the policy's pin room split equally among the owners
        holding pins (and this one), so one tenant's pins never crowd out another's."""
        limit = self._policy.max_pinned_blocks(self._pool.num_blocks)
        return limit // len({p.owner for p in self.held.values()} | {owner})

    def _make_room(self, owner: str | None, block_ids: list[int], share: int) -> bool:
        """Let go of `owner`'s least recently pinned until `block_ids` fit in its share and in the
        room; False (nothing let go) where other owners' pins alone leave no room for them."""
        limit = self._policy.max_pinned_blocks(self._pool.num_blocks)
        others = [p for p in self.held.values() if p.owner != owner]
        if _num_blocks(block_ids, others) > limit:
            return False
        while True:
            own = [(k, p) for k, p in self.held.items() if p.owner == owner]
            num_own = _num_blocks(block_ids, [p for _, p in own])
            if num_own <= share and _num_blocks(block_ids, self.held.values()) <= limit:
                return True
            self._pool.free(self.held.pop(own[0][0]).block_ids)

    def drop(self) -> bool:
        """Let go of a pin to make room in the pool (`drop_order`'s first); whether there was one."""
        if not self.held:
            return False
        self._pool.free(self.held.pop(self.drop_order()[0]).block_ids)
        return True

    def drop_order(self) -> list[BlockHash]:
        """The held pins in the order the pool's pressure lets them go: always the least recently
        pinned of the owner holding the most blocks, so one tenant's load on the pool costs another
        tenant's pins only once that tenant holds no less than the first."""
        remaining = OrderedDict(self.held)
        order: list[BlockHash] = []
        while remaining:
            owners = {pin.owner for pin in remaining.values()}
            held = {o: _num_blocks([], [p for p in remaining.values() if p.owner == o]) for o in owners}
            largest = max(held.values())
            key = next(k for k, p in remaining.items() if held[p.owner] == largest)
            order.append(key)
            del remaining[key]
        return order

    def is_pinned(self, token_ids: Sequence[int], salt: str | None) -> bool:
        """Whether a held pin covers exactly this prefix (whole blocks)."""
        size = self._pool.block_size
        if not token_ids or len(token_ids) % size:
            return False
        return hash_prefix_blocks(token_ids, size, salt)[-1] in self.held


def _num_blocks(block_ids: list[int], pins: Iterable[PrefixPin]) -> int:
    """Blocks held by `pins` and `block_ids` together (pins of one owner may share leading blocks)."""
    return len({*block_ids, *(b for pin in pins for b in pin.block_ids)})


class CachePin(NamedTuple):
    num_tokens: int  # the prompt's leading tokens it pins
    ttl_s: float
