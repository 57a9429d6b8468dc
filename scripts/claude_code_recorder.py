"""Record the requests the real Claude Code CLI sends in a sub-agent round trip, answered by a script.

A small Anthropic-shaped server plays the model: asked by the main agent, it calls the `Agent` tool
to send a sub-agent to read a file; asked by the sub-agent, it calls `Read`; given the file, it
reports the secret word; given the sub-agent's report, it answers the user; asked anything else, it
says "Done.". Claude Code runs the tools itself, so every request it sends (system prompt, tool
schemas, the sub-agent's own context, tool results as Claude Code writes them) is the real thing.
Each recorded request comes back with the reply the script gave: the training pairs of a model that
calls tools the way Claude Code expects (`scripts/make_tool_model.py`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

READER_AGENT = {
    "reader": {
        "description": "Reads one file and reports what it says",
        "prompt": "You read the file you are given with the Read tool and report what it says.",
        "tools": ["Read"],
    }
}
# The flags a tool-calling session runs with, here and in tests/test_claude_code.py.
SESSION_FLAGS = [
    "--system-prompt",
    "You are a coding agent. Use a tool when the user asks for one.",
    "--agents",
    json.dumps(READER_AGENT),
    "--tools=Read,Agent",
    "--allowedTools=Read,Agent",
]
_PATH = re.compile(r"(/[\w./-]+\.txt)")
_SECRET = re.compile(r"secret word is (\w+)")


@dataclass
class Recorded:
    request: dict[str, Any]
    reply: list[dict[str, Any]]  # Anthropic content blocks


@dataclass
class ScriptedModel:
    """Answers each request from what it asks, and keeps every (request, reply) pair."""

    recorded: list[Recorded] = field(default_factory=list)

    def reply_to(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        tools = {tool["name"] for tool in request.get("tools", [])}
        last = next(message for message in reversed(request["messages"]) if message["role"] == "user")
        blocks = last["content"] if isinstance(last["content"], list) else []
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        text = _text(last["content"])
        if results:
            said = _text(results[-1].get("content"))
            secret = _SECRET.search(said)
            word = secret.group(1) if secret else "not there"
            return [{"type": "text", "text": f"The secret word is {word}."}]
        path = _PATH.search(text)
        if path is None:
            return [{"type": "text", "text": "Done."}]
        if "Agent" in tools:
            prompt = f"Read {path.group(1)} and report the secret word."
            arguments = {"description": "Read the notes file", "prompt": prompt, "subagent_type": "reader"}
            return [_call("Agent", arguments)]
        return [_call("Read", {"file_path": path.group(1)})]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST" or not request.path.startswith("/v1/messages"):
            return web.json_response({})
        body = await request.json()
        if request.path.endswith("/count_tokens"):
            return web.json_response({"input_tokens": len(json.dumps(body)) // 4})
        reply = self.reply_to(body)
        self.recorded.append(Recorded(body, reply))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event, data in _events(body.get("model", "scripted"), reply):
            await response.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        await response.write_eof()
        return response


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block.get("text", "") for block in content or [] if isinstance(block, dict))


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": arguments}


def _events(model: str, reply: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model}
    usage = {"input_tokens": 1, "output_tokens": 1}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": {**message, "content": [], "usage": usage}})
    ]
    for index, block in enumerate(reply):
        start: dict[str, Any]
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]
    stop = "tool_use" if reply[-1]["type"] == "tool_use" else "end_turn"
    events += [
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": usage}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


def claude_env(base_url: str, workdir: Path, max_output: int = 256) -> dict[str, str]:
    """Claude Code pointed at `base_url`, its sessions and settings kept under `workdir`."""
    return {
        **os.environ,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "local",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CONFIG_DIR": str(workdir / ".claude"),
    }


async def record(claude: str, sessions: list[tuple[Path, str, str]]) -> list[Recorded]:
    """Run Claude Code once per (workdir, first prompt, follow-up prompt) against the scripted model."""
    model = ScriptedModel()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", model.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    parallel = asyncio.Semaphore(4)

    async def run_session(workdir: Path, prompt: str, follow_up: str) -> None:
        env = claude_env(f"http://127.0.0.1:{port}", workdir)
        session = str(uuid.uuid4())
        async with parallel:
            for args in (["--session-id", session, prompt], ["--resume", session, follow_up]):
                command = [claude, "-p", "--output-format", "json", *SESSION_FLAGS, *args]
                done = await asyncio.to_thread(
                    subprocess.run, command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300
                )
                if done.returncode != 0:
                    raise RuntimeError(f"claude failed: {done.stderr or done.stdout}")

    try:
        await asyncio.gather(*(run_session(*session) for session in sessions))
    finally:
        await runner.cleanup()
    return model.recorded
