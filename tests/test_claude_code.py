"""Claude Code itself against `semantic serve`: runs where the CLI is installed (`just claude-code`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from semantic.engine.default_model import user_cache_dir


def claude_cli() -> str | None:
    installed = user_cache_dir() / "claude-code" / "node_modules" / ".bin" / "claude"
    return str(installed) if installed.exists() else shutil.which("claude")


CLAUDE = claude_cli()
pytestmark = pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (just claude-code)")


def claude(server, workdir: Path, *args: str, check: bool = True, max_output: int = 256) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    assert CLAUDE is not None
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": server.base_url,
        "ANTHROPIC_API_KEY": "local",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CONFIG_DIR": str(
            workdir / ".claude"
        ),  # its sessions and settings stay in the test's directory
    }
    command = [CLAUDE, "-p", "--bare", "--output-format", "json", *args]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 or not check, done.stderr + done.stdout
    assert done.stdout.startswith("{"), done.stderr + done.stdout
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_claude_code_completes_turns_and_reuses_the_cache(
    server_factory, default_model_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--model", str(default_model_dir), "--temperature", "0").start()
    session = str(uuid.uuid4())
    first = claude(
        server,
        tmp_path,
        "--tools",
        "",
        "--session-id",
        session,
        "What is the capital of France? Answer in one sentence.",
    )
    assert first["is_error"] is False and first["type"] == "result"
    assert "Paris" in first["result"]
    assert first["usage"]["input_tokens"] > 0

    second = claude(
        server, tmp_path, "--tools", "", "--resume", session, "And of Germany? Answer in one sentence."
    )
    assert second["is_error"] is False and second["result"]
    assert second["usage"]["cache_read_input_tokens"] > 0

    # A turn with a tool available: Claude Code sends its tool schemas; the server renders them
    # through the chat template and answers (whether the 135M model calls the tool is up to it).
    (tmp_path / "notes.txt").write_text("The secret word is apricot.\n")
    third = claude(
        server, tmp_path, "--tools=Read", "--allowedTools=Read", "Read notes.txt", check=False, max_output=32
    )
    assert third["type"] == "result" and third["usage"]["input_tokens"] > 0
    assert "API Error: 4" not in third["result"] and "API Error: 5" not in third["result"]
