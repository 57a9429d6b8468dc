"""Real chat templates of the target families (issue 79): where an agent's next prompt parts from its
cached history, and how much of it is reused, in memory and after a restart.

Each family's published template (tests/data/chat_templates/, sources in its README.md) is installed
as the chat template of that family's tiny random-weight model (tests/arch_configs.py), and a client
drives a short agent conversation through the real server's `/v1/chat/completions`, sending the
whole history each turn as Claude Code does: a forced tool call (turn 1), its tool result (turn 2,
from memory), then, after a restart, a follow-up question (turn 3, from the agent's file). Assistant
messages go back as the client received them, `reasoning_content` included.

The tiny models keep SmolLM2's tokenizer, so a template's special tokens (`<|start|>`,
`<start_of_turn>`, `<|im_start|>`...) are plain text to it and its random replies mean nothing. That
is enough here: the test is about where the next prompt parts from what was cached and how much is
reused (the `x-semantic-cache` header), not about the replies, which tests/conformance.py checks
token for token.

`REAL_TEMPLATES_OUT=bench/results/real_templates.json` writes what each family did, for
`scripts/template_table.py` (the table in docs/models.md); `-m ''` runs every family, the slow ones
too.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx_lm
import msgspec
import pytest

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.protocols.openai_wire import ChatMessage, to_chat_messages
from tests.agent_api_client import _loaded
from tests.arch_configs import ARCHITECTURES
from tests.conformance_models import build_model, save_model_dir
from tests.server_process import ServerProcess
from tests.test_sliding_resume import logged_reuse

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
BLOCK = 16
MAX_TOKENS = 12
OUT_ENV = "REAL_TEMPLATES_OUT"
AGENT = "agent"
# family: (architecture in tests/arch_configs.py, template file)
FAMILIES = {
    "gpt-oss (harmony)": ("gpt_oss", "gpt_oss.jinja"),
    "Gemma 3": ("gemma3_text", "gemma3.jinja"),
    "Qwen3": ("qwen3", "qwen3.jinja"),
    "Qwen3-Coder": ("qwen3_moe", "qwen3_coder.jinja"),
    "Qwen3.5": ("qwen3_5", "qwen3_5.jinja"),
    "Qwen3-Next (Qwen3's template)": ("qwen3_next", "qwen3.jinja"),
    "Nemotron-H (Nemotron Nano 2)": ("nemotron_h", "nemotron_h.jinja"),
    "LFM2": ("lfm2", "lfm2.jinja"),
    "GLM-4.6": ("glm4_moe", "glm4_moe.jinja"),
    "Llama 3.1": ("llama", "llama3.jinja"),
}
# The default suite's families: each way a template rewrites the history (harmony drops the analysis
# channel, Gemma trims, Qwen3 drops thinking, Qwen3-Coder's XML calls, Llama 3.1's JSON calls); the
# rest run with the slow tests (`just test-slow`).
DEFAULT_SUITE_FAMILIES = {"gpt-oss (harmony)", "Gemma 3", "Qwen3", "Qwen3-Coder", "Llama 3.1"}
SYSTEM = "You are a coding agent. Read files with the tools you are given, then answer briefly. " * 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "the file's path"}},
                "required": ["path"],
            },
        },
    }
]


@dataclass
class Turn:
    """One chat-API turn as the client saw it."""

    tier: str  # memory | disk: where the agent's history was when the turn came
    prompt_tokens: int  # the server's count: the rendered messages and any forced call's opening
    prompt_end: int  # where the reply begins: the server's count less a forced call's opening
    rendered: str  # the messages as the template renders them
    completion_tokens: int
    cache: dict[str, str]  # the x-semantic-cache header's fields
    reasoning: bool = False  # the reply carried reasoning_content
    tool_calls: int = 0

    @property
    def reused(self) -> int:
        return int(self.cache["reused"].split("/")[0])

    @property
    def history(self) -> int:
        return int(self.cache["reused"].split("/")[1])

    @property
    def parted(self) -> int | None:
        return int(self.cache["parted"]) if "parted" in self.cache else None


@dataclass
class FamilyRun:
    family: str
    architecture: str
    template: str
    error: str = ""  # why the conversation could not run (the template would not render, ...)
    turns: list[dict[str, Any]] = field(default_factory=list)


RUNS: list[FamilyRun] = []


@pytest.fixture(scope="module", autouse=True)
def write_runs() -> Iterator[None]:
    started = time.monotonic()
    yield
    out = os.environ.get(OUT_ENV)
    if out and RUNS:
        report = {
            "mlx_lm_version": mlx_lm.__version__,
            "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "wall_s": round(time.monotonic() - started, 1),
            "max_tokens": MAX_TOKENS,
            "block_size": BLOCK,
            "runs": [asdict(run) for run in RUNS],
        }
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


def model_with_template(architecture: str, template: str, default_model_dir: Path, dest: Path) -> Path:
    """The architecture's tiny model with SmolLM2's tokenizer and the family's chat template."""
    model, config = build_model(ARCHITECTURES[architecture])
    model_dir = save_model_dir(model, config, dest, default_model_dir)
    (model_dir / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)  # the .jinja file is the one template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model_dir


