"""Caches that explain their misses (issue 68): every reply says how many tokens of the agent's
cached history its prompt reused and, where it parted from it early, where and why.

The table test runs each kind of divergence through the real server and the default model: a first
turn, then a second turn changed in one way, read back from the `x-semantic-cache` header; the
pure functions are checked on their own below it, against the default model's chat template.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from semantic.actors.cache_miss import (
    CacheReport,
    Reason,
    RequestDigest,
    TurnNote,
    explain,
    explain_in_worker,
    first_change,
    history_of,
    mask_dates,
)
from semantic.actors.cache_notes import CacheNotes
from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.storage.agent_id import AgentId
from tests.agent_api_client import call
from tests.server_process import ServerProcess
from tests.waiting import wait_until

GREEDY = {"temperature": 0, "max_tokens": 6}
SYSTEM = {"role": "system", "content": "You are terse.\nToday's date is 2025-06-01."}
QUESTION = {"role": "user", "content": "What is 2+2?"}
THANKS = {"role": "user", "content": "Thanks. And 3+3?"}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}


def post(
    server: ServerProcess, path: str, body: dict[str, Any], agent: str | None
) -> tuple[dict[str, str], bytes]:
    """The reply's cache header fields and its body."""
    headers = {"content-type": "application/json", **({"x-agent-id": agent} if agent else {})}
    request = urllib.request.Request(server.base_url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=300) as reply:
        assert reply.status == 200
        header = reply.headers["x-semantic-cache"]
        raw = reply.read()
    assert header is not None, "no x-semantic-cache header"
    return dict(field.split("=", 1) for field in header.split("; ")), raw


def chat(
    server: ServerProcess, agent: str | None, messages: list[dict[str, Any]], **extra: Any
) -> tuple[dict[str, str], str]:
    fields, raw = post(
        server, "/v1/chat/completions", {"model": "default", "messages": messages, **GREEDY, **extra}, agent
    )
    return fields, json.loads(raw)["choices"][0]["message"]["content"] or ""


def dated(day: int) -> dict[str, str]:
    return {"role": "system", "content": f"You are terse.\nToday's date is 2025-06-{day:02d}."}


