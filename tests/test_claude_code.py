"""Claude Code itself against `semantic serve`: runs where the CLI is installed (`just claude-code`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from semantic.engine.model.default_model import user_cache_dir

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import make_tool_model
from claude_code_recorder import SESSION_FLAGS, claude_env


def claude_cli() -> str | None:
    installed = user_cache_dir() / "claude-code" / "node_modules" / ".bin" / "claude"
    return str(installed) if installed.exists() else shutil.which("claude")


CLAUDE = claude_cli()
pytestmark = pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (just claude-code)")


def claude(  # type: ignore[no-untyped-def]
    server, workdir: Path, *args: str, check: bool = True, max_output: int = 256, bare: bool = True
) -> dict[str, Any]:
    assert CLAUDE is not None
    env = claude_env(server.base_url, workdir, max_output)
    command = [CLAUDE, "-p", *(["--bare"] if bare else []), "--output-format", "json", *args]
    # A bound for a hung CLI, not a speed: beside two CPU hogs on 2 cores one sub-agent session took
    # over 300 s.
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0 or not check, done.stderr + done.stdout
    assert done.stdout.startswith("{"), done.stderr + done.stdout
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_claude_code_completes_turns_and_reuses_the_cache(
    server_factory, default_model_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("--model", str(default_model_dir), "--temperature", "0").start()
    session = str(uuid.uuid4())
    # A system prompt of our own: the CLI's default one names the working directory, and the 135M
    # model's greedy answer depends on it. Probed on 20 dates, with a pytest-xdist path
    # (`.../popen-gw0/...`) it ran past 256 tokens 9 times; with this prompt, on 200 dates, never.
    # The date stays in the prompt (the CLI puts it in the first user message).
    plain = ["--tools", "", "--system-prompt", "You are a helpful assistant."]
    first = claude(
        server,
        tmp_path,
        *plain,
        "--session-id",
        session,
        "What is the capital of France? Answer in one sentence.",
    )
    assert first["is_error"] is False and first["type"] == "result"
    assert "Paris" in first["result"]
    assert first["usage"]["input_tokens"] > 0

    second = claude(server, tmp_path, *plain, "--resume", session, "And of Germany? Answer in one sentence.")
    assert second["is_error"] is False and second["result"]
    assert second["usage"]["cache_read_input_tokens"] > 0

    # A turn with a tool available and the CLI's own system prompt: Claude Code sends its tool
    # schemas; the server renders them through the chat template and answers (whether the 135M
    # model calls the tool is up to it).
    (tmp_path / "notes.txt").write_text("The secret word is apricot.\n")
    # Replies cut at 8 tokens: the CLI asks to go on after each cut (four requests in all), and any
    # longer only costs time on two CPU cores.
    third = claude(
        server, tmp_path, "--tools=Read", "--allowedTools=Read", "Read notes.txt", check=False, max_output=8
    )
    assert third["type"] == "result" and third["usage"]["input_tokens"] > 0
    assert "API Error: 4" not in third["result"] and "API Error: 5" not in third["result"]


@pytest.fixture(scope="session")
def tool_model_dir(default_model_dir: Path) -> Path:
    """The default model taught to call tools as Claude Code does: the committed adapter fused into
    it (`scripts/make_tool_model.py`), once per adapter, cached beside the default model like it."""
    built = default_model_dir.parent / make_tool_model.TOOL_MODEL_NAME
    if not make_tool_model.is_fused_from(built, make_tool_model.ADAPTER):
        script = Path(__file__).parents[1] / "scripts" / "make_tool_model.py"
        subprocess.run([sys.executable, str(script), "--out", str(built)], check=True, timeout=600)
    return built


# With the slow tests: the longest of the suite, two whole CLI sessions with a sub-agent; the test
# above runs the CLI against the server in the default suite.
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two CLI sessions: beside two CPU hogs one took over 300 s
def test_claude_code_sends_a_sub_agent_that_reads_a_file(
    server_factory, tool_model_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The real CLI, a model that calls tools: the main agent calls `Agent`, the `reader` sub-agent
    calls `Read` (Claude Code runs it), reports the file's secret word, and the main agent answers.
    The sub-agent is its own agent on the server, and the main conversation's next turn reuses its
    whole history."""
    server = server_factory("--model", str(tool_model_dir), "--temperature", "0").start()
    notes = tmp_path / "notes.txt"
    notes.write_text("The secret word is quince.\n")
    session = str(uuid.uuid4())
    ask = f"Use the reader agent to read {notes} and tell me the secret word."
    first = claude(server, tmp_path, *SESSION_FLAGS, "--session-id", session, ask, bare=False)
    assert first["is_error"] is False, first
    assert "quince" in first["result"], first
    assert first["num_turns"] >= 2, first  # the Agent call, then the answer

    with urllib.request.urlopen(server.base_url + "/v1/agents") as listing:
        agents = {agent["id"]: agent for agent in json.load(listing)["data"]}
    sub_agents = [name for name in agents if name.startswith(session + ".")]
    assert session in agents and sub_agents, agents  # the reader ran as its own agent
    history = agents[session]["cached_tokens"]

    second = claude(server, tmp_path, *SESSION_FLAGS, "--resume", session, "Thanks. Say done.", bare=False)
    assert second["is_error"] is False, second
    usage = second["usage"]

    assert usage["cache_read_input_tokens"] >= history - 8, (usage, history)  # the whole history
    assert usage["input_tokens"] <= 32, usage  # only the new user turn is prefilled
