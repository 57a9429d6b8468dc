"""Every place semantic relies on mlx-lm beyond its documented API, each with a check.

Written for mlx-lm 0.32.x. At each model load the engine warns if the installed mlx-lm is outside
that range and runs `check_seams`, which fails naming the assumption that broke: an mlx-lm upgrade
then stops the load instead of quietly changing the batch's behaviour.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx_lm
from loguru import logger
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

WRITTEN_FOR = (0, 32)  # mlx-lm 0.32.x
# The module, not the `mlx_lm.generate` function that the package exports under the same name.
_generate_module = importlib.import_module("mlx_lm.generate")
ATTENTION_PARAMETERS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")


class SeamError(RuntimeError):
    """An assumption semantic makes about mlx-lm's internals does not hold for the installed version."""


def _require(assumption: str, holds: Callable[..., bool], *args: Any) -> None:
    """Raise SeamError naming `assumption` unless `holds(*args)` is true (raising counts as false)."""
    try:
        ok, detail = holds(*args), ""
    except Exception as error:
        ok, detail = False, f" ({type(error).__name__}: {error})"
    if not ok:
        raise SeamError(
            f"mlx-lm {mlx_lm.__version__} breaks an assumption semantic relies on: {assumption}{detail}; "
            f"written for mlx-lm {WRITTEN_FOR[0]}.{WRITTEN_FOR[1]}.x, see engine/mlx_seams.py"
        )


def check_version(version: str = mlx_lm.__version__) -> bool:
    """Warn if mlx-lm is outside the range these seams were written for; True if inside."""
    try:
        inside = tuple(int(part) for part in version.split(".")[:2]) == WRITTEN_FOR
    except ValueError:
        inside = False
    if not inside:
        logger.warning(
            "mlx-lm {} is installed; semantic was written for {}.{}.x and checks its assumptions now",
            version,
            *WRITTEN_FOR,
        )
    return inside


def check_seams(model: Any = None) -> None:
    """Verify every assumption below against the installed mlx-lm; raises SeamError naming one that fails.

    `model` builds the probe BatchGenerator (the engine passes the model it is loading).
    """
    generator = BatchGenerator(model)
    try:
        check_generator(generator)
    finally:
        generator.close()
    check_attention(base.scaled_dot_product_attention)
    check_cache_states()
    check_batch_cache_views()
    check_batch_cache_takeover()
    check_responses()


# ---- BatchGenerator internals: whether a prompt batch is still prefilling, and its batch size ----


def is_prefilling(generator: BatchGenerator) -> bool:
    """Whether the generator has prompts queued or part-way through their prefill."""
    return bool(generator._currently_processing or generator._unprocessed_sequences)


def num_generating(generator: BatchGenerator) -> int:
    """Sequences in the generator's decode batch."""
    return len(generator._generation_batch)


def set_prefill_chunk(generator: BatchGenerator, num_tokens: int) -> None:
    """The most prompt tokens of each prefilling sequence that the generator's next `next()` runs."""
    generator.prefill_step_size = num_tokens


def num_prompt_tokens_processed(generator: BatchGenerator) -> int:
    """Prompt tokens the generator has prefilled since it was made."""
    return int(generator._counters.prompt_tokens)


def first_tokens(generator: BatchGenerator, uids: list[int]) -> dict[int, tuple[int, mx.array]]:
    """The first tokens (and the log-probabilities they were drawn from) of sequences whose prompts
    ended in the last `next()`: computed by then (the step queued for them has run), returned by the
    generator only with the following step."""
    batch = generator._generation_batch
    positions = {uid: index for index, uid in enumerate(batch.uids) if uid in uids}
    if not positions or batch._next_tokens is None:
        return {}
    tokens = batch._next_tokens.tolist()
    return {uid: (int(tokens[index]), batch._next_logprobs[index]) for uid, index in positions.items()}


def cache_views(generator: BatchGenerator, uid: int) -> list[KVCache] | None:
    """A running sequence's per-layer caches as views into the batch's arrays, so that only the
    slices read from them are ever copied (`extract_cache` copies the whole sequence first). None
    unless every layer is a plain `BatchKVCache`."""
    found = generator._find_uids([uid]).get(uid)
    if found is None or found[0] == 0:
        return None
    stage, index = found
    batch = generator._generation_batch if stage == 2 else generator._prompt_batch
    views: list[KVCache] = []
    for layer in batch.prompt_cache:
        if type(layer) is not BatchKVCache or layer.keys is None:
            return None
        views.append(_sequence_view(layer, index))
    return views


