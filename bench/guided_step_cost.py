"""What a guided row in free text costs a decode step, without the server around it.

mlx-lm's `BatchGenerator` steps 8 rows of the fast tiny model (bench/step_overhead.py's 2-layer
llama), four ways, alternating: no logits processors; an identity processor on every row (what
mlx-lm's per-row path costs once any row has a processor); a lazy tool-call grammar on every row
(`GrammarMatcher` waiting for its trigger, as a guided turn does while it writes text: it reads the
previous token and watches for the call's opening) called by mlx-lm's per-row path
(`grammar-per-row`); and the same grammars in semantic's decode batch, which masks every row in one
op (`grammar`, `engine/mlx_adapter/guided_batch.py`). Per step: wall-clock and process CPU time, the
medians over the repetitions. Where wall time grows more than CPU time, the step waited.
Writes bench/results/guided_step_cost.json.

    python -m semantic.launch .venv/bin/python -m bench.guided_step_cost [--steps 300] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mlx_lm.generate import BatchGenerator

from bench.common import write_results
from bench.step_overhead import FAST_LLAMA
from semantic.engine.decoding.grammar_matcher import GrammarCompiler
from semantic.engine.mlx_adapter.api import load
from semantic.engine.mlx_adapter.guided_batch import guided
from semantic.engine.model.default_model import ensure_default_model
from tests.tiny_models import write_random_model

ROWS = 8
WARM_STEPS = 10
MODES = ("none", "identity", "grammar-per-row", "grammar")
# A call's opening the random model never writes: each guided row stays in free text.
GRAMMAR = '%llguidance {}\nstart: "<tool_call>" /[a-z]+/ "</tool_call>"\n'
TRIGGER = "<tool_call>"


def step_costs(
    model: Any, tokenizer: Any, compiler: GrammarCompiler, mode: str, steps: int
) -> dict[str, float]:
    prompts = [tokenizer.encode(f"Tell me about topic number {i}, in detail please.") for i in range(ROWS)]
    processors: list[list[Any]] | None = None
    if mode == "identity":
        processors = [[lambda tokens, logits: logits] for _ in prompts]
    elif mode.startswith("grammar"):
        processors = [[compiler.matcher(GRAMMAR, TRIGGER)] for _ in prompts]
    generator = BatchGenerator(model, stop_tokens=set(), max_tokens=steps + 2 * WARM_STEPS)
    if mode == "grammar":
        generator = guided(generator)
    generator.insert(prompts, max_tokens=[steps + 2 * WARM_STEPS] * ROWS, logits_processors=processors)
    for _ in range(WARM_STEPS):
        generator.next()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        generator.next()
    cpu_ms = (time.process_time() - cpu) / steps * 1e3
    wall_ms = (time.perf_counter() - wall) / steps * 1e3
    generator.close()
    return {"wall_ms_per_step": round(wall_ms, 3), "cpu_ms_per_step": round(cpu_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="semantic-guided-step-") as tmp:
        model_dir = write_random_model(
            dict(FAST_LLAMA), Path(tmp) / "fast-llama", ensure_default_model("float32")
        )
        model, tokenizer = load(str(model_dir))[:2]
        compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
        samples = []
        for rep in range(args.reps):
            for mode in MODES:
                sample = {
                    "rep": rep,
                    "mode": mode,
                    **step_costs(model, tokenizer, compiler, mode, args.steps),
                }
                print(sample, flush=True)
                samples.append(sample)

    def median(mode: str, key: str) -> float:
        return round(statistics.median(s[key] for s in samples if s["mode"] == mode), 3)

    medians = {
        mode: {key: median(mode, key) for key in ("wall_ms_per_step", "cpu_ms_per_step")} for mode in MODES
    }
    none = medians["none"]["wall_ms_per_step"]
    results = {
        "model": {**FAST_LLAMA, "weights": "random"},
        "rows": ROWS,
        "steps": args.steps,
        "median": medians,
        "wall_over_none": {mode: round(medians[mode]["wall_ms_per_step"] / none, 3) for mode in MODES},
        "samples": samples,
    }
    write_results("guided_step_cost", results)


if __name__ == "__main__":
    main()
