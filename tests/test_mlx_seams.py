"""mlx-lm's internals that semantic relies on: all hold for the installed version, and a broken one
is named when it fails."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from semantic.engine.cache_store.cache_spec import UnsupportedModelError
from semantic.engine.mlx_adapter import checks, generator_seams, model_hooks
from semantic.engine.mlx_adapter.seam_check import SeamError


def test_the_installed_mlx_lm_meets_every_assumption() -> None:
    assert checks.check_version()
    checks.check_seams()


def test_a_version_outside_the_written_range_is_reported() -> None:
    assert checks.check_version("0.32.9")
    assert not checks.check_version("0.33.0")
    assert not checks.check_version("1.0")


def test_a_generator_missing_an_attribute_fails_naming_it() -> None:
    class StandIn:  # a BatchGenerator whose prompt queue was renamed
        def __init__(self) -> None:
            self._unprocessed_sequences: deque[object] = deque()
            self._generation_batch: list[object] = []

    with pytest.raises(SeamError, match="BatchGenerator has an attribute `_currently_processing`"):
        generator_seams.check_generator(StandIn())


def test_a_generator_whose_insert_lost_a_parameter_fails_naming_it() -> None:
    class StandIn:
        _currently_processing = _unprocessed_sequences = _generation_batch = ()

        def insert_segments(self, segments: object, max_tokens: object, caches: object) -> None: ...
        def remove(self, uids: object, return_prompt_caches: bool = False) -> None: ...
        def extract_cache(self, uids: object) -> None: ...

    with pytest.raises(SeamError, match=r"BatchGenerator.insert_segments takes .*all_tokens"):
        generator_seams.check_generator(StandIn())


def test_a_changed_attention_signature_fails_naming_it() -> None:
    def scaled_dot_product_attention(queries: object, keys: object, values: object, scale: float) -> None: ...

    with pytest.raises(SeamError, match=r"scaled_dot_product_attention takes \(queries, keys, values, cache"):
        model_hooks.check_attention(scaled_dot_product_attention)


def test_a_probe_that_raises_fails_naming_the_assumption_and_the_error() -> None:
    class StandIn:  # the attribute exists but is no longer a collection
        _currently_processing = None

    with pytest.raises(SeamError, match=r"`_currently_processing` is an empty sized collection.*TypeError"):
        generator_seams.check_generator(StandIn())


def test_a_generator_that_no_longer_counts_prompt_tokens_fails_naming_it() -> None:
    class StandIn:
        _currently_processing = _unprocessed_sequences = _generation_batch = ()

        def insert_segments(
            self, segments: object, max_tokens: object, caches: object, all_tokens: object, samplers: object
        ) -> None: ...
        def remove(self, uids: object, return_prompt_caches: bool = False) -> None: ...
        def extract_cache(self, uids: object) -> None: ...

    with pytest.raises(SeamError, match=r"`_counters.prompt_tokens` counts prefilled tokens"):
        generator_seams.check_generator(StandIn())


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        ({"model_type": "gemma2", "num_attention_heads": 4, "num_key_value_heads": 2}, True),
        ({"model_type": "gemma2", "num_attention_heads": 4, "num_key_value_heads": 4}, False),
        ({"model_type": "gpt_bigcode", "num_attention_heads": 4, "num_key_value_heads": 1}, True),
        ({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}, False),
    ],
)
def test_families_mlx_lm_cannot_batch_are_refused_with_the_reason(
    config: dict[str, object], refused: bool
) -> None:
    class StandIn:  # only what the check reads: mlx-lm's models keep their config as `args`
        args = SimpleNamespace(**config)

    if refused:
        with pytest.raises(UnsupportedModelError, match=f"{config['model_type']} cannot decode in a batch"):
            checks.check_batchable(StandIn())
    else:
        checks.check_batchable(StandIn())


def test_a_decode_batch_that_renamed_its_state_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from semantic.engine.mlx_adapter import speculative_batch

    class Renamed(speculative_batch.GenerationBatch):  # keeps other state than 0.32.2's
        def __init__(self) -> None:
            self.uids = self.prompt_cache = self.tokens = self.samplers = []  # type: ignore[var-annotated]
            self.generated = []  # type: ignore[var-annotated]

    monkeypatch.setattr(speculative_batch, "GenerationBatch", Renamed)
    with pytest.raises(SeamError, match=r"GenerationBatch keeps `self.fallback_sampler`"):
        speculative_batch.check_speculative_batch()
