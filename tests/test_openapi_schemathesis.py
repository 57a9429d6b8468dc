"""schemathesis against the real server (default model, loopback, an API key): requests generated
from `/openapi.json`, valid and invalid, get no 5xx, and every response, streamed events included,
matches the document.

The document is the one the server serves (checked below); examples are bounded and seeded, so a run
is repeatable, and replies are a few tokens long.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import response_schema_conformance

from semantic.protocols import openapi
from tests.server_process import ServerProcess

KEY = "schemathesis-key"
MAX_REPLY_TOKENS = 4
CHECKS = [not_a_server_error, response_schema_conformance]
TURNS = (
    "POST /v1/messages",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/agents/{agent_id}/messages",
)
CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": 16,
        "request-timeout": 120,  # a busy machine; the server's own request timeout still applies
        "generation": {"max-examples": 8, "deterministic": True},
        "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
    }
)
# Loading or unloading a model is not what this test is about, and would slow every later request.
schema = schemathesis.openapi.from_dict(openapi.build(), config=CONFIG).exclude(path_regex="^/admin/")
turns = schema.include(path_regex="/messages$|/completions$", method="POST")

# Which turn operations answered a generated request with a reply (2xx), and how (JSON or SSE).
replied: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("schemathesis"),
        "--model",
        str(default_model_dir),
        "--api-key",
        KEY,
        "--cache-budget-mb",
        "256",
        "--default-max-tokens",
        str(MAX_REPLY_TOKENS),
    ).start()
    yield process
    process.stop()


def test_the_served_document_is_the_one_tested(server: ServerProcess) -> None:
    request = urllib.request.Request(server.base_url + "/openapi.json", headers={"x-api-key": KEY})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read()) == json.loads(json.dumps(openapi.build()))


def keep_replies_short(body: Any) -> None:
    """Valid token limits above a few become a few: the checks are about shapes, not long replies."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPLY_TOKENS:
            body[key] = MAX_REPLY_TOKENS


def call_and_check(case: Any, server: ServerProcess) -> None:
    keep_replies_short(case.body)
    response = case.call_and_validate(base_url=server.base_url, headers={"x-api-key": KEY}, checks=CHECKS)
    if response.status_code < 300:
        replied.add((case.operation.label, response.headers.get("content-type", [""])[0].split(";")[0]))


@pytest.mark.slow  # generated requests, a soak: with the slow tests
@schema.parametrize()
def test_no_server_errors_and_every_response_follows_the_document(case: Any, server: ServerProcess) -> None:
    call_and_check(case, server)


@pytest.mark.slow
@turns.parametrize()
@settings(max_examples=4)
def test_streamed_turns_follow_the_document_event_by_event(case: Any, server: ServerProcess) -> None:
    if isinstance(case.body, dict):
        case.body["stream"] = True
    call_and_check(case, server)


@pytest.mark.slow
def test_valid_generated_turns_reach_the_model() -> None:
    """The document states what the handlers check (sampling ranges, required fields, agent ids),
    so requests generated as valid get replies, and the checks above see real turns, streamed too."""
    if not replied:
        pytest.skip("runs after the schemathesis tests, in the same session")
    assert {(label, "text/event-stream") for label in TURNS} <= replied, replied
    assert any((label, "application/json") in replied for label in TURNS), replied
