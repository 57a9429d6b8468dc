"""OpenAI's penalties and logit bias, vLLM's min_p and repetition penalty, through the OpenAI SDK:
checked against mlx-lm's own generation with mlx-lm's own logits processors."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

DAYS = [{"role": "user", "content": "List the days of the week."}]
NUM_TOKENS = 16


@pytest.fixture
def server(shared_server):  # type: ignore[no-untyped-def]
    return shared_server


def client_for(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, **options: object) -> str:
    request = {"model": "gpt-4o", "messages": DAYS, "temperature": 0, "max_tokens": NUM_TOKENS, **options}
    reply = client.chat.completions.create(**request)  # type: ignore[call-overload]
    return str(reply.choices[0].message.content)


def test_penalties_give_mlx_lm_s_greedy_reply(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    model, tokenizer = load(str(default_model_dir))
    prompt = mx.array(tokenizer.apply_chat_template(DAYS, add_generation_prompt=True))
    plain = ask(client)
    for options in (
        {"frequency_penalty": 1.5},
        {"presence_penalty": -2.0},
        {"extra_body": {"repetition_penalty": 1.5}},
    ):
        penalties = {
            k: v for k, v in {**options, **options.get("extra_body", {})}.items() if k != "extra_body"
        }
        processors = make_logits_processors(**penalties)  # mlx-lm's, over its default 20 tokens
        steps = zip(
            generate_step(prompt, model, logits_processors=processors), range(NUM_TOKENS), strict=False
        )
        expected = tokenizer.decode([int(token) for (token, _), _ in steps])
        penalised = ask(client, **options)
        assert penalised == expected, options
        assert penalised != plain, options  # the penalty changed the reply


def test_logit_bias_moves_and_forces_greedy_choices(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    _, tokenizer = load(str(default_model_dir))
    reply = client.chat.completions.create(
        model="gpt-4o", messages=DAYS, temperature=0, max_tokens=1, logprobs=True, top_logprobs=2
    )
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content
    first, second = reply.choices[0].logprobs.content[0].top_logprobs
    (first_id,) = tokenizer.encode(first.token, add_special_tokens=False)
    assert ask(client, max_tokens=1, logit_bias={str(first_id): -100}) == second.token

    (dot,) = tokenizer.encode(".", add_special_tokens=False)
    assert ask(client, max_tokens=8, logit_bias={str(dot): 100}) == "." * 8


def test_min_p_of_one_samples_the_greedy_reply(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    greedy = ask(client)
    for seed in (1, 2):
        assert ask(client, temperature=1.0, seed=seed, extra_body={"min_p": 1.0}) == greedy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\], got 3"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\], got -2.5"),
        ({"extra_body": {"repetition_penalty": 0}}, r"repetition_penalty must be in \[0.01, 10\], got 0"),
        ({"extra_body": {"min_p": 1.5}}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"logit_bias": {"abc": 1}}, r"logit_bias: keys are token ids \(integers\)"),
        ({"logit_bias": {"49152": 1}}, r"logit_bias: the model's token ids are below 49152"),
        ({"logit_bias": {"5": 101}}, r"a logit_bias bias must be in \[-100, 100\], got 101"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias takes at most 300 tokens, got 301"),
    ],
)
def test_out_of_range_options_get_400s(server, options: dict[str, object], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError, match=message):
        ask(client_for(server), **options)