def sequence_caches(generator: BatchGenerator, uid: int) -> tuple[list[Any], int] | None:
    """A running sequence's per-layer caches and how many tokens they hold: views into the batch's
    arrays where every layer allows it (`cache_views`), else `extract_cache`'s copy of the whole
    sequence; None if the generator does not hold it."""
    views = cache_views(generator, uid)
    if views is not None:
        return list(views), views[0].offset
    extracted = generator.extract_cache([uid]).get(uid)
    if extracted is None:
        return None
    caches, tokens = extracted
    return list(caches), len(tokens)


def _sequence_view(layer: Any, index: int) -> KVCache:
    """Sequence `index` of a BatchKVCache as a KVCache viewing its arrays: what `extract` copies."""
    padding = int(layer.left_padding[index].item())
    view = KVCache()
    view.keys = layer.keys[index : index + 1, :, padding : layer._idx]
    view.values = layer.values[index : index + 1, :, padding : layer._idx]
    view.offset = layer._idx - padding
    return view


def check_generator(generator: Any) -> None:
    for name, use in (
        ("_currently_processing", "is_prefilling() reads it to hold prompts while a batch prefills"),
        ("_unprocessed_sequences", "is_prefilling() reads it to hold prompts while a batch prefills"),
        ("_generation_batch", "num_generating() reads its length for pool reports"),
    ):
        _require(f"BatchGenerator has an attribute `{name}` ({use})", hasattr, generator, name)
        _require(
            f"a fresh BatchGenerator's `{name}` is an empty sized collection ({use})",
            lambda value: len(value) == 0,
            getattr(generator, name),
        )
    for method, parameters in (
        ("insert", ("prompts", "max_tokens", "caches", "all_tokens", "samplers")),
        ("remove", ("uids", "return_prompt_caches")),
        ("extract_cache", ("uids",)),
    ):
        _require(
            f"BatchGenerator.{method} takes {', '.join(parameters)}",
            lambda function, names: set(names) <= set(inspect.signature(function).parameters),
            getattr(generator, method, None),
            parameters,
        )
    _require(
        "BatchGenerator's `_counters.prompt_tokens` counts prefilled tokens from 0 "
        "(the prefill budget measures each chunk with it)",
        lambda: generator._counters.prompt_tokens == 0,
    )
    _require(
        "BatchGenerator's `next()` reads `prefill_step_size` for each chunk (the prefill budget sets it "
        "every tick)",
        lambda: "self.prefill_step_size" in inspect.getsource(type(generator)._next),
    )
    _require(
        "BatchGenerator's `_generation_batch` has `uids`, `_next_tokens` and `_next_logprobs` "
        "(first_tokens() reads them)",
        lambda batch: isinstance(batch.uids, list) and {"_next_tokens", "_next_logprobs"} <= set(vars(batch)),
        generator._generation_batch,
    )
    _require("BatchGenerator has `_find_uids` (cache_views() reads it)", hasattr, generator, "_find_uids")


# ---- cache state layouts: agent_cache builds caches from `state`, cache_tensors writes it out ----


def check_cache_states() -> None:
    keys = mx.zeros((1, 1, 4, 2))

    def full_state() -> bool:
        full = KVCache()
        full.state = (keys, keys, 3)
        return len(full.state) == 3 and full.offset == 3

    def sliding_state() -> bool:
        sliding = RotatingKVCache(max_size=4)
        sliding.state = (keys, keys, 2, 0, 4, 2)
        return len(sliding.state) == 6 and (sliding.offset, sliding.keep, sliding.max_size) == (2, 0, 4)

    _require("KVCache.state is (keys, values, offset) and setting it sets the offset", full_state)
    _require("RotatingKVCache.state is (keys, values, offset, keep, max_size, idx)", sliding_state)
    _require(
        "quantized KV caches, and only they, have `bits` (the CPU attention hook leaves them to mlx-lm)",
        lambda: hasattr(QuantizedKVCache(), "bits") and not hasattr(KVCache(), "bits"),
    )


