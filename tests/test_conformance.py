"""The architecture conformance suite (tests/conformance.py): every architecture of tests/arch_configs.py
token for token against mlx-lm, and the suite's own ways to fail (a wrong reply, a collapsed one).

The default suite runs the families issue 64 names and their quantized variants; CONFORMANCE_ALL=1
runs every architecture (those must pass, or be refused at load with a reason).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.utils import load_tokenizer

from tests.arch_configs import ARCHITECTURES
from tests.conformance import REPO_ROOT, check_isolated
from tests.conformance_checks import (
    AGENT_TURNS,
    SYSTEM_PROMPT,
    EngineTurn,
    Observed,
    judge,
    reference_reply,
    run_engine_checks,
)
from tests.conformance_models import build_model, layer_kinds, save_model_dir

RUN_ALL = os.environ.get("CONFORMANCE_ALL") == "1"


def architectures() -> list[object]:
    only_with_all = pytest.mark.skipif(not RUN_ALL, reason="CONFORMANCE_ALL=1 runs every architecture")
    return [
        pytest.param(name, marks=() if spec.in_default_suite else only_with_all)
        for name, spec in ARCHITECTURES.items()
    ]


@pytest.mark.parametrize("name", architectures())
def test_architecture_matches_mlx_lm(name: str, default_model_dir: Path, tmp_path: Path) -> None:
    spec = ARCHITECTURES[name]
    result = check_isolated(spec, tmp_path, default_model_dir, timeout_s=500)  # under pytest-timeout's 600
    allowed = ("pass",) if spec.in_default_suite else ("pass", "refused")
    assert result.outcome in allowed, result.summary()


def test_a_model_that_answers_otherwise_fails_every_check(default_model_dir: Path, tmp_path: Path) -> None:
    """The engine serves one llama; mlx-lm is asked of another (its weights from another seed)."""
    served = ARCHITECTURES["llama"]
    model, config = build_model(served)
    model_dir = save_model_dir(model, config, tmp_path / "model", default_model_dir)
    other, _ = build_model(replace(served, seed=served.seed + 1))
    eos_token_ids = set(mlx_lm.load(str(model_dir))[1].eos_token_ids)
    observed = asyncio.run(run_engine_checks(model_dir, tmp_path / "cache", eos_token_ids))
    results = [judge(check, other, eos_token_ids) for check in observed]
    assert [(r.check, r.status) for r in results] == [
        (name, "fail") for name in ("cold", "resume", "restart", "share", "batch")
    ]
    assert all("differs from mlx-lm" in r.failure for r in results)
    assert all(r.num_distinct_reference_tokens >= 4 for r in results)  # they failed on the replies alone


def test_a_match_of_a_collapsed_reply_is_not_a_pass(default_model_dir: Path) -> None:
    """Tied embeddings scaled up: the greedy reply repeats one token, which any engine would match."""
    spec = ARCHITECTURES["qwen2"]
    collapsing = replace(spec, config={**spec.config, "tie_word_embeddings": True}, embed_scale=4.0)
    model, _ = build_model(collapsing)
    tokenizer = load_tokenizer(default_model_dir)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": AGENT_TURNS[0]}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    eos_token_ids = set(tokenizer.eos_token_ids)
    reply = reference_reply(model, prompt, eos_token_ids)
    observed = Observed("cold", [EngineTurn(prompt, reply, 0, "none", 1)], expected_cached="== 0")
    result = judge(observed, model, eos_token_ids)
    assert (result.status, result.num_distinct_reference_tokens) == ("collapsed", 1), result


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("gpt_oss-mxfp4-experts-8bit", ["full", "sliding 32", "sink", "MoE", "quantized"]),
        ("deepseek_v3", ["full", "MLA", "MoE"]),
        ("lfm2", ["full", "conv"]),
        ("qwen3_5", ["full", "conv", "recurrent"]),
        ("bailing_moe_linear", ["full", "recurrent", "MoE"]),
    ],
)
def test_layer_kinds_come_from_the_model(name: str, kinds: list[str]) -> None:
    assert layer_kinds(*build_model(ARCHITECTURES[name])) == kinds


def test_the_table_is_written_between_the_markers_only(tmp_path: Path) -> None:
    check = {"check": "cold", "status": "pass", "num_prompt_tokens": 169, "num_cached_tokens": 0}
    report = {
        "mlx_lm_version": "0.32.2",
        "device": "Device(cpu, 0)",
        "platform": "Linux x86_64, 2 cores",
        "wall_s": 12.0,
        "results": [
            {
                "name": "llama",
                "model_type": "llama",
                "outcome": "pass",
                "layer_kinds": ["full"],
                "checks": [check],
            },
            {
                "name": "mamba2",
                "model_type": "mamba2",
                "outcome": "refused",
                "reason": "no attention | layers",
            },
        ],
    }
    results, readme = tmp_path / "conformance.json", tmp_path / "README.md"
    results.write_text(json.dumps(report))
    markers = "<!-- conformance:begin -->\nstale table\n<!-- conformance:end -->"
    readme.write_text(f"# x\n\n## Architectures\n\n{markers}\n\n## Benchmarks\n")
    command = [sys.executable, "scripts/conformance_table.py", str(results), "--readme", str(readme)]
    for _ in range(2):  # a second run replaces the first's table
        subprocess.run(command, cwd=REPO_ROOT, check=True)
    text = readme.read_text()
    assert text.startswith("# x\n\n## Architectures\n\n<!-- conformance:begin -->\n")
    assert text.endswith("<!-- conformance:end -->\n\n## Benchmarks\n")
    assert "stale table" not in text and text.count("| `llama` |") == 1
    assert "| `llama` | full | **pass** 0/169 |  |  |  |  | **pass** |" in text
    assert "refused: no attention \\| layers |" in text
