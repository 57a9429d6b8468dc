"""An assistant message's reasoning reaches the chat template (issue 79): OpenAI's `reasoning_content`
and Anthropic's `thinking` blocks, sent back as the client received them, render into the prompt where
the template re-renders reasoning, so the prompt is the one the model generated from.

The default model's tokenizer with Qwen3.5's published template (tests/data/chat_templates/), which
renders an assistant's `reasoning_content` after the last user query, as in an agent's tool loop. The
oracle is the template itself, applied to hand-written messages.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.server_process import ServerProcess

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen3_5.jinja"
REASONING = "The user wants notes.txt; reading it with read_file answers the question directly."
QUESTION = "What does notes.txt say? Read it."
RESULT = "Remember the milk."
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file of the project", "parameters": SCHEMA},
    }
]


@pytest.fixture(scope="module")
def model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with Qwen3.5's chat template in place of its own."""
    dest = tmp_path_factory.mktemp("qwen3_5-template")
    for source in default_model_dir.iterdir():
        if source.suffix == ".safetensors":
            (dest / source.name).symlink_to(source)
        else:
            shutil.copy(source, dest / source.name)
    (dest / "chat_template.jinja").write_text(TEMPLATE.read_text())
    tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)  # the .jinja file is the one template
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return dest


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("cache"), "--model", str(model_dir)).start()
    yield process
    process.stop()


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"content-type": "application/json", "x-agent-id": "reasoning-history"}
    request = urllib.request.Request(server.base_url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=300) as reply:
        result: dict[str, Any] = json.loads(reply.read())
    return result


def oracle_tokens(model_dir: Path, reasoning: str | None) -> int:
    """The prompt's tokens as the template renders the conversation by itself."""
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": {"path": "notes.txt"}},
            }
        ],
    }
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    messages = [
        {"role": "user", "content": QUESTION},
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, tools=[*TOOLS], tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    assert (REASONING in text) == (reasoning is not None), "the template must render reasoning here"
    return len(tokenizer.encode(text, add_special_tokens=False))


def openai_messages(reasoning: str | None) -> list[dict[str, Any]]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'},
    }
    assistant: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [
        {"role": "user", "content": QUESTION},
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]


def anthropic_messages(reasoning: str | None) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [
        {"type": "tool_use", "id": "call_1", "name": "read_file", "input": {"path": "notes.txt"}}
    ]
    if reasoning is not None:
        blocks.insert(0, {"type": "thinking", "thinking": reasoning, "signature": "c2ln"})
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": RESULT}]},
    ]


def openai_prompt_tokens(server: ServerProcess, reasoning: str | None) -> int:
    body = {"messages": openai_messages(reasoning), "tools": TOOLS, "max_tokens": 1, "temperature": 0}
    return int(post(server, "/v1/chat/completions", body)["usage"]["prompt_tokens"])


def anthropic_input_tokens(server: ServerProcess, reasoning: str | None) -> int:
    tools = [{"name": "read_file", "description": "Read a file of the project", "input_schema": SCHEMA}]
    body = {"model": "claude-local", "messages": anthropic_messages(reasoning), "tools": tools}
    return int(post(server, "/v1/messages/count_tokens", body)["input_tokens"])


def test_openai_reasoning_content_renders_into_the_prompt(server: ServerProcess, model_dir: Path) -> None:
    without, with_reasoning = openai_prompt_tokens(server, None), openai_prompt_tokens(server, REASONING)
    assert with_reasoning > without
    assert with_reasoning - without == oracle_tokens(model_dir, REASONING) - oracle_tokens(model_dir, None)


def test_anthropic_thinking_block_renders_into_the_prompt(server: ServerProcess, model_dir: Path) -> None:
    without, with_reasoning = anthropic_input_tokens(server, None), anthropic_input_tokens(server, REASONING)
    assert with_reasoning > without
    assert with_reasoning - without == oracle_tokens(model_dir, REASONING) - oracle_tokens(model_dir, None)
    # Redacted thinking is encrypted text the model never wrote: it stays out of the prompt.
    redacted = anthropic_messages(None)
    redacted[1]["content"].insert(0, {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"})
    body = {"model": "claude-local", "messages": redacted}
    plain = {"model": "claude-local", "messages": anthropic_messages(None)}
    counted = post(server, "/v1/messages/count_tokens", body)["input_tokens"]
    assert counted == post(server, "/v1/messages/count_tokens", plain)["input_tokens"]


def test_reasoning_content_renders_without_tools(server: ServerProcess) -> None:
    """No tools: the template still gets the reasoning (tool calls then render Hermes-style)."""
    body = {"messages": openai_messages(REASONING), "max_tokens": 1, "temperature": 0}
    plain = {"messages": openai_messages(None), "max_tokens": 1, "temperature": 0}
    with_reasoning = post(server, "/v1/chat/completions", body)["usage"]["prompt_tokens"]
    assert with_reasoning > post(server, "/v1/chat/completions", plain)["usage"]["prompt_tokens"]
