"""Tool calls guided by their tools' schemas once opened (issue 80): the real tool test model behind
a real server, called with the official `anthropic` SDK and checked with `jsonschema`. A call the
model chooses to write is held to the declared names and schemas; `--tool-calls free` leaves it as
before; a call the reply opened in the client's prefill and cut by max_tokens is still a call."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest

from semantic.engine.tool_format import detect_tool_format
from semantic.protocols.tool_parser import TextPart, ToolCallEnd, ToolCallParser
from tests.server_process import ServerProcess
from tests.tool_call_samples import TOOLS, tokenizer_for

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import make_tool_model

SESSIONS = Path(__file__).parent / "data" / "claude_code_sessions.json"
NUM_TURNS = 6
# The model learned Read({"file_path"}); the schema also requires a field it never writes unguided.
ENCODING = {"enum": ["utf-8", "latin-1"], "description": "The file's text encoding"}


@pytest.fixture(scope="module")
def tool_model_dir(default_model_dir: Path) -> Path:
    built = default_model_dir.parent / make_tool_model.TOOL_MODEL_NAME
    if not make_tool_model.is_fused_from(built, make_tool_model.ADAPTER):
        script = Path(__file__).parents[1] / "scripts" / "make_tool_model.py"
        subprocess.run([sys.executable, str(script), "--out", str(built)], check=True, timeout=600)
    return built


def _server(tmp: Path, model: Path, *args: str) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp, "--model", str(model), "--cache-budget-mb", "256", *args).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def guided(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory.mktemp("guided"), tool_model_dir)


@pytest.fixture(scope="module")
def free(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _server(tmp_path_factory.mktemp("free"), tool_model_dir, "--tool-calls", "free")


def read_request(index: int) -> dict[str, Any]:
    """A recorded Claude Code sub-agent turn that the model answers with a Read call, its path made
    new and Read's schema given a required enum and no other keys."""
    recorded = [s["request"] for s in json.loads(SESSIONS.read_text()) if len(s["request"]["tools"]) == 1]
    request = copy.deepcopy(recorded[0])  # one head for all: only the new path is prefilled per turn
    (read,) = request["tools"]
    schema = read["input_schema"]
    # Right after the path: llguidance keeps the schema's order, so a guided call is no longer.
    path, *rest = schema["properties"].items()
    schema["properties"] = dict([path, ("encoding", ENCODING), *rest])
    schema["required"] = [*schema.get("required", []), "encoding"]
    schema["additionalProperties"] = False
    blocks = request["messages"][-1]["content"]
    blocks[-1]["text"] = f"Read /tmp/guided-{index}/notes.txt and report the secret word."
    return {key: request[key] for key in ("messages", "system", "tools")}


def ask(server: ServerProcess, request: dict[str, Any], temperature: float, max_tokens: int = 60) -> Any:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    return client.messages.create(
        model="default", max_tokens=max_tokens, extra_body={"temperature": temperature}, **request
    )


def calls_and_leaks(reply: Any, tools: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """The reply's well-formed calls, and what is wrong with it: a call to an undeclared tool, one
    whose input breaks its schema, call text left as prose."""
    schemas = {tool["name"]: tool["input_schema"] for tool in tools}
    wrong, num_calls = [], 0
    for block in reply.content:
        if block.type == "tool_use":
            num_calls += 1
            if block.name not in schemas:
                wrong.append(f"undeclared tool {block.name}")
                continue
            try:
                jsonschema.validate(block.input, schemas[block.name])
            except jsonschema.ValidationError as error:
                wrong.append(f"{block.name} {block.input}: {error.message}")
        elif block.type == "text" and ("<tool_call>" in block.text or '"arguments"' in block.text):
            wrong.append(f"call as text: {block.text!r}")
    return num_calls, wrong


def test_sampled_calls_follow_their_tools_schemas(guided: ServerProcess) -> None:
    requests = [read_request(index) for index in range(NUM_TURNS)]
    with ThreadPoolExecutor(NUM_TURNS) as pool:
        replies = list(pool.map(lambda request: ask(guided, request, temperature=1.0), requests))
    num_calls = 0
    for reply, request in zip(replies, requests, strict=True):
        found, wrong = calls_and_leaks(reply, request["tools"])
        if reply.stop_reason == "max_tokens":  # a call cut off says so; its input may be short
            assert not [w for w in wrong if w.startswith("call as text")], (wrong, reply.content)
            continue
        assert not wrong, (wrong, reply.content)
        assert reply.stop_reason == ("tool_use" if found else "end_turn"), reply
        num_calls += found
    assert num_calls >= NUM_TURNS // 2, [reply.content for reply in replies]  # the model does call


def test_free_tool_calls_are_decoded_as_before(guided: ServerProcess, free: ServerProcess) -> None:
    """Greedy: the free server's call is the model's own (it leaves out the enum it never learned);
    the guided one's is the same call, completed to its schema."""
    request = read_request(0)
    unguided = ask(free, request, temperature=0.0)
    (call,) = [block for block in unguided.content if block.type == "tool_use"]
    assert call.name == "Read" and "encoding" not in call.input, unguided.content
    held = ask(guided, request, temperature=0.0)
    (guided_call,) = [block for block in held.content if block.type == "tool_use"]
    assert guided_call.input["file_path"] == call.input["file_path"]
    jsonschema.validate(guided_call.input, request["tools"][0]["input_schema"])


def test_a_call_opened_in_the_prefill_and_cut_by_max_tokens_says_max_tokens(guided: ServerProcess) -> None:
    request = read_request(1)
    opened = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/tmp/'
    request["messages"] = [*request["messages"], {"role": "assistant", "content": opened}]
    reply = ask(guided, request, temperature=0.0, max_tokens=3)
    assert reply.stop_reason == "max_tokens", reply
    assert not [b for b in reply.content if b.type == "text" and b.text.strip()], reply.content
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "Read" and call.input["file_path"].startswith("/tmp/"), call


def test_a_qwen3_coder_call_without_its_tool_call_opener_is_read_as_a_call() -> None:
    """Qwen3-Coder's known failure: `<function=...>` written without `<tool_call>` around it."""
    tool_format = detect_tool_format(tokenizer_for("qwen3_coder"))
    parser = ToolCallParser(tool_format, TOOLS)
    reply = "Let me check. <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\nDone."
    parts = [part for piece in reply.split("\n") for part in parser.feed(piece + "\n")] + parser.finish()
    calls = [(part.name, part.arguments) for part in parts if isinstance(part, ToolCallEnd)]
    assert calls == [("get_weather", {"city": "Paris"})], parts
    text = "".join(part.text for part in parts if isinstance(part, TextPart))
    assert "<function=" not in text and text.split() == ["Let", "me", "check.", "Done."], text
