"""Tool calls guided by their tools' schemas once opened (issue 80): the real tool test model behind
a real server, called with the official `anthropic` SDK and checked with `jsonschema`. A call the
model chooses to write is held to the declared names and schemas; `--tool-calls free` leaves it as
before; a call the reply opened in the client's prefill and cut by max_tokens is still a call. The
same for the formats whose arguments are not one JSON object (Qwen3-Coder, GLM-4.7, MiniMax-M2,
pythonic), with the default model copying calls and random models sampling them, called with the
official `openai` SDK."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from semantic.actors.prompting.tool_format import detect_tool_format
from semantic.protocols.tool_parser import TextPart, ToolCallEnd, ToolCallParser
from tests.server_process import ServerProcess
from tests.tiny_models import TINY_CONFIGS, write_random_model
from tests.tool_call_samples import BY_KEY, TOOLS, tokenizer_for

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
    whose input breaks its schema, a call the model opened left as prose. Guidance starts at the
    format's opener: prose the model wrote without one (a `"arguments"` object inside `<tools>`,
    say) is its own text, counted by bench/tool_calls.py, not a call the server read."""
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
        elif block.type == "text" and ("<tool_call>" in block.text or "</tool_call>" in block.text):
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


# The formats whose arguments are not one JSON object (actors/prompting/tool_call_grammars.py), behind a real
# server: the default model, with a family's chat template, copies the calls it sees in its prompt
# (greedy); a random model, pushed towards a call's opening by a logit bias, writes the rest at
# temperature 1.0 under the grammar.

WEATHER_EXAMPLES = ("Oslo", "Rome", "Lima")
ANSWER_FOR = "Paris"
DAYS = {"type": "integer", "minimum": 1, "maximum": 7}
MAX_SAMPLED = 300


def template_model(source: Path, key: str, dest: Path) -> Path:
    """The model at `source` with `key`'s chat template (tests/tool_call_samples.py)."""
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


def weather_tool(properties: dict[str, Any], strict: bool) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    function = {"name": "get_weather", "description": "Weather for a city", "parameters": schema}
    return {"type": "function", "function": {**function, "strict": strict}}


def copied_call_messages(key: str, bare: bool = False) -> list[dict[str, Any]]:
    """Earlier turns answered with the family's call (Qwen3-Coder's `bare`: without <tool_call>)."""
    call = BY_KEY[key].call
    if bare:
        call = call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    messages: list[dict[str, Any]] = []
    for city in WEATHER_EXAMPLES:
        messages += [
            {"role": "user", "content": f"What is the weather in {city} for 3 days?"},
            {"role": "assistant", "content": call.replace("Paris", city)},
        ]
    return [*messages, {"role": "user", "content": f"What is the weather in {ANSWER_FOR} for 3 days?"}]


def completion(server: ServerProcess, messages: list[dict[str, Any]], **options: Any) -> Any:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="default", messages=messages, **options)


def chat(server: ServerProcess, messages: list[dict[str, Any]], **options: Any) -> Any:
    return completion(server, messages, **options).choices[0]


def reply_tokens(choice: Any) -> list[str]:
    return [token.token for token in choice.logprobs.content]  # the reply's tokens, as text


@pytest.fixture(scope="module")
def copying(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], ServerProcess]]:
    """The default model with a family's chat template behind a server, started when a test first
    asks for that family and shared by the module's tests of it (greedy, on prompts of their own:
    each leaves it as it found it)."""
    servers: dict[str, ServerProcess] = {}

    def server_for(key: str) -> ServerProcess:
        if key not in servers:
            model = template_model(default_model_dir, key, tmp_path_factory.mktemp(f"{key}-model"))
            servers[key] = ServerProcess(
                tmp_path_factory.mktemp(key), "--model", str(model), "--cache-budget-mb", "256"
            ).start()
        return servers[key]

    yield server_for
    for server in servers.values():
        server.stop()


# GLM-4.7 with the slow tests: the same checks as Qwen3-Coder's, through its own grammar, which
# tests/test_xml_tool_grammars.py and the random model's sampled calls below cover in the default suite.
@pytest.mark.parametrize("key", ["qwen3_coder", pytest.param("glm47", marks=pytest.mark.slow)])
def test_a_strict_tool_in_an_xml_format_is_enforced_and_changes_no_valid_call(
    key: str, copying: Callable[[str], ServerProcess]
) -> None:
    """A strict tool was a 400 in these formats. Greedy, the reply that already was a valid call
    (the reference: the same prompt, tool_choice none, no grammar) is token for token the same
    under the strict tool's grammar; one that was not is held to the schema."""
    server = copying(key)
    messages = copied_call_messages(key)
    options: dict[str, Any] = {"temperature": 0.0, "max_tokens": 72, "logprobs": True}
    exact = weather_tool({"city": {"type": "string"}, "days": {"type": "integer"}}, strict=True)
    free = chat(server, messages, tools=[exact], tool_choice="none", **options)
    assert free.message.content.startswith(BY_KEY[key].call.replace("Paris", ANSWER_FOR)[:12]), free.message
    held = chat(server, messages, tools=[exact], **options)
    assert held.finish_reason == "tool_calls", held.message
    assert "|".join(reply_tokens(held)) == "|".join(reply_tokens(free))
    (call,) = held.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": ANSWER_FOR, "days": 3}

    units = {"type": "string", "enum": ["metric", "imperial"]}
    stricter = weather_tool({"city": {"type": "string"}, "days": DAYS, "units": units}, strict=True)
    held = chat(server, messages, tools=[stricter], **options)
    (call,) = held.message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, stricter["function"]["parameters"])
    assert arguments["city"] == ANSWER_FOR and held.finish_reason == "tool_calls"


