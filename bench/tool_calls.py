"""Sampled tool-calling turns, guidance off and on: how many calls come back well-formed and valid.

The tool test model (`scripts/make_tool_model.py`) answers recorded Claude Code sub-agent turns
(`tests/data/claude_code_sessions.json`), each with a new file path, at temperatures 1.0 and 0.7,
through the real server and the Anthropic SDK, `--concurrency` turns at once. The turn's tools are
Read (its schema given a required enum and closed to other keys) and three more with nested schemas
(an array of edits, a list of to-dos with an enum status, a search with nested options). A reply
counts as a tool-calling turn where it holds a `tool_use` block or call text left as prose; each
call is well-formed (a declared tool, input valid by `jsonschema`) or a schema violation, and text
holding a call's markers or JSON is a call leaked as text. A violation in a reply cut by
`max_tokens` is counted apart as well (the budget cut the call, not the grammar). The same turns
run on a server with `--tool-calls free` and one with guided calls (the default). The server's
batch size is sampled from /metrics while the turns run, and each finished request's log line
gives its drafts kept / proposed (n-gram speculation is on by default on the CPU). Writes
bench/results/tool_calls.json after each (mode, temperature), so a stopped run keeps what it did.

`--formats` adds the formats whose arguments are not one JSON object (qwen3_coder, glm47,
minimax_m2, pythonic). Their models are the ones tests/test_guided_tool_calls.py serves: the
default model with the family's chat template (tests/tool_call_samples.py), which copies the calls
its prompt shows. Each turn is three earlier exchanges answered with a call in the family's syntax
(Read twice, Grep with nested options once), then a new ask: read a new path, or, one turn in
three, search one. The tools are the same four; leaked text is text holding the family's markers.
Those go to bench/results/tool_calls_xml.json (`--xml-output`), one entry per format; `--resume`
keeps the (format, mode) pairs that file holds and runs the rest.

    python -m semantic.launch python -m bench.tool_calls [--turns 200] [--max-tokens 64]
        [--concurrency 16] [--modes free,guided] [--temperatures 1.0,0.7]
        [--formats hermes,qwen3_coder,glm47,minimax_m2,pythonic] [--xml-max-tokens 96]
        [--free-turns N] [--resume]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema

from bench.common import RESULTS, ROOT, write_results
from semantic.engine.model.default_model import ensure_default_model
from tests.server_process import ServerProcess
from tests.tool_call_samples import tokenizer_for

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
XML_FORMATS = ("qwen3_coder", "glm47", "minimax_m2", "pythonic")
# Each family's call tags (and pieces a broken call leaves): text holding one is a call leaked as text.
XML_MARKERS = {
    "qwen3_coder": ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>"),
    "glm47": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>", "<invoke", "<parameter name="),
    "pythonic": (
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        "[Read(",
        "[Grep(",
        "[MultiEdit(",
        "[TodoWrite(",
    ),
}
# The earlier exchanges each XML turn shows: an ask, and the call that answered it.
EXAMPLES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "Read /tmp/demo/alpha.txt and report the secret word.",
        "Read",
        {"file_path": "/tmp/demo/alpha.txt", "encoding": "utf-8"},
    ),
    (
        "Search /tmp/demo/src for TODO, two lines around each.",
        "Grep",
        {
            "pattern": "TODO",
            "path": "/tmp/demo/src",
            "options": {"context_lines": 2, "output_mode": "content"},
        },
    ),
    (
        "Read /tmp/demo/beta.txt and report the secret word.",
        "Read",
        {"file_path": "/tmp/demo/beta.txt", "encoding": "latin-1"},
    ),
]


def tool_model_dir() -> Path:
    """The tool test model, built once per adapter beside the default model (`just tool-model`)."""
    built = ensure_default_model().parent / make_tool_model.TOOL_MODEL_NAME
    if not make_tool_model.is_fused_from(built, make_tool_model.ADAPTER):
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_tool_model.py"), "--out", str(built)], check=True
        )
    return built


def turn_requests(num_turns: int) -> list[dict[str, Any]]:
    recorded = [s["request"] for s in json.loads(SESSIONS.read_text()) if len(s["request"]["tools"]) == 1]
    return [turn_request(recorded, index) for index in range(num_turns)]


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


def template_model(key: str, dest: Path) -> Path:
    """The default model with `key`'s chat template (tests/test_guided_tool_calls.py's route)."""
    source = ensure_default_model()
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            (dest / path.name).symlink_to(path)
        elif path.is_file():
            shutil.copy(path, dest / path.name)
    folder = Path(tokenizer_for(key).name_or_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(folder / name, dest / name)
    return dest


def _str_or_json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def render(key: str, name: str, arguments: dict[str, Any]) -> str:
    """A call as `key`'s chat template writes it (tests/tool_call_samples.py's fragments)."""
    if key == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{_str_or_json(v)}\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if key == "glm47":
        pairs = "".join(
            f"<arg_key>{k}</arg_key><arg_value>{_str_or_json(v)}</arg_value>" for k, v in arguments.items()
        )
        return f"<tool_call>{name}{pairs}</tool_call>"
    if key == "minimax_m2":
        params = "".join(
            f'<parameter name="{k}">{_str_or_json(v)}</parameter>\n' for k, v in arguments.items()
        )
        return f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>'
    assert key == "pythonic"
    keywords = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())
    return f"<|tool_call_start|>[{name}({keywords})]<|tool_call_end|>"


def xml_turn_requests(key: str, num_turns: int) -> list[dict[str, Any]]:
    """Three earlier exchanges answered with `key`'s calls, then a new ask (a read, or a search)."""
    head: list[dict[str, Any]] = []
    for ask, name, arguments in EXAMPLES:
        head += [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": render(key, name, arguments)},
        ]
    tools = turn_requests(1)[0]["tools"]
    requests = []
    for index in range(num_turns):
        if index % 3 == 2:
            ask = f"Search /tmp/bench-{index}/src for FIXME, {index % 5} lines around each."
        else:
            ask = f"Read /tmp/bench-{index}/notes-{index % 7}.txt and report the secret word."
        requests.append({"messages": [*head, {"role": "user", "content": ask}], "tools": tools})
    return requests


