"""`engine/` is the engine thread: every function of its modules that runs while turns are served runs
on that thread, but for the few the other side calls by design, each listed with why.

Every call into a module under `engine/` is recorded with the thread it ran on (a profile hook on
all threads) while an in-process system serves the turns its users send: an agent's turn, its
return (its cache reused), a turn under a JSON schema (a grammar compiled and matched), a turn with
`cache_control` pins and a turn that calls a tool. A function that ran elsewhere and is not below is
code that belongs to the layer that runs it.
"""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from semantic.actors.system import AgentSystem, SystemConfig
from semantic.actors.turns import ToolChoice, TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.config import EngineConfig
from semantic.engine.loop.messages import Finished
from semantic.storage.agent_id import AgentId

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
ENGINE_THREAD = "semantic-engine"

# (module under engine/, function) -> why it runs off the engine thread.
CROSSINGS: dict[tuple[str, str], str] = {
    # Made by whoever configures and starts the engine, before its thread runs.
    ("loop/config.py", "__post_init__"): "an EngineConfig is made by whoever configures the engine",
    ("loop/backend_profile.py", "choose_profile"): "the profile is chosen as the EngineConfig is made",
    ("loop/backend_profile.py", "detect_device"): "the profile is chosen as the EngineConfig is made",
    ("loop/backend_profile.py", "current_device"): "the profile is chosen as the EngineConfig is made",
    ("loop/backend_profile.py", "variant"): "the profile is chosen as the EngineConfig is made",
    ("group/distributed.py", "launched_group"): "whether `mlx.launch` started a group, asked at start",
    ("loop/engine_loop.py", "__init__"): "the loop is built before its thread starts",
    ("loop/leader_loop.py", "__init__"): "the loop is built before its thread starts",
    ("loop/drains.py", "__init__"): "the loop's parts are built before its thread starts",
    ("loop/outbox.py", "__init__"): "the loop's parts are built before its thread starts",
    ("scheduling/scheduler.py", "__init__"): "the loop's parts are built before its thread starts",
    # The crossing itself: futures answered and events delivered on the event loop.
    ("loop/commands.py", "resolve"): "the loop's side of an ask's answer (call_soon_threadsafe)",
    ("loop/commands.py", "reject"): "the loop's side of an ask's failure (call_soon_threadsafe)",
    ("loop/commands.py", "reply_to"): "answers a future on the loop: the actors' mailboxes use it too",
    ("loop/outbox.py", "_deliver"): "the loop's side of a tick's events (call_soon_threadsafe)",
    ("loop/messages.py", "EventChannel"): "a request's event channel, filled and read on the loop",
    # Values made or read where they are used.
    ("decoding/sampling.py", "SamplingParams"): "a request's sampling, checked where it is made",
    ("decoding/sampling.py", "_within"): "a request's sampling, checked where it is made",
    ("model/loading.py", "LoadedModel"): "a loaded model's vocabulary and end tokens, read by the actors",
    ("model/default_model.py", "model_name_for"): "a model source's name, for the registry too",
    ("cache_store/cache_spec.py", "to_dict"): "a model's cache layout, written into its cache files",
    ("cache_store/cache_tensors.py", "tokens_digest"): "a cache file's token digest, checked by storage",
    ("cache_store/cache_matching.py", "common_prefix_length"): "two token lists' common prefix, for prompts",
    # Asked without a message: a dictionary lookup the actors make before a turn.
    ("loop/engine_loop.py", "holds_cache"): "whether a cache is in memory, read without a message",
    ("loop/served_model.py", "holds"): "whether a cache is in memory, read without a message",
    # Grammars compile in the tokenizer workers (on a follower, on its engine thread).
    ("decoding/grammar_matcher.py", "GrammarCompiler"): "compiles in the tokenizer workers",
    ("decoding/grammar_matcher.py", "__init__"): "a matcher is made by the compiler",
    ("decoding/grammar_matcher.py", "token_mask"): "the compiler checks a new grammar allows a reply",
    ("decoding/grammar_matcher.py", "allows_only_end"): "the compiler checks a new grammar allows a reply",
}


class CallLog:
    """(module, function, thread) of every call into engine/, from any thread."""

    def __init__(self) -> None:
        self.calls: set[tuple[str, str, str]] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(str(ENGINE)):
            module = str(Path(filename).relative_to(ENGINE))
            self.calls.add((module, frame.f_code.co_qualname, threading.current_thread().name))


@pytest.fixture
def call_log() -> Iterator[CallLog]:
    log = CallLog()
    threading.setprofile(log)
    sys.setprofile(log)
    try:
        yield log
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _allowed(module: str, qualname: str) -> bool:
    named = qualname.split(".<locals>")[0]  # a comprehension or closure counts as its function
    function = named.rpartition(".")[2]
    owner = named.partition(".")[0]
    return (module, function) in CROSSINGS or (module, owner) in CROSSINGS


TOOL = {
    "type": "function",
    "function": {
        "name": "Read",
        "description": "Reads a file.",
        "parameters": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
}


async def _turn(system: AgentSystem, agent_id: AgentId | None, text: str, **fields: Any) -> Finished:
    turn = TurnRequest(
        uuid.uuid4().hex,
        agent_id,
        [{"role": "user", "content": text}],
        SamplingParams(max_tokens=6, temperature=0),
        **fields,
    )
    started = await system.start_turn(turn)
    final = None
    async for event in started.stream:
        final = event
    assert isinstance(final, Finished), final
    return final


async def test_engine_modules_run_on_the_engine_thread(
    tiny_llama_dir: Path, tmp_path: Path, call_log: CallLog
) -> None:
    engine = EngineConfig(model=str(tiny_llama_dir), cache_budget_mb=256)
    config = SystemConfig(engine=engine, cache_dir=tmp_path)
    async with AgentSystem(config) as system:
        ada = AgentId("ada")
        await _turn(system, ada, "Hello there.")
        await _turn(system, ada, "Hello there.")  # the agent's cache, reused
        await _turn(system, None, "A number?", output_schema={"type": "integer"})
        await _turn(system, ada, "Pin this.", cache_breakpoints=[(0, 9, 300.0)])
        await _turn(system, None, "Read a.txt", tools=[TOOL], tool_choice=ToolChoice("any"))
    ran = {(module, name) for module, name, thread in call_log.calls if thread == ENGINE_THREAD}
    elsewhere = sorted(
        f"engine/{module} {name} on {thread}"
        for module, name, thread in call_log.calls
        if thread != ENGINE_THREAD and not _allowed(module, name)
    )
    assert len(ran) > 100, "the engine thread's calls were not recorded"
    why = "engine/ code run off the engine thread (move it to the layer that runs it):\n"
    assert elsewhere == [], why + "\n".join(elsewhere)
