"""Operations against a real server: configuration, health, metrics, logs, API keys, bounds, OpenAPI.

The server serves the tiny random-weight Llama: what is tested is what the server does around the
model, not what the model says."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from subprocess import PIPE
from typing import Any

import anthropic
import hypothesis.strategies as st
import mlx.core as mx
import openai
import pytest
from hypothesis import given

from semantic.protocols.guard import TokenBucket
from semantic.protocols.settings import ConfigError, load_settings
from tests.server_process import ServerProcess
from tests.waiting import wait_until

KEY = "test-key-123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_settings_layers_apply_in_order_and_say_where_each_value_came_from(tmp_path: Path) -> None:
    toml = tmp_path / "semantic.toml"
    toml.write_text(
        '[server]\nport = 9000\napi_key = "from-toml"\n[limits]\nmax_tokens = 100\nmax_tools = 3\n'
    )
    dotenv = tmp_path / ".env"
    dotenv.write_text("SEMANTIC_SERVER_PORT=9001\nSEMANTIC_LIMITS_MAX_TOKENS=200\n# a comment\n")
    environ = {"SEMANTIC_SERVER_PORT": "9002", "SEMANTIC_MODEL_ALIASES": "claude*=,gpt-4o=tiny", "HOME": "/x"}
    loaded = load_settings({"server.port": "9003", "logging.level": "debug"}, environ, dotenv, toml)
    settings = loaded.settings
    assert settings.server.port == 9003 and loaded.sources["server.port"] == "command line"
    assert settings.logging.level == "DEBUG"  # as typed, in either case
    assert settings.limits.max_tokens == 200
    assert loaded.sources["limits.max_tokens"] == f"{dotenv} SEMANTIC_LIMITS_MAX_TOKENS"
    assert settings.limits.max_tools == 3 and loaded.sources["limits.max_tools"] == f"config file {toml}"
    assert settings.model.aliases == {"claude*": "", "gpt-4o": "tiny"}
    assert settings.limits.max_messages == 2048 and "limits.max_messages" not in loaded.sources
    described = loaded.describe()
    assert "server.api_key = '****'  # config file" in described and "from-toml" not in described
    assert "limits.max_messages = 2048  # default" in described


@pytest.mark.parametrize(("value", "expected"), [("0", None), ("1024", 1024)])
def test_the_short_turn_setting_reaches_the_engine(value: str, expected: int | None) -> None:
    from semantic.cli import _system_config

    settings = load_settings({"engine.short_turn_tokens": value}, {}, None).settings
    engine = _system_config(settings).engine
    assert engine.short_turn_tokens == expected  # 0: the engine's own default
    chunks = 2 if mx.default_device() == mx.cpu else 1  # two prefill chunks on the CPU, one on a GPU
    assert engine.num_short_turn_tokens == (expected or chunks * engine.num_tokens_per_prefill_step)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (
            {"SEMANTIC_SERVER_PORT": "eighty"},
            "server.port = 'eighty' (from environment SEMANTIC_SERVER_PORT)",
        ),
        ({"SEMANTIC_SERVER_PORTT": "1"}, "unknown setting 'server.portt'"),
        ({"SEMANTIC_LOGGING_FORMAT": "xml"}, "allowed: 'human', 'json'"),
        ({"SEMANTIC_LIMITS_MAX_TOKENS": "0"}, "limits.max_tokens = '0' (from environment"),
    ],
)
def test_bad_settings_are_refused_with_key_value_and_what_is_allowed(
    layer: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(environ=layer, dotenv=None)
    assert message in str(error.value)


def test_semantic_config_prints_sources_and_masks_secrets_and_serve_refuses_bad_values(
    tmp_path: Path,
) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SEMANTIC_LIMITS_MAX_TOOLS": "7"}

    def semantic(*args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "semantic.cli", *args]
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=PIPE, stderr=PIPE, text=True)

    # Four commands, each in its own process: started together, as none depends on another.
    config = semantic("config", "--api-key", "s3cret", "--port", "8123")
    bad = semantic("serve", "--max-batch-size", "0")
    remote = semantic("serve", "--host", "0.0.0.0", "--allow-remote")
    local_only = semantic("serve", "--host", "0.0.0.0", "--api-key", "k")
    (shown, _), (_, bad_err), (_, remote_err), (_, local_only_err) = (
        process.communicate(timeout=300) for process in (config, bad, remote, local_only)
    )
    assert config.returncode == 0
    assert "server.port = 8123  # command line" in shown
    assert "limits.max_tools = 7  # environment SEMANTIC_LIMITS_MAX_TOOLS" in shown
    assert "'****'" in shown and "s3cret" not in shown
    assert bad.returncode == 2 and "engine.max_batch_size = '0' (from command line)" in bad_err
    assert remote.returncode != 0 and "without an API key" in remote_err
    assert local_only.returncode != 0 and "--allow-remote" in local_only_err


@given(
    rate=st.floats(0.1, 50),
    burst=st.integers(1, 20),
    gaps=st.lists(st.floats(0, 2), min_size=1, max_size=60),
)
def test_token_bucket_never_grants_more_than_burst_plus_refill(
    rate: float, burst: int, gaps: list[float]
) -> None:
    bucket = TokenBucket(rate, burst, updated=0.0)
    now, granted = 0.0, 0
    for gap in gaps:
        now += gap
        wait = bucket.take(now)
        if wait == 0.0:
            granted += 1
        else:
            assert 0 < wait <= 1 / rate + 1e-9  # Retry-After says when one token is back
        assert granted <= burst + rate * now + 1e-6


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    process = ServerProcess(
        tmp_path_factory.mktemp("ops"),
        "--model",
        str(tiny_llama_dir),
        "--api-key",
        KEY,
        "--log-format",
        "json",
        "--temperature",
        "0",
        "--max-tokens-limit",
        "64",
        "--max-tools",
        "2",
        "--max-messages",
        "40",
        "--max-body-mb",
        "1",
        "--agent-rate-per-s",
        "0.0002",
        "--agent-rate-burst",
        "2",
        "--default-max-tokens",
        "8",
    ).start()
    yield process
    process.stop()


def get(server: ServerProcess, path: str, key: str | None = KEY) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(server.base_url + path, headers={"x-api-key": key} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def test_health_endpoints_answer_without_a_key(server: ServerProcess) -> None:
    assert get(server, "/health/live", key=None)[0] == 200
    status, body, _ = get(server, "/health/ready", key=None)
    assert status == 200 and json.loads(body)["loaded"] is True
    status, body, _ = get(server, "/health/startup", key=None)
    assert status == 200 and json.loads(body)["status"] == "started"


def test_api_key_is_required_in_each_protocols_error_shape(server: ServerProcess) -> None:
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="claude-local", max_tokens=4, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert "invalid API key" in str(refused.value)
    with pytest.raises(openai.AuthenticationError, match="x-api-key"):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    status, body, _ = get(server, "/v1/agents", key=None)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    # The right key, as Bearer (the OpenAI SDK) and as x-api-key (the Anthropic SDK).
    assert openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0).models.list().data
    right = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert right.messages.count_tokens(model="claude-haiku-4-5", messages=QUESTION).input_tokens > 0


def test_bounds_are_refused_with_the_limit(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=r"max_tokens: 100 is more than .* \(64, set by"):
        client.messages.create(model="claude-local", max_tokens=100, messages=QUESTION)
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(3)]
    with pytest.raises(
        anthropic.BadRequestError, match=r"tools: 3 is more than .* \(2, set by limits.max_tools"
    ):
        client.messages.create(model="claude-local", max_tokens=4, messages=QUESTION, tools=tools)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError, match=r"messages: 41 is more than"):
        client.messages.count_tokens(model="claude-local", messages=QUESTION * 41)  # counting is bounded too
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match=r"messages: 41 is more than"):
        oai.chat.completions.create(model="default", messages=QUESTION * 41)  # type: ignore[arg-type]
    with pytest.raises(openai.APIStatusError, match="request body too large") as too_large:
        oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "x" * 2_000_000}])
    assert too_large.value.status_code == 413


def test_requests_are_measured_logged_and_rate_limited(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    session = {"session_id": "metered"}
    first = client.chat.completions.with_raw_response.create(
        model="default", messages=QUESTION, max_tokens=8, extra_body=session
    )
    request_id = first.headers["x-request-id"]
    reply = first.parse()
    follow_up = [*QUESTION, {"role": "assistant", "content": reply.choices[0].message.content}]
    follow_up.append({"role": "user", "content": "And Germany?"})
    second = client.chat.completions.create(
        model="default", messages=follow_up, max_tokens=8, extra_body=session
    )
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached > 0
    # The bucket held 2 and refills once every 5,000 s (so however slow the machine is, no token
    # comes back between these requests): the third request in a row is refused.
    with pytest.raises(openai.RateLimitError, match="agent 'metered' is over its rate limit") as limited:
        client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8, extra_body=session)
    assert int(limited.value.response.headers["retry-after"]) >= 1

    status, body, headers = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    metrics = body.decode()
    for line in [
        'semantic_requests_total{protocol="openai",status="200"}',
        'semantic_requests_total{protocol="openai",status="429"}',
        'semantic_time_to_first_token_seconds_count{protocol="openai"}',
        "semantic_engine_wait_seconds_count",
        'semantic_cache_lookups_total{tier="none"}',
        'semantic_cache_lookups_total{tier="memory"}',
        "semantic_generated_tokens_total 16.0",
        'semantic_pool_bytes{kind="budget"}',
        'semantic_mlx_memory_bytes{kind="active"}',
        "semantic_evicted_caches_dropped_total 0.0",
        "semantic_queue_depth 0.0",
        "semantic_batch_size 0.0",
        "semantic_active_agents",
        "semantic_event_loop_lag_seconds",
        "semantic_model_swap_duration_seconds_count",
        "semantic_persist_duration_seconds_count",
    ]:
        assert line in metrics, line
    reused = next(
        m for m in metrics.splitlines() if m.startswith('semantic_prompt_tokens_total{kind="reused"}')
    )
    assert float(reused.split()[-1]) == cached
    waits = next(m for m in metrics.splitlines() if m.startswith("semantic_engine_wait_seconds_count"))
    assert float(waits.split()[-1]) >= 2  # the two turns that reached the engine
    assert "metered" not in metrics  # agents are counted, never labelled

    def json_log() -> list[dict[str, Any]]:
        return [json.loads(x) for x in server.log().splitlines() if x.startswith("{")]

    def summary_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [x for x in lines if x.get("request_id") == request_id and "prompt_tokens" in x]

    wait_until(lambda: bool(summary_of(json_log())), "the request's summary line is logged", 0.1)
    lines = json_log()
    (line,) = summary_of(lines)
    assert line["agent_id"] == "metered" and line["protocol"] == "openai" and line["status"] == 200
    assert line["prompt_tokens"] > 0 and line["generated_tokens"] == 8 and line["ttft_s"] > 0
    assert line["outcome"] == "ok" and line["duration_s"] >= line["ttft_s"]
    # where the time to first token went: the handler's work, then the wait for the batch, then prefill
    assert line["handled_s"] >= 0 and line["engine_wait_s"] >= 0
    assert line["handled_s"] + line["engine_wait_s"] <= line["ttft_s"]
    assert any(x.get("outcome") == "rate_limit_error" and x.get("agent_id") == "metered" for x in lines)


def test_openapi_document_comes_from_the_wire_schemas(server: ServerProcess) -> None:
    status, body, _ = get(server, "/openapi.json", key=None)
    assert status == 401  # everything but health needs the key
    status, body, _ = get(server, "/openapi.json")
    document = json.loads(body)
    assert document["openapi"].startswith("3.")
    schemas = document["components"]["schemas"]
    assert {"MessagesRequest", "ChatCompletionRequest", "AgentTurn", "AnthropicError"} <= set(schemas)
    assert "max_tokens" in schemas["MessagesRequest"]["properties"]
    assert set(document["paths"]) >= {
        "/v1/messages",
        "/v1/chat/completions",
        "/v1/agents/{agent_id}/messages",
    }