def judge(reply: Any, tools: list[dict[str, Any]], markers: tuple[str, ...] = LEAK_MARKERS) -> dict[str, Any]:
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
        elif block.type == "text" and any(marker in block.text for marker in markers):
            leaked += 1
            problems.append(f"text: {block.text[:120]!r}")
    return {
        "stop_reason": reply.stop_reason,
        "num_output_tokens": reply.usage.output_tokens,
        "well_formed": well_formed,
        "violations": violations,
        "leaked": leaked,
        "problems": problems,
        # The whole reply where something broke: the exact failing reply, to read, not a summary.
        "reply": [block.model_dump(exclude_none=True) for block in reply.content] if problems else None,
    }


def first_of_each_kind(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kinds: dict[tuple[str, ...], dict[str, Any]] = {}
    for turn in turns:
        kinds.setdefault(tuple(turn["problems"]), turn)
    return list(kinds.values())


class BatchSampler:
    """Polls the server's `semantic_batch_size` gauge while turns run: proof they decode together."""

    def __init__(self, base_url: str, period_s: float = 0.5) -> None:
        self._url = f"{base_url}/metrics"
        self._period_s = period_s
        self._stop = threading.Event()
        self.samples: list[int] = []
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> BatchSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(self._period_s):
            with urllib.request.urlopen(self._url, timeout=10) as reply:
                text = reply.read().decode()
            found = re.search(r"^semantic_batch_size (\S+)$", text, re.MULTILINE)
            if found:
                self.samples.append(int(float(found.group(1))))


def run_turns(
    server: ServerProcess,
    requests: list[dict[str, Any]],
    temperature: float,
    args: Any,
    max_tokens: int | None = None,
    markers: tuple[str, ...] = LEAK_MARKERS,
) -> dict[str, Any]:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=1800)

    def one(request: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = client.messages.create(
                model="default",
                max_tokens=max_tokens or args.max_tokens,
                extra_body={"temperature": temperature},
                **request,
            )
        except anthropic.APIError as error:  # counted apart: one failed request ends no run
            failed = {"stop_reason": "error", "num_output_tokens": 0, "well_formed": 0, "violations": 0}
            return failed | {"leaked": 0, "problems": [f"request failed: {str(error)[:200]}"], "error": True}
        return judge(reply, request["tools"], markers)

    started = time.perf_counter()
    with BatchSampler(server.base_url) as batch, ThreadPoolExecutor(args.concurrency) as pool:
        turns = list(pool.map(one, requests))
    calling = [t for t in turns if t["well_formed"] or t["violations"] or t["leaked"]]
    broken = [t for t in calling if t["violations"] or t["leaked"]]
    for turn in turns:
        turn.setdefault("reply", None)
    busy = [n for n in batch.samples if n > 0]
    return {
        "temperature": temperature,
        "num_turns": len(turns),
        "num_failed_requests": sum(bool(t.get("error")) for t in turns),
        "num_tool_calling_turns": len(calling),
        "num_well_formed_calls": sum(t["well_formed"] for t in turns),
        "num_schema_violations": sum(t["violations"] for t in turns),
        "num_calls_leaked_as_text": sum(t["leaked"] for t in turns),
        "num_broken_turns": len(broken),
        "num_broken_turns_cut_by_max_tokens": sum(t["stop_reason"] == "max_tokens" for t in broken),
        "num_cut_by_max_tokens": sum(t["stop_reason"] == "max_tokens" for t in turns),
        "output_tokens_max": max(t["num_output_tokens"] for t in turns),
        "output_tokens_mean": round(sum(t["num_output_tokens"] for t in turns) / len(turns), 1),
        "seconds": round(time.perf_counter() - started, 1),
        "batch_size_mean": round(sum(busy) / len(busy), 1) if busy else 0,
        "batch_size_max": max(busy, default=0),
        # Each kind of problem with its count, and one whole reply of each kind (the commonest can
        # be every free call: a required field the model was never taught).
        "problems": dict(collections.Counter(p for t in turns for p in t["problems"]).most_common(20)),
        "broken_replies": [
            {"stop_reason": t["stop_reason"], "content": t["reply"]} for t in first_of_each_kind(broken)
        ][:10],
    }


DRAFTS = re.compile(r"POST /v1/messages 200 .* generated=(\d+) drafts=(\d+)/(\d+) ")


def drafting(log: str) -> dict[str, Any]:
    """Drafts kept / proposed over the finished requests' log lines, and a few of those lines."""
    lines = [line for line in log.splitlines() if DRAFTS.search(line)]
    counts = [tuple(int(n) for n in DRAFTS.search(line).groups()) for line in lines]  # type: ignore[union-attr]
    return {
        "num_requests": len(counts),
        "num_requests_drafting": sum(proposed > 0 for _, _, proposed in counts),
        "drafts_kept": sum(kept for _, kept, _ in counts),
        "drafts_proposed": sum(proposed for _, _, proposed in counts),
        "tokens_generated": sum(generated for generated, _, _ in counts),
        "log_excerpt": [
            line[line.index("POST") :]
            for line, (_, _, proposed) in zip(lines, counts, strict=True)
            if proposed
        ][:3],
        "broken_call_warnings": [line for line in log.splitlines() if "tool call in the" in line][:10],
    }


def run_hermes(args: Any) -> None:
    built = tool_model_dir()
    requests = turn_requests(args.turns)
    results: dict[str, Any] = {
        "model": built.name,
        "tools": [tool["name"] for tool in requests[0]["tools"]],
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
    }
    for mode in args.modes.split(","):
        results[mode] = []
        with tempfile.TemporaryDirectory() as cache_dir:
            server = ServerProcess(Path(cache_dir), "--model", str(built), "--tool-calls", mode).start()
            try:
                for temperature in (float(t) for t in args.temperatures.split(",")):
                    results[mode].append(run_turns(server, requests, temperature, args))
                    write_results(args.output, results)
            finally:
                server.stop()
                results[f"{mode}_drafting"] = drafting(server.log())
        write_results(args.output, results)


def run_xml(args: Any, keys: list[str]) -> None:
    """Each XML format in turn, its modes one after the other: one entry per format in
    `args.xml_output`, written after each (format, mode, temperature). With `--resume` the (format,
    mode) pairs that file already holds are kept and not run again."""
    path = RESULTS / f"{args.xml_output}.json"
    kept = json.loads(path.read_text())["formats"] if args.resume and path.exists() else {}
    results: dict[str, Any] = {
        "model": f"{ensure_default_model().name} with each family's chat template",
        "tools": [tool["name"] for tool in turn_requests(1)[0]["tools"]],
        "max_tokens": args.xml_max_tokens,
        "concurrency": args.concurrency,
        "formats": kept
        | {key: kept.get(key, {"example_call": render(key, EXAMPLES[0][1], EXAMPLES[0][2])}) for key in keys},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for key in keys:
            model = template_model(key, Path(scratch) / f"model-{key}")
            entry = results["formats"][key]
            for mode in args.modes.split(","):
                if entry.get(mode):
                    continue
                num_turns = args.free_turns if mode == "free" and args.free_turns else args.turns
                requests = xml_turn_requests(key, num_turns)
                entry[mode] = []
                server = ServerProcess(
                    Path(scratch) / f"{mode}-{key}",
                    *("--model", str(model), "--tool-calls", mode),
                    *("--request-timeout-s", str(args.request_timeout_s)),
                ).start()
                try:
                    for temperature in (float(t) for t in args.temperatures.split(",")):
                        row = run_turns(
                            server, requests, temperature, args, args.xml_max_tokens, XML_MARKERS[key]
                        )
                        entry[mode].append(row)
                        results["totals"] = totals(results["formats"])
                        write_results(args.xml_output, results)
                finally:
                    server.stop()
                    entry[f"{mode}_drafting"] = drafting(server.log())
    write_results(args.xml_output, results)


def totals(formats: dict[str, Any]) -> dict[str, Any]:
    """Per mode and temperature, the sums over the formats measured so far."""
    keys: tuple[str, ...] = ("num_turns", "num_tool_calling_turns", "num_well_formed_calls")
    keys += (
        "num_schema_violations",
        "num_calls_leaked_as_text",
        "num_broken_turns",
        "num_broken_turns_cut_by_max_tokens",
    )
    sums: dict[str, Any] = {}
    for entry in formats.values():
        for mode in ("free", "guided"):
            for row in entry.get(mode, []):
                into = sums.setdefault(mode, {}).setdefault(str(row["temperature"]), dict.fromkeys(keys, 0))
                for k in keys:
                    into[k] += row[k]
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=200, help="turns per temperature and mode (and format)")
    parser.add_argument("--max-tokens", type=int, default=64, help="a guided Read call takes about 50")
    parser.add_argument("--concurrency", type=int, default=16, help="the server's default batch size")
    parser.add_argument("--modes", default="free,guided")
    parser.add_argument("--temperatures", default=",".join(str(t) for t in TEMPERATURES))
    parser.add_argument("--output", default="tool_calls", help="results file name, without .json")
    parser.add_argument("--formats", default="hermes", help=f"hermes and any of {','.join(XML_FORMATS)}")
    parser.add_argument("--xml-max-tokens", type=int, default=96, help="the XML formats' calls are longer")
    parser.add_argument("--free-turns", type=int, default=0, help="the XML formats' free turns (--turns)")
    parser.add_argument(
        "--request-timeout-s", type=int, default=3600, help="XML servers: 16 turns on 2 busy cores"
    )
    parser.add_argument("--resume", action="store_true", help="keep the XML results file's finished modes")
    parser.add_argument("--xml-output", default="tool_calls_xml", help="the XML formats' results file")
    args = parser.parse_args()
    keys = args.formats.split(",")
    unknown = set(keys) - {"hermes", *XML_FORMATS}
    if unknown:
        parser.error(f"unknown formats: {sorted(unknown)}")
    if "hermes" in keys:
        run_hermes(args)
    if xml := [key for key in keys if key != "hermes"]:
        run_xml(args, xml)


if __name__ == "__main__":
    main()
