"""BatchGenerator's internals that the batch reads (is a prompt still prefilling, how many
sequences decode, the prefill chunk, tokens prefilled, first tokens), and the fields of `next()`'s
responses, each with a check that `checks.check_seams` runs at load.

Written against mlx-lm 0.32.2: its BatchGenerator has no public way to ask these.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from semantic.engine.mlx_adapter.seam_check import generate_module, require

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
