"""Backpressure on a real server: 32 concurrent agents past the limits (on the tiny random-weight
model: the words do not matter), and the request timeout (on the default model, whose long reply
outlasts the timeout however fast the machine)."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import aiohttp

from tests.server_process import ServerProcess
from tests.waiting import wait_until


async def test_32_concurrent_agents_past_the_limits_get_429s_and_health_answers(
    server_factory, tiny_llama_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    server: ServerProcess = server_factory(
        "--model", str(tiny_llama_dir), "--max-batch-size", "4", "--max-queued", "4"
    ).start()
    # Replies long enough (a tiny model's step is short) that the first eight are still in flight
    # when the last of the 32 arrives.
    max_tokens = 64
    user = [{"role": "user", "content": "Hi"}]
    anthropic_body = {"model": "claude-local", "max_tokens": max_tokens, "messages": user}
    openai_body = {"model": "gpt-4o", "max_tokens": max_tokens, "messages": user}
    health: list[int] = []  # how fast it answers is measured in bench/, not here
    done = asyncio.Event()

    async def agent(session: aiohttp.ClientSession, index: int) -> tuple[int, str | None, dict]:  # type: ignore[type-arg]
        path, body = ("/v1/messages", anthropic_body) if index % 2 else ("/v1/chat/completions", openai_body)
        headers = {"x-agent-id": f"crowd-{index}"}
        async with session.post(server.base_url + path, json=body, headers=headers) as reply:
            return reply.status, reply.headers.get("Retry-After"), await reply.json()

    async def watch_health(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            async with session.get(server.base_url + "/health/live") as reply:
                health.append(reply.status)
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession() as session:
        watcher = asyncio.create_task(watch_health(session))
        results = await asyncio.gather(*(agent(session, i) for i in range(32)))
        done.set()
        await watcher
    statuses = [status for status, _, _ in results]
    assert all(status in (200, 429) for status in statuses), statuses
    refused = [(retry, body) for status, retry, body in results if status == 429]
    assert 8 <= statuses.count(200) < 32 and refused
    assert all(retry == "1" for retry, _ in refused)
    messages = [body["error"]["message"] for _, body in refused]
    assert all("limit of 8 requests in flight" in m for m in messages)
    kinds = {body.get("type") == "error" and body["error"]["type"] for _, body in refused}
    assert kinds <= {"rate_limit_error", False}  # Anthropic's shape where Anthropic was called
    assert len(health) >= 5 and set(health) == {200}


def test_a_request_past_the_timeout_fails_with_504_and_frees_its_slot(
    server_factory, default_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    import anthropic

    server = server_factory("--model", str(default_model_dir), "--request-timeout-s", "2").start()
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    try:
        client.messages.create(
            model="claude-local",
            max_tokens=4000,
            messages=[{"role": "user", "content": "Write a very long story."}],
        )
        raise AssertionError("the request should have timed out")
    except anthropic.APIStatusError as error:
        assert error.status_code == 504 and "longer than 2 s (server.request_timeout_s)" in str(error)

    # The slot and the batch are free again (read from /metrics: a follow-up request would itself
    # race the 2 s timeout on a busy machine).
    def freed() -> bool:
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as reply:
            lines = reply.read().decode().splitlines()
        gauges = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("semantic_")}
        return gauges["semantic_requests_in_flight"] == 0 and gauges["semantic_batch_size"] == 0

    wait_until(freed, "the timed-out request has given back its slot")
