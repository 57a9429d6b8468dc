"""A sequence's keys and values cut into pool blocks.

Full blocks are filed under their chained hashes (rooted in the cache salt): a block the pool
already holds with the same hash and tokens is reused, not copied, so a returning agent's turn
copies its new blocks only; the last, partial block is private. The copies are made by an `encode`
(`BlockCodec.encode` from the batch's MLX arrays, `encode_host` from a cache file's) and evaluated
before the blocks are returned, so that none keeps the arrays it was cut from alive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from semantic.engine.cache_store.block_pool import BlockPool, hash_block_tokens, hash_prefix_blocks, salt_root
from semantic.engine.cache_store.layer_caches import block_payload


def file_blocks(
    pool: BlockPool,
    block_size: int,
    token_ids: list[int],
    kv_runs: list[tuple[Any, Any, int]],
    spare: list[int],
    salt: str | None,
    encode: Callable[[Any], Any],
    allocate: Callable[[], int],
) -> list[int]:
    """The blocks holding `token_ids` (each attention layer's keys and values of tokens [start, end)
    in `kv_runs`, `layer_caches.kv_run`'s): shared full blocks reused and touched (a sliding layer
    they lack filled in from the run), the rest filled in blocks popped from `spare`, then from
    `allocate`."""
    block_ids: list[int] = []
    taken: list[int] = []  # the references taken here (not `spare`'s): given back if filing fails
    filed: list[int] = []  # the blocks given contents here: emptied again if filing fails
    parent = salt_root(salt)
    try:
        for start in range(0, len(token_ids), block_size):
            tokens = token_ids[start : start + block_size]
            if len(tokens) == block_size:
                parent = hash_block_tokens(parent, tokens)
                existing = pool.get_cached_block(parent, tokens)
                if existing is not None:
                    pool.touch([existing])
                    fill_missing(pool, existing, kv_runs, start, encode)
                    taken.append(existing)
                    block_ids.append(existing)
                    continue
            if spare:
                block_id = spare.pop()
            else:
                block_id = allocate()
                taken.append(block_id)
            filed.append(block_id)
            payload = block_payload(kv_runs, start, len(tokens), encode)
            if len(tokens) == block_size:
                assert parent is not None
                pool.cache_full_block(block_id, parent, tokens, payload)
            else:
                pool.set_payload(block_id, payload)
            block_ids.append(block_id)
        mx.eval([pool.payload(b) for b in block_ids])
    except BaseException:
        # Unpublished, so no lazy payload keeps the source arrays alive or is shared; blocks
        # popped from `spare` stay the caller's.
        pool.empty(filed)
        pool.free(taken)
        raise
    return block_ids


def publish_blocks(
    pool: BlockPool,
    block_size: int,
    token_ids: list[int],
    kv_runs: list[tuple[Any, Any, int]],
    spare: list[int],
    salt: str | None,
    encode: Callable[[Any], Any],
) -> list[int]:
    """File the full blocks of `token_ids` that the pool lacks, in blocks popped from `spare` (as
    many as it has); returns the blocks it filled."""
    hashes = hash_prefix_blocks(token_ids, block_size, salt)
    published: list[int] = []
    for start, block_hash in zip(range(0, len(hashes) * block_size, block_size), hashes, strict=True):
        tokens = token_ids[start : start + block_size]
        existing = pool.get_cached_block(block_hash, tokens)
        if existing is not None:
            fill_missing(pool, existing, kv_runs, start, encode)
            continue
        if not spare:
            break
        block_id = spare.pop()
        pool.cache_full_block(block_id, block_hash, tokens, block_payload(kv_runs, start, block_size, encode))
        published.append(block_id)
    mx.eval([pool.payload(b) for b in published])
    return published


def fill_missing(
    pool: BlockPool,
    block_id: int,
    kv_runs: list[tuple[Any, Any, int]],
    start: int,
    encode: Callable[[Any], Any],
) -> None:
    """Give a shared block the sliding layers it lacks where this sequence's runs hold them: the same
    tokens after the same prefix have the same keys and values, and a resume near the block needs them."""
    payload = pool.payload(block_id)
    if payload is None or pool.blocks[block_id].ref_count == 0:
        return
    end = start + pool.block_size
    runs: list[tuple[Any, Any, int]] = []
    for old, (keys, values, kv_start) in zip(payload, kv_runs, strict=True):
        covers = keys is not None and kv_start < end and end - kv_start <= keys.shape[2]
        gives = end - max(start, kv_start) if covers else 0
        runs.append(
            (keys, values, kv_start)
            if gives > (_length(old) if old is not None else 0)
            else (None, None, end)
        )
    if all(keys is None for keys, _, _ in runs):
        return
    fresh = block_payload(runs, start, pool.block_size, encode)
    filled = tuple(new if new is not None else old for old, new in zip(payload, fresh, strict=True))
    mx.eval(filled)
    pool.set_payload(block_id, filled)


def _length(piece: Any) -> int:
    """Tokens a block's piece of one layer covers (its keys' third axis, quantized or not)."""
    keys = piece[0]
    return int((keys[0] if isinstance(keys, tuple) else keys).shape[2])
