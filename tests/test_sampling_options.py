"""OpenAI's penalties and logit bias, vLLM's min_p and repetition penalty, mlx_lm.server's XTC,
through the OpenAI SDK: checked against mlx-lm's own generation, logits processors and sampler."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler
from mlx_lm.utils import load_tokenizer

from semantic import SamplingParams
from semantic.engine.decoding.sampling import make_sampler
from tests.agent_api_client import call

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


def ask_all(client: openai.OpenAI, option_sets: list[dict[str, Any]]) -> list[str]:
    """Each set of options asked at once: the replies decode as one batch, each row with its own."""
    with ThreadPoolExecutor(len(option_sets)) as pool:
        return list(pool.map(lambda options: ask(client, **options), option_sets))


def test_penalties_give_mlx_lm_s_greedy_reply(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    model, tokenizer = load(str(default_model_dir))
    prompt = mx.array(tokenizer.apply_chat_template(DAYS, add_generation_prompt=True))
    option_sets: list[dict[str, Any]] = [
        {"frequency_penalty": 1.5},
        {"presence_penalty": -2.0},
        {"extra_body": {"repetition_penalty": 1.5}},
    ]
    plain, *replies = ask_all(client, [{}, *option_sets])
    for options, penalised in zip(option_sets, replies, strict=True):
        penalties = {
            k: v for k, v in {**options, **options.get("extra_body", {})}.items() if k != "extra_body"
        }
        processors = make_logits_processors(**penalties)  # mlx-lm's, over its default 20 tokens
        steps = zip(
            generate_step(prompt, model, logits_processors=processors), range(NUM_TOKENS), strict=False
        )
        expected = tokenizer.decode([int(token) for (token, _), _ in steps])
        assert penalised == expected, options
        assert penalised != plain, options  # the penalty changed the reply


def test_logit_bias_moves_and_forces_greedy_choices(server, default_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    tokenizer = load_tokenizer(default_model_dir)
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
    sampled = [{"temperature": 1.0, "seed": seed, "extra_body": {"min_p": 1.0}} for seed in (1, 2)]
    greedy, *replies = ask_all(client, [{}, *sampled])
    assert replies == [greedy] * len(sampled)


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


# Known next-token probabilities: with XTC at threshold 0.15, tokens 0 and 1 are "top choices"
# (above it, and likelier than token 2, the least likely above it), so they are dropped.
PROBS = [0.4, 0.3, 0.2, 0.1]


def drawn(sampler, num_draws: int = 100) -> set[int]:  # type: ignore[no-untyped-def]
    logprobs = mx.log(mx.array([PROBS]))
    return {int(sampler(logprobs).item()) for _ in range(num_draws)}


def test_xtc_drops_the_top_choices_as_mlx_lm_s_sampler_does() -> None:
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.15}
    ours = SamplingParams(temperature=1.0, seed=3, **xtc)  # type: ignore[arg-type]
    mx.random.seed(3)
    assert drawn(make_sampler(ours, len(PROBS))) == drawn(mlx_lm_sampler(1.0, **xtc)) == {2, 3}
    kept = [0]  # the tokens XTC never drops (mlx_lm.server's: newline and EOS)
    with_kept = drawn(mlx_lm_sampler(1.0, **xtc, xtc_special_tokens=kept))
    assert drawn(make_sampler(ours, len(PROBS), xtc_kept_token_ids=kept)) == with_kept == {0, 2, 3}
    never = SamplingParams(temperature=1.0, seed=3, xtc_probability=0.0, xtc_threshold=0.15)
    assert drawn(make_sampler(never, len(PROBS))) == {0, 1, 2, 3}
    above_all = SamplingParams(temperature=1.0, seed=3, xtc_probability=1.0, xtc_threshold=0.5)
    assert drawn(make_sampler(above_all, len(PROBS))) == {0, 1, 2, 3}  # none is above 0.5: none dropped


def test_xtc_changes_a_seeded_reply_and_repeats(server) -> None:  # type: ignore[no-untyped-def]
    client = client_for(server)
    seeded = {"temperature": 1.0, "seed": 5}
    xtc = {**seeded, "extra_body": {"xtc_probability": 1.0, "xtc_threshold": 0.0}}  # all but the least likely
    dropped = ask(client, **xtc)
    assert ask(client, **xtc) == dropped  # one seed, one draw of each step's XTC coin
    assert dropped != ask(client, **seeded)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": DAYS}),
        ("/v1/completions", {"prompt": "Monday, Tuesday,"}),
        ("/v1/agents/xtc-check/messages", {"content": "Hello"}),
    ],
)
def test_out_of_range_xtc_gets_400s_on_each_api(server, path: str, body: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    for field, value, message in (
        ("xtc_probability", 1.5, "xtc_probability must be in [0, 1], got 1.5"),
        ("xtc_threshold", 0.6, "xtc_threshold must be in [0, 0.5], got 0.6"),
    ):
        status, reply = call(server, "POST", path, {**body, "max_tokens": 4, field: value})
        assert status == 400 and message in str(reply), (path, field, reply)
