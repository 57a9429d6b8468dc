"""Sampled tool-calling turns, guidance off and on: how many calls come back well-formed and valid.

The tool test model (`scripts/make_tool_model.py`) answers recorded Claude Code sub-agent turns
(`tests/data/claude_code_sessions.json`), each with a new file path, at temperatures 1.0 and 0.7,
through the real server and the Anthropic SDK, `--concurrency` turns at once. The turn's tools are
Read (its schema given a required enum and closed to other keys) and three more with nested schemas
(an array of edits, a list of to-dos with an enum status, a search with nested options). A reply
counts as a tool-calling turn where it holds a `tool_use` block or call text left as prose; each
call is well-formed (a declared tool, input valid by `jsonschema`) or a schema violation, and text
holding a call's markers or JSON is a call leaked as text. The same turns run on a server with
`--tool-calls free` and one with guided calls (the default). Writes bench/results/tool_calls.json.

    python -m semantic.launch python -m bench.tool_calls [--turns 100] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema

from bench.common import ROOT, write_results
from semantic.engine.default_model import ensure_default_model
from tests.server_process import ServerProcess

sys.path.insert(0, str(ROOT / "scripts"))
import make_tool_model

SESSIONS = ROOT / "tests" / "data" / "claude_code_sessions.json"
TEMPERATURES = (1.0, 0.7)
EDIT = {
    "name": "MultiEdit",
    "description": "Makes several edits to one file.",
    "input_schema": {
        "type": "object",
        "properties": {
            "file_path": {"type": "string"},
            "edits": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "old_string": {"type": "string"},
                        "new_string": {"type": "string"},
                        "replace_all": {"type": "boolean"},
                    },
                    "required": ["old_string", "new_string"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["file_path", "edits"],
        "additionalProperties": False,
    },
}
TODOS = {
    "name": "TodoWrite",
    "description": "Writes the task list.",
    "input_schema": {
        "type": "object",
        "properties": {
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": {"type": "string"},
                        "status": {"enum": ["pending", "in_progress", "completed"]},
                        "id": {"type": "string"},
                    },
                    "required": ["content", "status", "id"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["todos"],
        "additionalProperties": False,
    },
}
GREP = {
    "name": "Grep",
    "description": "Searches file contents with a regular expression.",
    "input_schema": {
        "type": "object",
        "properties": {
            "pattern": {"type": "string"},
            "path": {"type": "string"},
            "options": {
                "type": "object",
                "properties": {
                    "case_insensitive": {"type": "boolean"},
                    "context_lines": {"type": "integer", "minimum": 0, "maximum": 20},
                    "output_mode": {"enum": ["content", "files_with_matches", "count"]},
                },
                "additionalProperties": False,
            },
        },
        "required": ["pattern"],
        "additionalProperties": False,
    },
}
ENCODING = {"enum": ["utf-8", "latin-1"], "description": "The file's text encoding"}
LEAK_MARKERS = ("<tool_call>", "</tool_call>", '"arguments"', '{"name"')


def turn_request(recorded: list[dict[str, Any]], index: int) -> dict[str, Any]:
    request = copy.deepcopy(recorded[0])  # one head for all: only the new path is prefilled per turn
    (read,) = request["tools"]
    schema = read["input_schema"]
    # Right after the path: llguidance keeps the schema's order, so a guided call is no longer.
    path, *rest = schema["properties"].items()
    schema["properties"] = dict([path, ("encoding", ENCODING), *rest])
    schema["required"] = [*schema.get("required", []), "encoding"]
    schema["additionalProperties"] = False
    request["tools"] = [read, EDIT, TODOS, GREP]
    blocks = request["messages"][-1]["content"]
    blocks[-1]["text"] = f"Read /tmp/bench-{index}/notes-{index % 7}.txt and report the secret word."
    return {key: request[key] for key in ("messages", "system", "tools")}


def judge(reply: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    schemas = {tool["name"]: tool["input_schema"] for tool in tools}
    well_formed = violations = leaked = 0
    problems = []
    for block in reply.content:
        if block.type == "tool_use":
            try:
                if block.name not in schemas:
                    raise jsonschema.ValidationError(f"undeclared tool {block.name!r}")
                jsonschema.validate(block.input, schemas[block.name])
                well_formed += 1
            except jsonschema.ValidationError as error:
                violations += 1
                problems.append(f"{block.name}: {error.message}")
        elif block.type == "text" and any(marker in block.text for marker in LEAK_MARKERS):
            leaked += 1
            problems.append(f"text: {block.text[:120]!r}")
    return {
        "stop_reason": reply.stop_reason,
        "well_formed": well_formed,
        "violations": violations,
        "leaked": leaked,
        "problems": problems,
    }


def run_turns(
    server: ServerProcess, requests: list[dict[str, Any]], temperature: float, args: Any
) -> dict[str, Any]:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)

    def one(request: dict[str, Any]) -> dict[str, Any]:
        reply = client.messages.create(
            model="default", max_tokens=args.max_tokens, extra_body={"temperature": temperature}, **request
        )
        return judge(reply, request["tools"])

    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        turns = list(pool.map(one, requests))
    calling = [t for t in turns if t["well_formed"] or t["violations"] or t["leaked"]]
    return {
        "temperature": temperature,
        "num_turns": len(turns),
        "num_tool_calling_turns": len(calling),
        "num_well_formed_calls": sum(t["well_formed"] for t in turns),
        "num_schema_violations": sum(t["violations"] for t in turns),
        "num_calls_leaked_as_text": sum(t["leaked"] for t in turns),
        "num_cut_by_max_tokens": sum(t["stop_reason"] == "max_tokens" for t in turns),
        "num_broken_turns": sum(1 for t in calling if t["violations"] or t["leaked"]),
        "seconds": round(time.perf_counter() - started, 1),
        "problems": [p for t in turns for p in t["problems"]][:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=100, help="turns per temperature and mode")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    built = ensure_default_model().parent / make_tool_model.TOOL_MODEL_NAME
    if not make_tool_model.is_fused_from(built, make_tool_model.ADAPTER):
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_tool_model.py"), "--out", str(built)], check=True
        )
    recorded = [s["request"] for s in json.loads(SESSIONS.read_text()) if len(s["request"]["tools"]) == 1]
    requests = [turn_request(recorded, index) for index in range(args.turns)]
    results: dict[str, Any] = {
        "model": built.name,
        "tools": [tool["name"] for tool in requests[0]["tools"]],
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
    }
    for mode in ("free", "guided"):
        with tempfile.TemporaryDirectory() as cache_dir:
            server = ServerProcess(Path(cache_dir), "--model", str(built), "--tool-calls", mode).start()
            try:
                results[mode] = [run_turns(server, requests, t, args) for t in TEMPERATURES]
            finally:
                server.stop()
    write_results("tool_calls", results)


if __name__ == "__main__":
    main()
