"""Fixed-size KV blocks under one byte budget: O(1) allocate/free, ref counts, prefix hashes.

The pool is bookkeeping only; a block's `payload` is whatever the engine stores for it (per-layer
key/value arrays). Free blocks form an LRU: the front is reused first. A freed block keeps its hash
and payload until its id is reused, so a later request with the same prefix can revive it.

A block costs the bytes of its full-attention layers. Where the model also has sliding-window layers,
a block whose payload holds them (`window_slots`, which only blocks near where turns resume keep)
is charged `window_extra` more blocks for them, taken from the free blocks as the payload is set and
given back when those layers are stripped or the payload goes; without free blocks for the charge the
window layers are not kept (the block can then not be resumed at, only computed again).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from semantic.engine.loop.errors import PoolExhaustedError

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of a full block: covers every token before it through `parent_hash`."""
    digest = hashlib.blake2b(parent_hash or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def salt_root(salt: str | None) -> BlockHash | None:
    """The chain's root for a cache salt: blocks hashed under different salts never match, so
    `cached_tokens` cannot tell one salt's caller what another salt's callers sent."""
    if salt is None:
        return None
    return hashlib.blake2b(b"cache-salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, in order, chained from `salt`'s root."""
    hashes: list[BlockHash] = []
    parent = salt_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class Block:
    __slots__ = ("block_hash", "block_id", "extra_block_ids", "payload", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()
        self.payload: Any = None
        self.extra_block_ids: list[int] = []  # charged for its window layers


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int = 0,
        window_slots: tuple[int, ...] = (),
        window_extra: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.window_slots = window_slots if window_extra else ()
        self.window_extra = window_extra
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[BlockHash, int] = {}
        self._num_reclaimable = 0  # extra blocks charged to free blocks: taken back as those are reused

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        bytes_per_block: int,
        block_size: int,
        window_slots: tuple[int, ...] = (),
        window_extra: int = 0,
    ) -> BlockPool:
        num_blocks = budget_bytes // bytes_per_block
        if num_blocks < 1 + window_extra:
            raise ValueError(
                f"cache budget {budget_bytes / 2**20:.1f} MiB is below one block "
                f"({bytes_per_block * (1 + window_extra) / 2**20:.1f} MiB for {block_size} tokens "
                "of this model)"
            )
        return cls(num_blocks, block_size, bytes_per_block, window_slots, window_extra)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an `allocate` can take: the free ones and those charged to free blocks' windows."""
        return len(self.free_block_ids) + self._num_reclaimable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def used_bytes(self) -> int:
        return self.num_used_blocks * self.bytes_per_block

    @property
    def budget_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` fresh blocks (ref count 1), evicting the oldest free ones' hashes."""
        if not self.can_allocate(num_blocks):
            raise PoolExhaustedError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_count == 0, f"free block {block_id} has ref count {block.ref_count}: pool bug"
            self._forget_hash(block)
            self._num_reclaimable -= len(block.extra_block_ids)
            self._set(block, None)  # its window charge goes back to the free blocks' front
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block, reviving free ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self._num_reclaimable -= len(block.extra_block_ids)
            block.ref_count += 1

    def free(self, ordered_block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; pass a sequence's blocks in order, the tail is evicted first."""
        for block_id in reversed(ordered_block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken: caller bug"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:
                    self._set(block, None)
                    self.free_block_ids.move_to_end(block_id, last=False)
                else:
                    self._num_reclaimable += len(block.extra_block_ids)

    def cache_full_block(
        self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int], payload: Any
    ) -> None:
        """Publish a full block under its chained hash so other sequences can share it."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} is published while free: caller bug"
        assert block.block_hash is None, f"block {block_id} already has a hash: caller bug"
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks of {self.block_size} tokens are cached, got {len(token_ids)}")
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._set(block, payload)
        self.hash_to_block_id.setdefault(block_hash, block_id)

    def set_payload(self, block_id: int, payload: Any) -> Any:
        """Give a held block `payload`; returns what it keeps (without its window layers where no
        free blocks are left to charge them)."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"payload set on free block {block_id}: caller bug"
        return self._set(block, payload)

    def strip_window(self, block_id: int) -> None:
        """Drop a held block's window layers (no turn will resume near it) and their charge."""
        block = self.blocks[block_id]
        if self._holds_window(block.payload):
            self._set(block, self._without_window(block.payload))

    def holds_window(self, block_id: int) -> bool:
        return self._holds_window(self.blocks[block_id].payload)

    def _holds_window(self, payload: Any) -> bool:
        return payload is not None and any(payload[slot] is not None for slot in self.window_slots)

    def _without_window(self, payload: Any) -> Any:
        return tuple(None if slot in self.window_slots else layer for slot, layer in enumerate(payload))

    def _set(self, block: Block, payload: Any) -> Any:
        """The one place a payload changes: charge or give back the window layers' extra blocks. The
        caller keeps `_num_reclaimable` (the charge of free blocks) right."""
        wants = self.window_extra if self._holds_window(payload) else 0
        if wants > len(block.extra_block_ids):
            if self.num_free_blocks >= wants - len(block.extra_block_ids):
                block.extra_block_ids += self.allocate(wants - len(block.extra_block_ids))
            else:
                payload, wants = self._without_window(payload), 0
        if wants < len(block.extra_block_ids):
            extra, block.extra_block_ids = block.extra_block_ids, []
            self.free(extra)
        block.payload = payload
        return payload

    def empty(self, block_ids: Iterable[int]) -> None:
        """Take back what these blocks were given (hash and payload), as if fresh; their references stay."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            self._forget_hash(block)
            self._set(block, None)

    def payload(self, block_id: int) -> Any:
        return self.blocks[block_id].payload

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash, verified token for token."""
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None
        return block_id

    def _forget_hash(self, block: Block) -> None:
        if block.block_hash is not None and self.hash_to_block_id.get(block.block_hash) == block.block_id:
            del self.hash_to_block_id[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
