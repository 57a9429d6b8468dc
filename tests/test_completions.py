"""The legacy text completions API through the official OpenAI SDK, against mlx-lm's own generation."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

PROMPT = "The three primary colours are"
NUM_TOKENS = 8


@pytest.fixture
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server


def client_for(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_text_and_token_prompts_are_continued_as_mlx_lm_continues_them(
    server, default_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    model, tokenizer = load(str(default_model_dir))
    prompt_ids = tokenizer.encode(PROMPT)  # no chat template: the text as the tokenizer reads it
    steps = list(zip(generate_step(mx.array(prompt_ids), model), range(NUM_TOKENS), strict=False))
    expected_ids = [int(token) for (token, _), _ in steps]

    reply = client.completions.create(
        model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, logprobs=2
    )
    (choice,) = reply.choices
    assert reply.object == "text_completion"
    assert choice.text == tokenizer.decode(expected_ids) and choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == NUM_TOKENS
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens == [tokenizer.decode([t]) for t in expected_ids]
    assert logprobs.token_logprobs == pytest.approx(
        [lp[t].item() for (t, lp), _ in steps], abs=2e-3
    )  # fmt: skip
    assert logprobs.top_logprobs is not None and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(NUM_TOKENS)]

    by_ids = client.completions.create(
        model="default", prompt=prompt_ids, max_tokens=NUM_TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == choice.text and by_ids.choices[0].logprobs is None

    chunks = list(
        client.completions.create(
            model="default",
            prompt=PROMPT,
            max_tokens=NUM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert all(c.object == "text_completion" for c in chunks)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 3  # streamed as it comes
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == NUM_TOKENS


def test_a_chat_shaped_prompt_is_not_templated_or_split(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = load(str(default_model_dir))
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n<think>"
    reply = client_for(server).completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert reply.choices[0].text  # plain text, though the prompt leaves the reply inside <think>


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"echo": True}, "echo is not supported"),
        ({"suffix": "x"}, "suffix is not supported"),
        ({"n": 2}, "n and best_of must be 1"),
        ({"best_of": 3}, "n and best_of must be 1"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": [1, 49152]}, "prompt: the model's token ids are 0 to 49151"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"presence_penalty": 9}, r"presence_penalty must be in \[-2, 2\], got 9"),
    ],
)
def test_what_cannot_be_served_gets_400s(server, options: dict[str, object], message: str) -> None:  # type: ignore[no-untyped-def]
    request = {"model": "default", "prompt": PROMPT, "max_tokens": 2, **options}
    with pytest.raises(openai.BadRequestError, match=message):
        client_for(server).completions.create(**request)  # type: ignore[call-overload]