def check_batch_cache_views() -> None:
    """`cache_views` reads a BatchKVCache's keys, values, left padding and write index: its views
    must hold what `extract` copies."""

    def views_equal_extract() -> bool:
        batch: Any = BatchKVCache(left_padding=[2, 0])
        keys = mx.arange(2 * 1 * 5 * 2, dtype=mx.float32).reshape(2, 1, 5, 2)
        batch.update_and_fetch(keys, keys + 100)
        extracted, view = batch.extract(0), _sequence_view(batch, 0)
        assert view.keys is not None and view.values is not None
        return (
            view.offset == extracted.offset
            and bool(mx.array_equal(view.keys, extracted.keys))
            and bool(mx.array_equal(view.values, extracted.values))
        )

    _require(
        "BatchKVCache keeps `keys`, `values`, `left_padding` and `_idx`, and extract(i) copies "
        "keys[i, :, left_padding[i]:_idx] (cache_views reads them without the copy)",
        views_equal_extract,
    )


def batch_cache_over(cache: KVCache) -> BatchKVCache:
    """A one-sequence BatchKVCache over `cache`'s own arrays, with no left padding: what
    `BatchKVCache.merge([cache])` holds, without its copy of the whole history, and keeping the room
    `cache` has past its offset for the tokens to come."""
    batch: Any = BatchKVCache(left_padding=[0])
    batch.keys, batch.values = cache.keys, cache.values
    batch.offset = batch.offset + cache.offset
    batch._idx = cache.offset
    return batch


def check_batch_cache_takeover() -> None:
    """`batch_cache_over` sets the fields `merge` sets, and mlx-lm merges a prompt batch's caches
    through the first cache's own `merge` (a layer cache can take the merge over)."""

    def same_as_merge() -> bool:
        history = mx.arange(1 * 2 * 3 * 2, dtype=mx.float32).reshape(1, 2, 3, 2)
        room = mx.zeros((1, 2, 5, 2))
        roomy, plain = KVCache(), KVCache()
        roomy.state = (
            mx.concatenate([history, room], axis=2),
            mx.concatenate([history + 50, room], axis=2),
            3,
        )
        plain.state = (history, history + 50, 3)
        new = mx.ones((1, 2, 2, 2))
        ours, theirs = batch_cache_over(roomy), BatchKVCache.merge([plain])
        ours_kv, theirs_kv = ours.update_and_fetch(new, new), theirs.update_and_fetch(new, new)
        return (
            ours._idx == theirs._idx == 5
            and ours.offset.tolist() == theirs.offset.tolist()
            and ours.left_padding.tolist() == theirs.left_padding.tolist()
            and all(bool(mx.array_equal(a, b)) for a, b in zip(ours_kv, theirs_kv, strict=True))
        )

    _require(
        "BatchKVCache keeps `keys`, `values`, `offset`, `left_padding` and `_idx`, and merge([c]) holds "
        "c's keys and values up to its offset (batch_cache_over builds the same without a copy)",
        same_as_merge,
    )
    _require(
        "PromptProcessingBatch merges its caches with the first cache's `merge` (a rebuilt history "
        "hands its arrays over through it)",
        lambda: ".merge([c[i] for c in caches])" in inspect.getsource(_generate_module._merge_caches),
    )


def check_responses() -> None:
    """The fields the batch reads from `BatchGenerator.next()`'s responses."""
    for owner, fields in (
        ("GenerationBatch", {"uid", "token", "finish_reason", "prompt_cache", "all_tokens"}),
        ("PromptProcessingBatch", {"uid", "progress", "end_of_prompt"}),
    ):
        _require(
            f"{owner}.Response is a dataclass with fields {', '.join(sorted(fields))}",
            lambda response, names: names <= {f.name for f in dataclasses.fields(response)},
            getattr(getattr(_generate_module, owner, None), "Response", None),
            fields,
        )


# ---- the CPU kernels' hooks (engine/cpu_kernels.py) replace mlx-lm's attention by its signature ----


def check_attention(function: Callable[..., Any]) -> None:
    _require(
        f"mlx_lm.models.base.scaled_dot_product_attention takes ({', '.join(ATTENTION_PARAMETERS)})",
        lambda: tuple(inspect.signature(function).parameters) == ATTENTION_PARAMETERS,
    )
