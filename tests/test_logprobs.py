"""Log-probabilities through the official OpenAI SDK, checked against mlx-lm's own generation."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NUM_TOKENS = 6


@pytest.fixture
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server


def client_for(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def reference(model_dir: Path, num_top: int) -> tuple[int, list[tuple[str, float, list[tuple[str, float]]]]]:
    """mlx-lm's greedy generation of the question's reply: prompt length, then each token's text,
    log-probability and the `num_top` most likely tokens."""
    model, tokenizer = load(str(model_dir))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    steps = []
    for (token, logprobs), _ in zip(generate_step(mx.array(prompt), model), range(NUM_TOKENS), strict=False):
        top = mx.argsort(-logprobs)[:num_top].tolist()
        steps.append(
            (
                tokenizer.decode([int(token)]),
                logprobs[int(token)].item(),
                [(tokenizer.decode([t]), logprobs[t].item()) for t in top],
            )
        )
    return len(prompt), steps


def test_logprobs_match_mlx_lm_streamed_or_not(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    options = {"model": "gpt-4o", "messages": QUESTION, "temperature": 0, "max_tokens": NUM_TOKENS}
    reply = client.chat.completions.create(logprobs=True, top_logprobs=3, **options)  # type: ignore[call-overload]
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.logprobs is not None
    content = choice.logprobs.content
    assert content is not None and len(content) == NUM_TOKENS
    assert "".join(entry.token for entry in content) == choice.message.content
    num_prompt, expected = reference(default_model_dir, 3)
    assert reply.usage is not None and reply.usage.prompt_tokens == num_prompt
    for entry, (text, logprob, top) in zip(content, expected, strict=True):
        assert entry.token == text and entry.bytes == list(text.encode())
        assert entry.logprob == pytest.approx(logprob, abs=2e-3)
        assert [t.token for t in entry.top_logprobs] == [t for t, _ in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([p for _, p in top], abs=2e-3)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the likeliest token is taken

    chunks = list(client.chat.completions.create(stream=True, logprobs=True, **options))  # type: ignore[call-overload]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=2e-3)
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs: none
    for chunk in chunks:  # each chunk's tokens come with the text they make (or before it)
        if chunk.choices and chunk.choices[0].delta.content:
            assert chunk.choices[0].logprobs is not None

    plain = client.chat.completions.create(**options)  # type: ignore[call-overload]
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_an_end_token_and_a_grammar_s_ruled_out_tokens_are_not_listed(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    reply = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Pick a colour."}],
        temperature=0,
        max_tokens=16,
        logprobs=True,
        top_logprobs=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colour", "schema": {"type": "string", "enum": ["red", "green"]}},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in {'"red"', '"green"'}
    content = choice.logprobs.content if choice.logprobs else None
    assert content is not None
    assert "".join(entry.token for entry in content) == choice.message.content  # no end token
    assert reply.usage is not None and reply.usage.completion_tokens == len(content) + 1
    opening = content[0]  # the grammar allows only the opening quote: the rest are ruled out
    assert [t.token for t in opening.top_logprobs] == ['"'] and opening.logprob == 0.0
    for entry in content:
        assert all(math.isfinite(t.logprob) and t.logprob > -9999 for t in entry.top_logprobs)
        assert len(entry.top_logprobs) <= 20


def test_bad_logprob_requests_get_400s(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"top_logprobs must be in \[0, 20\], got 21"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, logprobs=True, top_logprobs=21)
