"""Requests that set no sampling get the model's own generation defaults (generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from semantic.engine.decoding.sampling import GenerationDefaults, SamplingParams, make_sampler
from semantic.engine.model.default_model import default_model_dir, ensure_default_model
from semantic.engine.model.loading import generation_defaults_of


def write_config(tmp_path: Path, config: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_model_config_sets_the_defaults(tmp_path: Path) -> None:
    model_dir = write_config(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2})
    assert generation_defaults_of(model_dir) == GenerationDefaults(0.6, 0.95, 20)


def test_do_sample_false_means_greedy_and_missing_keys_stay_neutral(tmp_path: Path) -> None:
    assert (
        generation_defaults_of(write_config(tmp_path, {"do_sample": False, "temperature": 0.7})).temperature
        == 0
    )
    assert generation_defaults_of(write_config(tmp_path, {"eos_token_id": 2})) == GenerationDefaults()
    assert generation_defaults_of(tmp_path / "missing") == GenerationDefaults()
    assert generation_defaults_of(write_config(tmp_path, {"temperature": "hot"})) == GenerationDefaults()


def test_the_default_model_is_greedy_unless_its_config_says_otherwise(tmp_path: Path) -> None:
    assert generation_defaults_of(tmp_path, is_default=True) == GenerationDefaults(0.0, 1.0, 0)
    edited = write_config(tmp_path, {"temperature": 0.5})
    assert generation_defaults_of(edited, is_default=True) == GenerationDefaults(0.5, 1.0, 0)
    assert generation_defaults_of(write_config(tmp_path, [1, 2]), is_default=True) == GenerationDefaults()  # type: ignore[arg-type]


def test_a_default_model_converted_by_an_older_version_gets_todays_sampling(tmp_path: Path) -> None:
    model_dir = default_model_dir("float32", tmp_path)
    model_dir.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_text("{}")
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    write_config(model_dir, {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9})
    assert ensure_default_model("float32", models_dir=tmp_path) == model_dir
    refreshed = json.loads((model_dir / "generation_config.json").read_text())
    assert refreshed == {"eos_token_id": 2, "do_sample": False}
    assert generation_defaults_of(model_dir) == GenerationDefaults(0.0, 1.0, 0)
    write_config(model_dir, {"eos_token_id": 2, "temperature": 0.7})  # edited by hand: left alone
    ensure_default_model("float32", models_dir=tmp_path)
    assert generation_defaults_of(model_dir).temperature == 0.7


def test_the_request_and_the_server_win_over_the_model() -> None:
    model = GenerationDefaults(0.2, 0.9, 40)
    assert SamplingParams(temperature=None, top_p=None, top_k=None).with_defaults(model) == SamplingParams(
        temperature=0.2, top_p=0.9, top_k=40
    )
    assert SamplingParams(temperature=0.0, top_p=None, top_k=None).with_defaults(model).temperature == 0.0
    with pytest.raises(AssertionError, match="caller bug"):
        make_sampler(SamplingParams(temperature=None), vocab_size=100)
