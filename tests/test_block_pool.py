"""BlockPool invariants under random operation sequences, and its exact behaviour at tiny scale."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from semantic.engine.cache_store.block_pool import BlockPool, hash_block_tokens, hash_prefix_blocks
from semantic.engine.loop.errors import PoolExhaustedError

BLOCK_SIZE = 4


def test_allocate_free_and_lru_order() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free_blocks == 2
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(PoolExhaustedError, match="cannot allocate 3 blocks: 2 free"):
        pool.allocate(3)
    pool.free(a)
    # Unhashed blocks go to the front, tail first, so they are reused before cached ones.
    assert list(pool.free_block_ids) == [0, 1, 2, 3]


def test_hash_hit_is_verified_and_freed_block_can_be_revived() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    tokens = [1, 2, 3, 4]
    (block,) = pool.allocate(1)
    digest = hash_block_tokens(None, tokens)
    pool.cache_full_block(block, digest, tokens, payload="kv")
    assert pool.get_cached_block(digest, tokens) == block
    assert pool.get_cached_block(digest, [1, 2, 3, 5]) is None  # a collision never serves wrong KV
    pool.free([block])
    assert pool.get_cached_block(digest, tokens) == block  # freed but still cached
    pool.touch([block])
    assert pool.num_free_blocks == 2 and pool.payload(block) == "kv"
    pool.free([block])
    pool.allocate(3)  # reuse evicts the hash lazily
    assert pool.get_cached_block(digest, tokens) is None


def test_prefix_hashes_chain() -> None:
    hashes = hash_prefix_blocks(list(range(10)), BLOCK_SIZE)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert hash_prefix_blocks([9, *range(1, 10)], BLOCK_SIZE)[1] != hashes[1]


def test_budget_below_one_block_is_refused_with_sizes() -> None:
    with pytest.raises(ValueError, match="below one block"):
        BlockPool.from_budget(100, 1000, BLOCK_SIZE)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8, BLOCK_SIZE)
        self.owned: list[list[int]] = []
        self.refs: dict[int, int] = {}

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free_blocks
        assert self.pool.can_allocate(n) == (n <= free_before)
        assert self.pool.num_free_blocks == free_before  # can_allocate never mutates
        if n <= free_before:
            blocks = self.pool.allocate(n)
            for b in blocks:
                assert self.refs.get(b, 0) == 0
                self.refs[b] = 1
            self.owned.append(blocks)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        blocks = self.owned.pop(data.draw(st.integers(0, len(self.owned) - 1)))
        self.pool.free(blocks)
        for b in blocks:
            self.refs[b] -= 1

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), token=st.integers(0, 3))
    def publish_and_share(self, data: st.DataObject, token: int) -> None:
        blocks = self.owned[data.draw(st.integers(0, len(self.owned) - 1))]
        block = blocks[0]
        tokens = [token] * BLOCK_SIZE
        digest = hash_block_tokens(None, tokens)
        if self.pool.blocks[block].block_hash is None:
            self.pool.cache_full_block(block, digest, tokens, payload=token)
        hit = self.pool.get_cached_block(digest, tokens)
        if hit is not None:
            self.pool.touch([hit])
            self.refs[hit] = self.refs.get(hit, 0) + 1
            self.owned.append([hit])

    @invariant()
    def free_plus_used_is_total(self) -> None:
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        assert self.pool.num_used_blocks == sum(1 for r in self.refs.values() if r > 0)

    @invariant()
    def ref_counts_match_and_are_never_negative(self) -> None:
        for block in self.pool.blocks:
            assert block.ref_count == self.refs.get(block.block_id, 0) >= 0
            assert (block.ref_count == 0) == (block.block_id in self.pool.free_block_ids)

    @invariant()
    def every_hash_entry_points_at_a_block_with_that_hash(self) -> None:
        for digest, block_id in self.pool.hash_to_block_id.items():
            assert self.pool.blocks[block_id].block_hash == digest


TestPoolMachine = PoolMachine.TestCase


class WindowPoolMachine(PoolMachine):
    """A pool whose blocks may hold sliding layers (slot 1 of a payload), charged two more blocks
    each: the charge is taken from the free blocks as a payload gets them (or they are not kept),
    given back as they are stripped or the block is reused, and never lost or counted twice."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, BLOCK_SIZE, window_slots=(1,), window_extra=2)

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), token=st.integers(0, 3), windowed=st.booleans())
    def publish_and_share(self, data: st.DataObject, token: int, windowed: bool = True) -> None:
        blocks = self.owned[data.draw(st.integers(0, len(self.owned) - 1))]
        block = blocks[0]
        tokens = [token] * BLOCK_SIZE
        digest = hash_block_tokens(None, tokens)
        if self.pool.blocks[block].block_hash is None:
            self.pool.cache_full_block(block, digest, tokens, payload=("kv", "window" if windowed else None))
        hit = self.pool.get_cached_block(digest, tokens)
        if hit is not None:
            self.pool.touch([hit])
            self.refs[hit] = self.refs.get(hit, 0) + 1
            self.owned.append([hit])

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), windowed=st.booleans())
    def set_or_strip_window(self, data: st.DataObject, windowed: bool) -> None:
        block = self.owned[data.draw(st.integers(0, len(self.owned) - 1))][0]
        free_before = self.pool.num_free_blocks
        charged_before = len(self.pool.blocks[block].extra_block_ids)
        if windowed:
            kept = self.pool.set_payload(block, ("kv", "window"))
            assert (kept[1] is not None) == (charged_before == 2 or free_before >= 2)
        else:
            self.pool.strip_window(block)
            assert not self.pool.holds_window(block)
        charged = len(self.pool.blocks[block].extra_block_ids)
        assert self.pool.num_free_blocks == free_before - (charged - charged_before)

    @invariant()
    def free_plus_used_is_total(self) -> None:
        pool = self.pool
        extras = [e for b in pool.blocks for e in b.extra_block_ids]
        assert len(extras) == len(set(extras)), "a block charged to two windows"
        owned = {b for b, r in self.refs.items() if r > 0}
        assert not owned & set(extras), "a block both held and charged"
        assert all(pool.blocks[e].ref_count == 1 for e in extras)
        assert len(pool.free_block_ids) + len(owned) + len(extras) == pool.num_blocks
        charged_to_free = sum(len(pool.blocks[b].extra_block_ids) for b in pool.free_block_ids)
        assert pool.num_free_blocks == len(pool.free_block_ids) + charged_to_free

    @invariant()
    def a_block_is_charged_exactly_for_the_window_it_holds(self) -> None:
        for block in self.pool.blocks:
            holds = block.payload is not None and block.payload[1] is not None
            assert len(block.extra_block_ids) == (2 if holds else 0)

    @invariant()
    def ref_counts_match_and_are_never_negative(self) -> None:
        extras = {e for b in self.pool.blocks for e in b.extra_block_ids}
        for block in self.pool.blocks:
            if block.block_id not in extras:
                assert block.ref_count == self.refs.get(block.block_id, 0) >= 0
            assert (block.ref_count == 0) == (block.block_id in self.pool.free_block_ids)


TestWindowPoolMachine = WindowPoolMachine.TestCase