# Each case: the second turn's messages and tools, given the first turn's reply; what its header says.
CASES: dict[str, tuple[Any, dict[str, str]]] = {
    "hit": (
        lambda reply: ([SYSTEM, QUESTION, {"role": "assistant", "content": reply}, THANKS], None),
        {"reason": "hit"},
    ),
    "system": (
        lambda reply: ([{"role": "system", "content": "You are kind."}, QUESTION], None),
        {"reason": "system", "message": "0", "block": "0"},
    ),
    "tools": (lambda reply: ([SYSTEM, QUESTION], [CLOCK]), {"reason": "tools", "message": "0"}),
    "edited-message": (
        lambda reply: (
            [
                SYSTEM,
                {"role": "user", "content": "What is 5+5?"},
                {"role": "assistant", "content": reply},
                THANKS,
            ],
            None,
        ),
        {"reason": "edited-message", "message": "1", "block": "0"},
    ),
    "date-line": (
        lambda reply: ([dated(2), QUESTION, {"role": "assistant", "content": reply}, THANKS], None),
        {"reason": "date-line", "message": "0", "block": "0"},
    ),
    # Our template joins back-to-back user turns: the same first messages render other tokens.
    "template": (
        lambda reply: ([SYSTEM, QUESTION, {"role": "user", "content": "Quickly."}], None),
        {"reason": "template", "message": "2"},
    ),
    "rewound": (lambda reply: ([SYSTEM, QUESTION], None), {"reason": "rewound", "message": "2"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_kind_of_divergence_is_explained_in_the_header(shared_server: ServerProcess, case: str) -> None:
    server, agent = shared_server, f"miss-{case}"
    second, expected = CASES[case]
    first_tools = [WEATHER] if case == "tools" else None
    first, reply = chat(server, agent, [SYSTEM, QUESTION], **({"tools": first_tools} if first_tools else {}))
    assert first == {"reused": "0/0", "reason": "first-turn"}
    messages, tools = second(reply)
    fields, _ = chat(server, agent, messages, **({"tools": tools} if tools else {}))
    reused, history = map(int, fields["reused"].split("/"))
    assert history > 0
    assert {name: fields[name] for name in expected} == expected
    if case == "hit":
        assert reused == history and "parted" not in fields
    else:
        # What the engine reused (the log line's figure): up to where the prompt parted; a prompt
        # that diverges early runs as a fork of the agent and reuses only whole shared blocks.
        assert reused <= int(fields["parted"]) < history
        if case not in ("system", "tools"):
            assert reused >= int(fields["parted"]) - 1  # one token must be prefilled
        assert ("block" in fields) == ("block" in expected)


def test_the_report_reaches_the_agent_the_metrics_and_the_log_line(shared_server: ServerProcess) -> None:
    server, agent = shared_server, "miss-everywhere"
    _, reply = chat(server, agent, [SYSTEM, QUESTION])
    edited = [
        SYSTEM,
        {"role": "user", "content": "What is 7+7?"},
        {"role": "assistant", "content": reply},
        THANKS,
    ]
    streamed = {"model": "default", "messages": edited, "stream": True, **GREEDY}
    fields, _ = post(server, "/v1/chat/completions", streamed, agent)  # headers go out before the body
    assert fields["reason"] == "edited-message"
    status, shown = call(server, "GET", f"/v1/agents/{agent}")
    assert status == 200, shown
    assert shown["cache"]["hits"] == 0 and shown["cache"]["misses"] == 1
    last = shown["cache"]["last_turn"]
    assert (
        last["reason"] == "edited-message"
        and last["parted"] == int(fields["parted"])
        and last["message"] == 1
    )
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as reply:
        metrics = reply.read().decode()
    assert re.search(r'semantic_cache_turns_total\{reason="edited-message"\} [1-9]', metrics), metrics
    assert 'semantic_cache_turns_total{reason="date-line"}' in metrics  # every reason, zeros too
    line = f"agent={agent} "
    wait_until(
        lambda: any(line in row and ",reason=edited-message " in row for row in server.log().splitlines()),
        "the log line",
    )


def test_anthropic_direct_and_anonymous_replies_carry_the_header(shared_server: ServerProcess) -> None:
    server = shared_server
    body = {"model": "claude-local", "max_tokens": 4, "temperature": 0, "messages": [QUESTION]}
    first, _ = post(server, "/v1/messages", {**body, "system": "You are terse."}, "miss-anthropic")
    assert first["reason"] == "first-turn"
    fields, _ = post(
        server, "/v1/messages", {**body, "system": "You are kind.", "stream": True}, "miss-anthropic"
    )
    assert fields["reason"] == "system" and fields["message"] == "0"

    assert call(server, "POST", "/v1/agents", {"id": "miss-direct", "system": "You are terse."})[0] == 201
    turn = {"content": "What is 2+2?", **GREEDY}
    first, _ = post(server, "/v1/agents/miss-direct/messages", turn, None)
    assert first == {"reused": "0/0", "reason": "first-turn"}
    fields, _ = post(server, "/v1/agents/miss-direct/messages", {**turn, "stream": True}, None)
    reused, history = map(int, fields["reused"].split("/"))
    assert fields["reason"] == "hit" and reused == history > 0

    anonymous, _ = chat(server, None, [QUESTION])
    assert anonymous == {"reused": "0/0", "reason": "no-agent"}


# ---- the pure functions ----


def test_dates_times_and_weekdays_are_masked_and_little_else() -> None:
    for a, b in [
        ("Today's date is 2025-06-01.", "Today's date is 2025-06-02."),
        ("Now: 2025-06-01T10:32:05Z", "Now: 2025-06-02T08:00:00+02:00"),
        ("It is 10:32 pm on Monday", "It is 9:05 am on Tuesday"),
        ("June 1st, 2025 at 12/31/2024", "July 4, 2025 at 1/2/2025"),
        ("the 1 June 2025 build", "the 30 Sept 2025 build"),
    ]:
        assert a != b and mask_dates(a) == mask_dates(b), (a, b)
    for text in ["version 1.2.3", "Monitor the 40 servers", "May I ask?", "3+3 is 6"]:
        assert mask_dates(text) == text


def digest(*messages: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> RequestDigest:
    return RequestDigest.of(list(messages), tools)


def test_the_first_change_between_two_requests_is_named_earliest_first() -> None:
    call_a = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "a", "arguments": {}}}],
    }
    call_b = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "b", "arguments": {}}}],
    }
    old = digest(SYSTEM, QUESTION, call_a, THANKS, tools=[WEATHER])
    table = [
        (digest(dated(2), QUESTION, tools=[CLOCK]), (Reason.DATE_LINE, 0, 0)),  # the system prompt first
        (digest({"role": "system", "content": "Hi"}, QUESTION, tools=[WEATHER]), (Reason.SYSTEM, 0, 0)),
        (digest(QUESTION, call_a, THANKS, tools=[WEATHER]), (Reason.SYSTEM, 0, 0)),  # dropped
        (digest(SYSTEM, THANKS, tools=[CLOCK]), (Reason.TOOLS, None, None)),
        (digest(SYSTEM, QUESTION, call_b, THANKS, tools=[WEATHER]), (Reason.EDITED_MESSAGE, 2, 1)),
        (
            digest(SYSTEM, {"role": "assistant", "content": "What is 2+2?"}, tools=[WEATHER]),
            (Reason.EDITED_MESSAGE, 1, 0),
        ),
        (
            digest(SYSTEM, QUESTION, call_a, {"role": "user", "content": "On 2025-06-01"}, tools=[WEATHER]),
            (Reason.EDITED_MESSAGE, 3, 0),
        ),
        (digest(SYSTEM, QUESTION, tools=[WEATHER]), (Reason.REWOUND, 2, None)),
        (digest(SYSTEM, QUESTION, call_a, THANKS, QUESTION, tools=[WEATHER]), (Reason.TEMPLATE, None, None)),
    ]
    for new, expected in table:
        assert first_change(old, new) == expected
    on_a_date = digest(SYSTEM, {"role": "user", "content": "On 2025-06-01"})
    assert (
        first_change(on_a_date, digest(SYSTEM, {"role": "user", "content": "On 2025-06-02"}))[0]
        is Reason.DATE_LINE
    )