def chat(server: ServerProcess, agent: str, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """One turn: the x-semantic-cache header's fields, and the reply's body."""
    body = {"model": "default", "temperature": 0, "max_tokens": MAX_TOKENS, **body}
    headers = {"content-type": "application/json", "x-agent-id": agent}
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions", json.dumps(body).encode(), headers
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        header, payload = reply.headers["x-semantic-cache"], json.loads(reply.read())
    return dict(field.split("=", 1) for field in header.split("; ")), payload


def turn(
    server: ServerProcess, chat_format: ChatFormat, tier: str, messages: list[dict[str, Any]], **extra: Any
) -> tuple[Turn, dict[str, Any]]:
    """One turn of the conversation; returns it and the assistant message to send back."""
    # As the server renders them: the wire's messages in the template's form (arguments decoded).
    wire = msgspec.convert(messages, list[ChatMessage])
    rendered = chat_format.render(to_chat_messages(wire), TOOLS)
    cache, payload = chat(server, AGENT, {"messages": messages, "tools": TOOLS, **extra})
    message = payload["choices"][0]["message"]
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    for key in ("reasoning_content", "tool_calls"):
        if message.get(key):
            reply[key] = message[key]
    recorded = Turn(
        tier,
        payload["usage"]["prompt_tokens"],
        payload["usage"]["prompt_tokens"] - forced_tokens(chat_format, rendered, extra),
        rendered,
        payload["usage"]["completion_tokens"],
        cache,
        reasoning=bool(message.get("reasoning_content")),
        tool_calls=len(message.get("tool_calls") or []),
    )
    return recorded, reply


def forced_tokens(chat_format: ChatFormat, rendered: str, extra: dict[str, Any]) -> int:
    """The tokens of a forced tool call's opening, which the server counts as prompt."""
    if "tool_choice" not in extra:
        return 0
    opening = chat_format.forced_call_prefix(extra["tool_choice"]["function"]["name"])
    return len(chat_format.encode(rendered + opening, None)) - len(chat_format.encode(rendered, None))


def keeps_prefix(previous: Turn, current: Turn) -> bool:
    """Whether the prompt parts from the history at or after the previous prompt's end (less the one
    token a re-rendered reply may tokenize with what precedes it)."""
    return current.parted is None or current.parted >= previous.prompt_end - 1


def expected_floor(previous: Turn, current: Turn) -> int:
    """The least a turn must reuse: the previous prompt but its last block where the template keeps
    it, else something (the history is cached)."""
    return max(1, previous.prompt_end - BLOCK) if keeps_prefix(previous, current) else 1


def rewrite(previous: Turn, current: Turn) -> str:
    """What the template rewrote of the history the previous turn left: nothing, the reply (from
    which of its tokens), or the previous prompt's own tail (the text it had, and has now)."""
    end, parted = previous.prompt_end, current.parted
    if parted is None or parted >= current.history:
        return "nothing"
    left = previous.prompt_tokens + previous.completion_tokens
    if abs(current.history - left) > 1:  # one: a reply's end-of-turn token may or may not be kept
        return f"none seen: the cached history is {current.history} tokens, not the {left} that turn left"
    if parted >= end - 1:
        return f"reply: kept {max(0, parted - end)} of {current.history - end} tokens"
    at = len(os.path.commonprefix([previous.rendered, current.rendered]))  # noqa: RUF071 (text, not paths)
    was, now = previous.rendered[at:], current.rendered[at : at + len(previous.rendered) - at + 24]
    return f"prompt's tail (token {parted} of {end}): {was!r} -> {now!r}"


# LFM2's turn 2 parts at the end of turn 1's generation prompt, past a forced call's opening; it
# reuses only the shared head: the point kept at the generation prompt's start is not resumed there
# (issue 79: not yet understood, see the session's report).
def family_params() -> list[Any]:
    reason = "issue 79: LFM2 resumes at the shared head, not at its generation prompt's start"
    params = []
    for name in FAMILIES:
        marks = [] if name in DEFAULT_SUITE_FAMILIES else [pytest.mark.slow]
        if name == "LFM2":
            marks.append(pytest.mark.xfail(reason=reason))
        params.append(pytest.param(name, marks=marks))
    return params


@pytest.mark.parametrize("family", family_params())
def test_a_real_template_conversation_resumes_where_its_prompt_parts(
    family: str, default_model_dir: Path, tmp_path: Path
) -> None:
    architecture, template = FAMILIES[family]
    run = FamilyRun(family, architecture, template)
    RUNS.append(run)
    model_dir = model_with_template(architecture, template, default_model_dir, tmp_path / "model")
    args = ("--model", str(model_dir), "--block-size", str(BLOCK), "--cache-budget-mb", "64")
    cache_dir = tmp_path / "cache"
    chat_format = ChatFormat(_loaded(model_dir)[1])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What does notes.txt say? Read it."},
    ]
    forced = {"tool_choice": {"type": "function", "function": {"name": "read_file"}}}
    turns: list[Turn] = []
    server = ServerProcess(cache_dir, *args).start()
    try:
        try:
            first, reply = turn(server, chat_format, "memory", messages, **forced)
        except urllib.error.HTTPError as error:
            run.error = f"{error.code}: {json.loads(error.read()).get('error', {}).get('message', '')}"
            pytest.skip(f"{family}: the server refused the conversation: {run.error}")
        turns.append(first)
        messages.append(reply)
        for index, call in enumerate(reply.get("tool_calls", [])):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"line {index}: alpha"})
        if not reply.get("tool_calls"):
            messages.append({"role": "user", "content": "notes.txt says: alpha"})
        second, reply = turn(server, chat_format, "memory", messages)
        turns.append(second)
        messages += [reply, {"role": "user", "content": "Thanks. In one line, what did you learn?"}]
    finally:
        server.stop()
    restarted = ServerProcess(cache_dir, *args, port=server.port).start()
    try:
        third, _ = turn(restarted, chat_format, "disk", messages)
        turns.append(third)
    finally:
        restarted.stop()
    run.turns = [summary(None, turns[0])] + [summary(p, t) for p, t in itertools.pairwise(turns)]
    logged = [reused for reused, _ in logged_reuse(restarted, AGENT)]  # both servers' lines, one file
    assert logged == [t.reused for t in turns], (family, logged, [t.cache for t in turns])
    assert turns[0].reused == 0, turns[0].cache
    for previous, current in itertools.pairwise(turns):
        assert current.reused >= expected_floor(previous, current), (family, current.tier, current.cache)


def summary(previous: Turn | None, current: Turn) -> dict[str, Any]:
    shown = {k: v for k, v in asdict(current).items() if k != "rendered"}
    shown |= {"reused": current.reused, "history": current.history, "parted": current.parted}
    if previous is not None:
        shown |= {"rewrite": rewrite(previous, current), "keeps_prefix": keeps_prefix(previous, current)}
    return shown
