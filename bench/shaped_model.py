"""Write a random-weight model of a model directory's shape, for speed benchmarks.

`python -m bench.shaped_model SOURCE DEST` reads SOURCE's `config.json` and tokenizer and writes
DEST with the same architecture and random weights (float32, as the default model is converted).
Speed depends on the shape, not on the values, so where the real weights cannot be carried (a lent
GPU machine takes 64 MiB per call and reaches no hub) the benchmarks run on this copy instead.
Replies are not meaningful, and greedy replies of a random model rarely end early, so each runs to
its token limit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.tiny_models import write_random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a model directory: config.json and the tokenizer")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = json.loads((args.source / "config.json").read_text())
    write_random_model(config, args.dest, args.source, args.seed)
    print(f"wrote {args.dest}")


if __name__ == "__main__":
    main()
