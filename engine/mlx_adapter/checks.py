"""What runs at each model load to find out whether the installed mlx-lm is the one the adapter was
written against (0.32.2): a version warning, then every seam's check, then whether the model's
family can run in a batch at all.

An mlx-lm upgrade that breaks an assumption stops the load with a SeamError naming it, instead of
quietly changing the batch's behaviour.
"""

from __future__ import annotations

from typing import Any

from loguru import logger

from semantic.engine.cache_store.cache_spec import UnsupportedModelError
from semantic.engine.mlx_adapter.api import MLX_LM_VERSION, BatchGenerator
from semantic.engine.mlx_adapter.generator_seams import check_generator, check_responses
from semantic.engine.mlx_adapter.guided_batch import check_guided_batch
from semantic.engine.mlx_adapter.kv_seams import check_kv_seams
from semantic.engine.mlx_adapter.model_hooks import check_model_hooks
from semantic.engine.mlx_adapter.seam_check import WRITTEN_FOR
from semantic.engine.mlx_adapter.seam_check import SeamError as SeamError
from semantic.engine.mlx_adapter.speculative_batch import check_speculative_batch
from semantic.engine.mlx_adapter.tokenizers import check_tokenizer_seams


def check_version(version: str = MLX_LM_VERSION) -> bool:
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
    """Verify every assumption the adapter makes against the installed mlx-lm; raises SeamError
    naming one that fails. `model` builds the probe BatchGenerator (the engine passes the model it
    is loading)."""
    generator = BatchGenerator(model)
    try:
        check_generator(generator)
    finally:
        generator.close()
    check_responses()
    check_model_hooks()
    check_kv_seams()
    check_tokenizer_seams()
    check_speculative_batch()
    check_guided_batch()


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
