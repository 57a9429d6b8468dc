"""Claude Code's Read round trip against the tool test model, sampled at temperature 0.7, run after run.

tests/test_claude_code.py's sub-agent session, repeated: the real CLI (`just claude-code`) asks the
main agent to have the `reader` sub-agent read a file; the main agent calls `Agent`, the sub-agent
calls `Read` (Claude Code runs it and sends back the file), reports the secret word, and the main
agent answers. The server runs the tool model with `--temperature 0.7` (Claude Code sends no
temperature, so every request samples at 0.7) and its default guided tool calls. Each run has its
own working directory, session and secret word (none of them a word the model was trained on), so
a run passes only where the answer holds a word it could read nowhere but in the file. Each run's
outcome, its answer, and the tool calls its transcripts hold (`Agent`, `Read`) go to
bench/results/claude_code_read.json; a run that fails also keeps its transcripts' steps (each
message's calls, results and text, cut short) and the server's warnings while it ran, to say why.

    python -m semantic.launch .venv/bin/python -m bench.claude_code_read [--runs 20]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_results
from bench.tool_calls import tool_model_dir
from semantic.engine.model.default_model import user_cache_dir
from tests.server_process import ServerProcess

sys.path.insert(0, str(ROOT / "scripts"))
from claude_code_recorder import SESSION_FLAGS, claude_env

TEMPERATURE = "0.7"
# Not among scripts/make_tool_model.py's WORDS: the answer must come from the file.
SECRETS = [
    "quince",
    "fennel",
    "mango",
    "papaya",
    "nutmeg",
    "garnet",
    "lilac",
    "otter",
    "maple",
    "cedar",
    "hazel",
    "bramble",
    "cactus",
    "indigo",
    "jasper",
    "kelp",
    "larch",
    "mosaic",
    "nimbus",
    "poplar",
]
RUN_TIMEOUT_S = 1500  # a bound for a hung CLI, as in tests/test_claude_code.py


def tool_uses(config_dir: Path) -> dict[str, int]:
    """The tool calls in the run's transcripts (the main session's and the sub-agent's), by name."""
    names: collections.Counter[str] = collections.Counter()
    for transcript in config_dir.rglob("*.jsonl"):
        for line in transcript.read_text().splitlines():
            entry = json.loads(line)
            content = (entry.get("message") or {}).get("content")
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict) and block.get("type") in ("tool_use", "tool_result"):
                    names[block.get("name") or "tool_result"] += 1
    return dict(names)


def steps(config_dir: Path) -> list[str]:
    """The run's transcripts, one line a block (the sub-agent's after the main session's): what failed."""
    lines = []
    for transcript in sorted(config_dir.rglob("*.jsonl"), key=lambda path: len(path.parts)):
        agent = "sub-agent" if "subagents" in transcript.parts else "main"
        for line in transcript.read_text().splitlines():
            message = json.loads(line).get("message") or {}
            content = message.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
            for block in blocks:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "tool_use":
                    said = f"{block.get('name')} {json.dumps(block.get('input'))}"
                elif kind == "tool_result":
                    said = json.dumps(block.get("content"))
                elif kind == "text":
                    said = repr(block.get("text"))
                else:
                    continue
                lines.append(f"{agent} {message.get('role')} {kind}: {said[:240]}")
    return lines


def run_once(claude: str, server: ServerProcess, workdir: Path, secret: str) -> dict[str, Any]:
    notes = workdir / "notes.txt"
    notes.write_text(f"The secret word is {secret}.\n")
    ask = f"Use the reader agent to read {notes} and tell me the secret word."
    command = [
        claude,
        "-p",
        "--output-format",
        "json",
        *SESSION_FLAGS,
        "--session-id",
        str(uuid.uuid4()),
        ask,
    ]
    log_start = len(server.log())
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=workdir, env=claude_env(server.base_url, workdir), capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        outcome: dict[str, Any] = {
            "secret": secret,
            "passed": False,
            "failure": f"no answer in {RUN_TIMEOUT_S} s",
        }
        return outcome | evidence(server, workdir, log_start)
    seconds = round(time.perf_counter() - started, 1)
    outcome = {
        "secret": secret,
        "seconds": seconds,
        "tool_uses": tool_uses(workdir / ".claude"),
    }
    try:
        result = json.loads(done.stdout)
    except ValueError:
        outcome |= {
            "passed": False,
            "failure": f"exit {done.returncode}: {(done.stderr + done.stdout)[-500:]}",
        }
        return outcome | evidence(server, workdir, log_start)
    answer = str(result.get("result", ""))
    passed = done.returncode == 0 and result.get("is_error") is False and secret in answer
    outcome |= {"passed": passed, "answer": answer[:300], "num_turns": result.get("num_turns")}
    if not passed:
        outcome["failure"] = "is_error" if result.get("is_error") else "the answer lacks the secret word"
        outcome |= evidence(server, workdir, log_start)
    return outcome


def evidence(server: ServerProcess, workdir: Path, log_start: int) -> dict[str, Any]:
    """A failed run's transcript steps and the server's warnings and errors while it ran."""
    log = server.log()[log_start:].splitlines()
    return {
        "steps": steps(workdir / ".claude"),
        "server_warnings": [line[:400] for line in log if " WARNING " in line or " ERROR " in line][:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    claude = user_cache_dir() / "claude-code" / "node_modules" / ".bin" / "claude"
    if not claude.exists():
        raise SystemExit(f"Claude Code is not installed at {claude} (just claude-code)")
    version = subprocess.run([str(claude), "--version"], capture_output=True, text=True).stdout.strip()
    model = tool_model_dir()
    runs = []
    with tempfile.TemporaryDirectory(prefix="semantic-claude-read-") as tmp:
        scratch = Path(tmp)
        server = ServerProcess(
            scratch / "server", "--model", str(model), "--temperature", TEMPERATURE
        ).start()
        try:
            for index in range(args.runs):
                workdir = scratch / f"run-{index}"
                workdir.mkdir()
                outcome = run_once(str(claude), server, workdir, SECRETS[index % len(SECRETS)])
                print(f"run {index}: {outcome}", flush=True)
                runs.append(outcome)
        finally:
            server.stop()
    write_results(
        "claude_code_read",
        {
            "claude_code": version,
            "model": model.name,
            "temperature": float(TEMPERATURE),
            "num_runs": len(runs),
            "num_passed": sum(run["passed"] for run in runs),
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
