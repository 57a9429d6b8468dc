"""Hypothesis-generated request bodies against all three APIs: never a 5xx, never a hang.

Bodies are built from each API's own field names with values of any JSON type (and well-formed
requests with hostile values mixed in), sent to one real server. A reply may be 200 or any 4xx in
the API's error shape; a 5xx or a timeout fails the test with the body that caused it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_process import ServerProcess

FIELDS = {
    "/v1/messages": [
        "model",
        "messages",
        "system",
        "stream",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
    ],
    "/v1/chat/completions": [
        "model",
        "messages",
        "stream",
        "stop",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "tools",
        "tool_choice",
        "session_id",
        "stream_options",
        "continue_final_message",
    ],
    "/v1/agents/fuzz/messages": [
        "content",
        "messages",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "model",
    ],
}

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "assistant", "system", "tool", "", "robot"])
message = st.fixed_dictionaries(
    {"role": roles, "content": st.text(max_size=60) | json_values},
)


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Well-formed small turns with any subset of fields replaced by arbitrary JSON (max_tokens stays
    small: the bound itself is tested in test_status_table, and long replies only cost time)."""
    base: dict[str, Any] = {"max_tokens": 2, "temperature": 0}
    if path == "/v1/agents/fuzz/messages":
        base["content"] = "hi"
    else:
        base["messages"] = [{"role": "user", "content": "hi"}]
    overrides = st.dictionaries(st.sampled_from(FIELDS[path]), json_values | st.lists(message, max_size=3))
    return overrides.map(lambda fields: {**base, **fields})


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


def send(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    body = {**body, "stream": False} if body.get("stream") is True else body  # read whole replies
    request = urllib.request.Request(
        server.base_url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize("path", list(FIELDS))
def test_generated_bodies_never_get_a_5xx(server: ServerProcess, path: str) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=bodies(path))
    def check(body: dict[str, Any]) -> None:
        status, reply = send(server, path, body)
        assert status < 500, (status, reply[:300], body)
        if status >= 400:
            error = json.loads(reply)["error"]
            assert error["message"], reply

    check()


def send_raw(server: ServerProcess, path: str, data: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(
        server.base_url + path, data=data, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


DEPTH = 50_000
DEEP_LIST = "[" * DEPTH + "]" * DEPTH
DEEP_OBJECT = '{"a":' * DEPTH + "1" + "}" * DEPTH
DEEP_BODIES = {  # LIST and OBJECT stand for the deep values: in a field no API has, or one of any JSON
    "/v1/messages": [
        '{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],"junk":LIST}',
        '{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"t","input_schema":OBJECT}]}',
    ],
    "/v1/chat/completions": [
        '{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],"junk":LIST}',
        '{"max_tokens":2,"messages":[{"role":"user","content":"hi"}],'
        '"tools":[{"type":"function","function":{"name":"f","parameters":OBJECT}}]}',
        '{"max_tokens":2,"messages":[{"role":"user","content":"hi"},{"role":"assistant","tool_calls":'
        '[{"id":"c","type":"function","function":{"name":"f","arguments":"LIST"}}]},'
        '{"role":"tool","tool_call_id":"c","content":"ok"}]}',
    ],
    "/v1/agents/fuzz/messages": ['{"max_tokens":2,"content":"hi","junk":LIST}'],
}


@pytest.mark.parametrize("path", list(FIELDS))
def test_bodies_nested_past_any_decoder_get_a_400(server: ServerProcess, path: str) -> None:
    """JSON nested deeper than a recursive decoder follows (in a field, a tool's schema, or a tool
    call's arguments string) is bad input: a 400 in the API's error shape, not a 500."""
    for body in DEEP_BODIES[path]:
        data = body.replace("LIST", DEEP_LIST).replace("OBJECT", DEEP_OBJECT).encode()
        status, reply = send_raw(server, path, data)
        assert status == 400, (status, reply[:300])
        assert "nest" in json.loads(reply)["error"]["message"], reply[:300]
