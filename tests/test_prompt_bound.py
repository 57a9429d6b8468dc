"""A prompt whose text alone must hold more tokens than the limit is refused before it is tokenized:
no token spans more characters than the vocabulary's longest (the default model's: 81 characters,
162 UTF-8 bytes), so 162 x 8192 characters are over the 8K context whatever they say."""

from __future__ import annotations

import re
from pathlib import Path

from tests.agent_api_client import call
from tests.server_process import ServerProcess

FAR_OVER = "hello world " * 350_000  # 4.2 MB: at least 25,925 tokens by its length
BY_LENGTH = "counted from its length, before tokenizing"
# The longest token repeated: 16,000 tokens, but only 8,000 by the length bound, so it is tokenized.
JUST_UNDER = ("\n" + " " * 80) * 16_000


def test_a_prompt_far_over_the_context_is_refused_by_its_length(shared_server: ServerProcess) -> None:
    server = shared_server
    openai_body = {"max_tokens": 4, "messages": [{"role": "user", "content": FAR_OVER}]}
    status, reply = call(server, "POST", "/v1/chat/completions", openai_body)
    message = reply["error"]["message"]
    assert status == 400 and message.startswith("prompt has at least "), reply
    assert "tokens; the model's context holds 8192" in message and BY_LENGTH in message
    assert int(message.split()[4]) >= len(FAR_OVER) // 162

    anthropic_body = {"model": "claude-x", **openai_body}
    status, reply = call(server, "POST", "/v1/messages", anthropic_body)
    assert status == 400 and reply["error"]["message"].startswith("prompt is too long: "), reply
    assert reply["error"]["message"].endswith(" tokens > 8192 maximum")
    status, reply = call(server, "POST", "/v1/messages/count_tokens", anthropic_body)
    assert status == 400 and BY_LENGTH in reply["error"]["message"], reply

    # The direct API: the kept history counts as tokens, the new text by its length; a refused turn
    # leaves the conversation as it was.
    assert call(server, "POST", "/v1/agents", {"id": "bound-ada"})[0] == 201
    turn = {"content": "Hi, I am Ada.", "max_tokens": 4, "temperature": 0}
    status, first = call(server, "POST", "/v1/agents/bound-ada/messages", turn)
    assert status == 200, first
    status, reply = call(server, "POST", "/v1/agents/bound-ada/messages", {**turn, "content": FAR_OVER})
    assert status == 400 and BY_LENGTH in reply["error"]["message"], reply
    status, third = call(server, "POST", "/v1/agents/bound-ada/messages", turn)
    assert status == 200 and third["usage"]["cached_tokens"] > 0, third

    # Below the bound the prompt is tokenized and counted exactly, also when it is over the limit.
    over = {**openai_body, "messages": [{"role": "user", "content": JUST_UNDER}]}
    status, reply = call(server, "POST", "/v1/chat/completions", over)
    message = reply["error"]["message"]
    assert status == 400 and message.startswith("prompt has ") and BY_LENGTH not in message, reply
    assert int(message.split()[2]) >= 16_000
    accepted = {**openai_body, "messages": [{"role": "user", "content": JUST_UNDER[: 81 * 60]}]}
    status, reply = call(server, "POST", "/v1/chat/completions", accepted)
    assert status == 200, reply


def test_the_server_limit_is_checked_by_length_too(server_factory, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(
        "--model", str(default_model_dir), "--cache-budget-mb", "256", "--max-prompt-tokens", "100"
    ).start()
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hello world " * 2_000}]}
    status, reply = call(server, "POST", "/v1/chat/completions", body)
    message = reply["error"]["message"]
    assert status == 400 and message.startswith("prompt tokens: at least "), reply
    assert "set by limits.max_prompt_tokens" in message and BY_LENGTH in message
    body["messages"] = [{"role": "user", "content": "hello world " * 100}]
    status, reply = call(server, "POST", "/v1/chat/completions", body)
    message = reply["error"]["message"]
    assert status == 400 and message.startswith("prompt tokens: ") and BY_LENGTH not in message, reply
    body["messages"] = [{"role": "user", "content": "hello world"}]
    assert call(server, "POST", "/v1/chat/completions", body)[0] == 200
    server.stop()


def test_a_turn_larger_than_the_cache_budget_is_refused_with_the_budget_in_tokens(  # type: ignore[no-untyped-def]
    server_factory, default_model_dir: Path
) -> None:
    # A few MiB of KV per 256-token block: 12 MiB hold a block or two, not a 600-token prompt.
    server = server_factory("--model", str(default_model_dir), "--cache-budget-mb", "12").start()
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hello world " * 300}]}
    refusal = re.compile(
        r"request needs (\d+) KV blocks of 256 tokens \((\d+) prompt \+ 8 new tokens\) but the cache "
        r"budget holds (\d+) \((\d+) tokens\): .* larger --cache-budget-mb"
    )
    for path, shape in (("/v1/chat/completions", {}), ("/v1/messages", {"model": "claude-x"})):
        status, reply = call(server, "POST", path, {**body, **shape})
        found = refusal.fullmatch(reply["error"]["message"])
        assert status == 400 and found is not None, reply
        needed, prompt, held, held_tokens = map(int, found.groups())
        assert needed == -(-(prompt + 8) // 256) and 0 < held < needed and held_tokens == held * 256
    body["messages"] = [{"role": "user", "content": "hello world"}]
    assert call(server, "POST", "/v1/chat/completions", body)[0] == 200
    server.stop()