def test_explain_compares_tokens_then_requests() -> None:
    request = digest(SYSTEM, QUESTION)
    note = TurnNote("model-a", history_of([1, 2, 3, 4], [5, 6]), request)
    assert explain(None, "model-a", [1, 2], request) == CacheReport(Reason.FIRST_TURN)
    assert explain(note, "model-b", [1, 2], request) == CacheReport(Reason.MODEL, 0, 6, parted_at=0)
    assert explain(note, "model-a", [1, 2, 3, 4, 5, 6, 7], request).reason is Reason.HIT
    retried = explain(note, "model-a", [1, 2, 3, 4], request)
    assert retried == CacheReport(Reason.REWOUND, 4, 6, parted_at=4)
    assert explain(note, "model-a", [1, 2, 9, 9, 9, 9, 9], request).reason is Reason.TEMPLATE
    edited = explain(note, "model-a", [1, 2, 9], digest(SYSTEM, THANKS))
    assert edited == CacheReport(Reason.EDITED_MESSAGE, 2, 6, parted_at=2, message=1, block=0)
    assert explain(note, "model-a", [1, 9], None).reason is Reason.OTHER  # a raw prompt
    assert edited.header() == "reused=2/6; parted=2; message=1; block=0; reason=edited-message"
    assert CacheReport(Reason.HIT, 6, 6).header() == "reused=6/6; reason=hit"


def test_notes_are_bounded_in_agents_and_in_tokens() -> None:
    notes = CacheNotes(max_agents=2, max_history_tokens=10)
    ada, bob, cy = AgentId("ada"), AgentId("bob"), AgentId("cy")
    notes.record(ada, TurnNote("m", history_of([1] * 4, []), None))
    notes.record(bob, TurnNote("m", history_of([1] * 4, []), None))
    notes.record(cy, TurnNote("m", history_of([1] * 4, []), None))
    assert notes.note_of(ada) is None and notes.note_of(bob) is not None  # two agents at most
    notes.record(ada, TurnNote("m", history_of([1] * 8, []), None))
    assert notes.note_of(bob) is None and notes.note_of(cy) is None  # ten tokens at most
    notes.record(bob, TurnNote("m", history_of([1] * 11, []), None))
    assert notes.note_of(bob) is None  # one note over the bound is not kept at all
    for report in [
        CacheReport(Reason.HIT),
        CacheReport(Reason.SYSTEM, 0, 4, parted_at=0),
        CacheReport(Reason.HIT),
    ]:
        notes.count(ada, report)
    notes.count(None, CacheReport(Reason.NO_AGENT))
    counts = notes.counts_of(ada)
    assert counts is not None and (counts.num_hits, counts.num_misses) == (2, 1)
    assert notes.num_turns_by_reason[Reason.HIT] == 2 and notes.num_turns_by_reason[Reason.NO_AGENT] == 1
    notes.forget(ada)
    assert notes.counts_of(ada) is None and notes.note_of(ada) is None


def test_the_parting_token_is_placed_in_its_message_by_the_real_template(default_model_dir: Path) -> None:
    template = ChatFormat(load_tokenizer(default_model_dir))

    def turn(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[TurnRequest, list[int]]:
        request = TurnRequest("turn", None, messages, SamplingParams(max_tokens=4), tools=tools)
        return request, template.encode(template.render(messages, tools), None)

    first, prompt = turn([SYSTEM, QUESTION])
    note = TurnNote(
        "m", history_of(prompt, template.encode("4<|im_end|>", None)), RequestDigest.of(first.messages, None)
    )
    edited, edited_prompt = turn(
        [
            SYSTEM,
            QUESTION,
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "ok"},
            {"role": "user", "content": "And?"},
        ]
    )
    assert explain_in_worker(template, note, "m", edited, edited_prompt)[0].reason is Reason.HIT
    for messages, tools, reason, message in [
        ([dated(9), QUESTION], None, Reason.DATE_LINE, 0),
        ([SYSTEM, QUESTION], [CLOCK], Reason.TOOLS, 0),  # listed in the system message
        ([SYSTEM, {"role": "user", "content": "What is 2+3?"}], None, Reason.EDITED_MESSAGE, 1),
        ([SYSTEM, QUESTION, THANKS], None, Reason.TEMPLATE, 2),  # joined onto the question
    ]:
        request, ids = turn(messages, tools)
        report, _ = explain_in_worker(template, note, "m", request, ids)
        assert (report.reason, report.message) == (reason, message), messages
        assert report.parted_at is not None and ids[: report.parted_at] == prompt[: report.parted_at]
        assert ids[report.parted_at] != note.history[report.parted_at]
