"""The embedding example runs as users would run it, and shows cache reuse in memory and from disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_embed_example_streams_turns_and_resumes_after_a_restart(
    default_model_dir: Path, tmp_path: Path
) -> None:
    command = [
        sys.executable,
        "scripts/embed_example.py",
        "--model",
        str(default_model_dir),
        "--cache-dir",
        str(tmp_path),
        "--max-tokens",
        "12",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "> What is the capital of France?" and "Paris" in lines[1]
    first, second, third = json.loads(lines[-1])["turns"]
    assert first["cache_tier"] == "none" and first["cached_tokens"] == 0
    assert second["cache_tier"] == "memory"
    assert second["cached_tokens"] >= first["prompt_tokens"] + first["generated_tokens"] - 1
    assert third["cache_tier"] == "disk"
    assert third["cached_tokens"] >= second["prompt_tokens"] + second["generated_tokens"] - 1
