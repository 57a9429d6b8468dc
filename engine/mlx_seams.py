"""Where semantic relies on mlx-lm beyond its documented API, each with a check: BatchGenerator's
internals and its responses, and the attention function's signature here; the KV caches'
internals in `kv_seams.py`.

Written for mlx-lm 0.32.x. At each model load the engine warns if the installed mlx-lm is outside
that range and runs `check_seams`, which fails naming the assumption that broke: an mlx-lm upgrade
then stops the load instead of quietly changing the batch's behaviour.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx_lm
from loguru import logger
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base

from semantic.engine.cache_spec import UnsupportedModelError
from semantic.engine.kv_seams import check_kv_seams
from semantic.engine.seam_check import WRITTEN_FOR, generate_module, require
from semantic.engine.seam_check import SeamError as SeamError

ATTENTION_PARAMETERS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")


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


# Model families whose mlx-lm code cannot run in a batch (mlx-lm's own BatchGenerator fails the same
# way), with why: refused at load, since a batch is how semantic runs every request.
UNBATCHABLE_FAMILIES = {
    "gemma2": (
        "mlx-lm's gemma2 attention applies a batch's mask (one row a sequence) to scores grouped by KV "
        "head: three sequences fail to broadcast, and two sequences with two KV heads mix each other's "
        "masks"
    ),
    "gpt_bigcode": (
        "mlx-lm's gpt_bigcode reads its cache's offset as one number for its learned positions; a batch "
        "has one offset a sequence"
    ),
}


def check_batchable(model: Any) -> None:
    """Raise UnsupportedModelError for a model of a family mlx-lm cannot batch."""
    family = str(
        getattr(getattr(model, "args", None), "model_type", None) or getattr(model, "model_type", "")
    )
    reason = UNBATCHABLE_FAMILIES.get(family)
    if reason is not None and (family != "gemma2" or _groups_heads(model)):
        raise UnsupportedModelError(f"{family} cannot decode in a batch: {reason}")


def _groups_heads(model: Any) -> bool:
    """Whether the model's attention groups query heads onto fewer KV heads (gemma2's broken path)."""
    args = getattr(model, "args", None)
    heads, kv_heads = getattr(args, "num_attention_heads", 0), getattr(args, "num_key_value_heads", 0)
    return bool(heads and kv_heads and heads != kv_heads)


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
    check_kv_seams()
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


def check_generator(generator: Any) -> None:
    for name, use in (
        ("_currently_processing", "is_prefilling() reads it to hold prompts while a batch prefills"),
        ("_unprocessed_sequences", "is_prefilling() reads it to hold prompts while a batch prefills"),
        ("_generation_batch", "num_generating() reads its length for pool reports"),
    ):
        require(f"BatchGenerator has an attribute `{name}` ({use})", hasattr, generator, name)
        require(
            f"a fresh BatchGenerator's `{name}` is an empty sized collection ({use})",
            lambda value: len(value) == 0,
            getattr(generator, name),
        )
    for method, parameters in (
        ("insert_segments", ("segments", "max_tokens", "caches", "all_tokens", "samplers")),
        ("remove", ("uids", "return_prompt_caches")),
        ("extract_cache", ("uids",)),
    ):
        require(
            f"BatchGenerator.{method} takes {', '.join(parameters)}",
            lambda function, names: set(names) <= set(inspect.signature(function).parameters),
            getattr(generator, method, None),
            parameters,
        )
    require(
        "BatchGenerator's `_counters.prompt_tokens` counts prefilled tokens from 0 "
        "(the prefill budget measures each chunk with it)",
        lambda: generator._counters.prompt_tokens == 0,
    )
    require(
        "BatchGenerator's `next()` reads `prefill_step_size` for each chunk (the prefill budget sets it "
        "every tick)",
        lambda: "self.prefill_step_size" in inspect.getsource(type(generator)._next),
    )
    require(
        "BatchGenerator's `_generation_batch` has `uids`, `_next_tokens` and `_next_logprobs` "
        "(first_tokens() reads them)",
        lambda batch: isinstance(batch.uids, list) and {"_next_tokens", "_next_logprobs"} <= set(vars(batch)),
        generator._generation_batch,
    )
    require("BatchGenerator has `_find_uids` (cache_views() reads it)", hasattr, generator, "_find_uids")
    require(
        "BatchGenerator's `next()` ends a prefill chunk at a segment's end and says so in its progress "
        "(a recurrent model's state is kept there)",
        lambda: (
            "end_of_segment = True" in inspect.getsource(type(generator)._next)
            or "end_of_segment = True" in inspect.getsource(BatchGenerator._next)
        ),
    )


def check_responses() -> None:
    """The fields the batch reads from `BatchGenerator.next()`'s responses."""
    for owner, fields in (
        ("GenerationBatch", {"uid", "token", "finish_reason", "prompt_cache", "all_tokens"}),
        ("PromptProcessingBatch", {"uid", "progress", "end_of_prompt"}),
    ):
        require(
            f"{owner}.Response is a dataclass with fields {', '.join(sorted(fields))}",
            lambda response, names: names <= {f.name for f in dataclasses.fields(response)},
            getattr(getattr(generate_module, owner, None), "Response", None),
            fields,
        )


# ---- the CPU kernels' hooks (engine/cpu_kernels.py) replace mlx-lm's attention by its signature ----


def check_attention(function: Callable[..., Any]) -> None:
    require(
        f"mlx_lm.models.base.scaled_dot_product_attention takes ({', '.join(ATTENTION_PARAMETERS)})",
        lambda: tuple(inspect.signature(function).parameters) == ATTENTION_PARAMETERS,
    )