def test_a_qwen3_coder_call_without_its_opener_is_guided_and_comes_back_as_a_call(
    copying: Callable[[str], ServerProcess],
) -> None:
    """Qwen3-Coder's known failure (Ollama 16686, 18530): `<function=...>` written without the
    `<tool_call>` around it. The model copies such calls, which never name `days`; the guided
    grammar, triggered by the bare opening, completes the call to its schema."""
    server = copying("qwen3_coder")
    bare = copied_call_messages("qwen3_coder", bare=True)
    for message in bare[1::2]:
        message["content"] = message["content"].replace("<parameter=days>\n3\n</parameter>\n", "")
    tool = weather_tool({"city": {"type": "string"}, "days": DAYS}, strict=False)
    reference = chat(server, bare, tools=[tool], tool_choice="none", temperature=0.0, max_tokens=60)
    assert reference.message.content.startswith("<function=get_weather>"), reference.message
    assert "<parameter=days>" not in reference.message.content
    choice = chat(server, bare, tools=[tool], temperature=0.0, max_tokens=80)
    assert choice.finish_reason == "tool_calls", choice.message
    assert not choice.message.content or "<function=" not in choice.message.content
    (call,) = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert call.function.name == "get_weather" and arguments["city"] == ANSWER_FOR


# Each family's call tags as a random model's added tokens, special where its real models' are.
MARKERS = {
    "qwen3_coder": {"<tool_call>": False, "</tool_call>": False},
    "glm47": {
        t: True
        for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    },
    "minimax_m2": {"<minimax:tool_call>": True, "</minimax:tool_call>": True},
    "pythonic": {"<|tool_call_start|>": True, "<|tool_call_end|>": True},
}
BOUNDED = {
    "path": {"type": "string", "maxLength": 8},
    "mode": {"type": "string", "enum": ["read", "write"]},
    "count": {"type": ["integer", "null"]},
    "force": {"type": "boolean"},
    "range": {
        "type": "object",
        "properties": {
            "start": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"type": "string", "maxLength": 3},
        },
        "required": ["start"],
        "additionalProperties": False,
    },
}


def random_model_with_markers(key: str, dest: Path) -> Path:
    """A random tiny model with `key`'s chat template and call tags as tokens of their own."""
    folder = Path(tokenizer_for(key).name_or_path)
    base = json.loads((folder / "tokenizer.json").read_text())
    num_base = len(base["model"]["vocab"])
    markers = MARKERS[key]
    write_random_model(dict(TINY_CONFIGS["llama"], vocab_size=num_base + len(markers)), dest, folder)
    added = [
        {"id": num_base + i, "content": marker, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": special}
        for i, (marker, special) in enumerate(markers.items())
    ]
    base["added_tokens"] += added
    (dest / "tokenizer.json").write_text(json.dumps(base))
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.setdefault("added_tokens_decoder", {}).update(
        {str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added}
    )
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("key", ["qwen3_coder", "glm47", "minimax_m2", "pythonic"])
def test_a_random_models_sampled_calls_in_an_xml_format_are_valid_or_it_writes_text(
    key: str, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A random model at temperature 1.0, its call opening and its end of reply made likely (logit
    bias): each reply is text, or calls valid against their tools' schemas (guided), never a
    malformed call; a forced call is one too."""
    model = random_model_with_markers(key, tmp_path_factory.mktemp(f"{key}-random"))
    num_base = json.loads((model / "config.json").read_text())["vocab_size"] - len(MARKERS[key])
    opening = num_base  # the first marker opens a call
    tools = [
        {
            "type": "function",
            "function": {"name": "write_file", "parameters": _closed(BOUNDED, ["path", "count"])},
        },
        {
            "type": "function",
            "function": {"name": "tag_range", "parameters": _closed(BOUNDED, ["range"], ("force", "mode"))},
        },
    ]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    messages = [{"role": "user", "content": "Write the notes file."}]
    # As likely to open a call as to end: a reply is text, or as many calls as it chose to write.
    bias = {str(opening): 10.0, "2": 10.0}  # 2: <|im_end|>, the end of the reply
    options: dict[str, Any] = {
        "tools": tools,
        "temperature": 1.0,
        "max_tokens": MAX_SAMPLED,
        "logit_bias": bias,
    }
    for server in _server(tmp_path_factory.mktemp(f"{key}-sampled"), model):
        with ThreadPoolExecutor(NUM_TURNS) as pool:
            asked = [pool.submit(completion, server, messages, seed=seed, **options) for seed in range(8)]
            replies = [reply.result() for reply in asked]
        forced = completion(server, messages, tools=tools, temperature=1.0, tool_choice="required", seed=0)
        num_calls = 0
        for reply in [*replies, forced]:
            choice = reply.choices[0]
            is_cut = reply.usage.completion_tokens >= MAX_SAMPLED  # its last call may be unfinished
            if not is_cut:
                assert not any(marker in (choice.message.content or "") for marker in MARKERS[key]), choice
            ending = "tool_calls" if choice.message.tool_calls else "length" if is_cut else "stop"
            assert choice.finish_reason == ending, choice
            for call in choice.message.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                num_calls += 1
        assert forced.choices[0].message.tool_calls and num_calls > 1, replies


def _closed(properties: dict[str, Any], required: list[str], more: tuple[str, ...] = ()) -> dict[str, Any]:
    chosen = {name: properties[name] for name in (*required, *more)}
    return {"type": "object", "properties": chosen, "required": required, "additionalProperties": False}
