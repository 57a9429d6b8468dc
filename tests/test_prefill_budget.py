"""The prefill budget: its arithmetic as properties, and the real engine keeping streams decoding."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from semantic.actors.engine_client import Engine, EngineConfig
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import ReferenceGenerate
from semantic.engine.loop.messages import Finished, GenerationRequest, PromptProgress, TokenDelta
from semantic.engine.scheduling.prefill_budget import (
    MIN_CHUNK_TOKENS,
    RECENT_CHUNKS,
    TRUSTED_GROWTH,
    PrefillBudget,
    per_prompt_chunk,
)
from tests.modelled_budget import modelled_budget_in

MAX_CHUNK = 256
SHORT_TURN = 2 * MAX_CHUNK  # a prompt with at most this many uncached tokens goes in whole chunks
LONG_PROMPT = 4 * MAX_CHUNK  # a cold history: chunked under the budget
ticks = st.lists(
    st.tuples(
        st.floats(min_value=-1.0, max_value=10.0, allow_nan=False),
        st.integers(min_value=0, max_value=16),
        st.integers(min_value=0, max_value=4096),
    ),
    max_size=50,
)


@given(ticks, st.floats(min_value=0.0, max_value=8.0), st.integers(min_value=1, max_value=16))
def test_a_tick_with_streams_decoding_prefills_between_the_floor_and_the_chunk(
    observed: list[tuple[float, int, int]], ratio: float, num_decoding: int
) -> None:
    budget = PrefillBudget(MAX_CHUNK, ratio, SHORT_TURN)
    chunks: list[int] = []
    for elapsed_s, decoding, prompt_tokens in observed:
        budget.observe(elapsed_s, decoding, prompt_tokens)
        if elapsed_s > 0 and prompt_tokens:
            chunks.append(prompt_tokens)
        assert MIN_CHUNK_TOKENS <= budget.tokens_for_tick(num_decoding, LONG_PROMPT) <= MAX_CHUNK
        if chunks and ratio > 0:  # never far past the sizes the line was fitted on
            trusted = max(MIN_CHUNK_TOKENS, TRUSTED_GROWTH * max(chunks[-RECENT_CHUNKS:]))
            assert budget.tokens_for_tick(num_decoding, LONG_PROMPT) <= trusted
        assert budget.tokens_for_tick(0, LONG_PROMPT) == MAX_CHUNK  # nothing to stall: whole chunks
        assert budget.tokens_for_tick(num_decoding, SHORT_TURN) == MAX_CHUNK  # a short turn: whole chunks
        budgeted = budget.tokens_for_tick(num_decoding, LONG_PROMPT)
        assert budget.tokens_for_tick(num_decoding, SHORT_TURN + 1) == budgeted  # one token more: budgeted
        assert budget.tokens_for_tick(num_decoding, 0) == budget.tokens_for_tick(num_decoding, LONG_PROMPT)
    if ratio == 0:
        assert budget.tokens_for_tick(num_decoding, LONG_PROMPT) == MAX_CHUNK


@given(
    decode_s=st.floats(min_value=0.001, max_value=1.0),
    overhead_s=st.floats(min_value=0.0, max_value=0.5),
    token_s=st.floats(min_value=1e-6, max_value=0.05),
    ratio=st.floats(min_value=0.25, max_value=4.0),
)
def test_the_chunk_settles_where_prefill_takes_the_ratio_of_a_decode_step(
    decode_s: float, overhead_s: float, token_s: float, ratio: float
) -> None:
    """On a machine whose tick costs decode + (overhead + n * token) when it prefills n tokens: the
    chunk's prefill takes `ratio` decode steps, or twice its overhead where that is more."""
    budget = PrefillBudget(MAX_CHUNK, ratio, SHORT_TURN)
    budget.observe(decode_s, 4, 0)
    for _ in range(200):
        chunk = budget.tokens_for_tick(4, LONG_PROMPT)
        budget.observe(decode_s + overhead_s + chunk * token_s, 4, chunk)
    chunk = budget.tokens_for_tick(4, LONG_PROMPT)
    prefill_s = overhead_s + chunk * token_s
    target_s = max(ratio * decode_s, overhead_s + min(overhead_s, decode_s))
    if MIN_CHUNK_TOKENS < chunk < MAX_CHUNK:
        assert abs(prefill_s - target_s) <= 0.1 * target_s + token_s, (chunk, prefill_s, target_s)
    elif chunk == MIN_CHUNK_TOKENS:
        assert overhead_s + (MIN_CHUNK_TOKENS + 1) * token_s >= 0.9 * target_s  # even the floor costs more
    else:
        assert overhead_s + MAX_CHUNK * token_s <= 1.1 * target_s + token_s  # the whole chunk fits


@given(
    decode_s=st.floats(min_value=0.001, max_value=1.0),
    overhead_s=st.floats(min_value=0.0, max_value=0.5),
    token_s=st.floats(min_value=1e-6, max_value=0.05),
    doubling=st.integers(min_value=2048, max_value=16384),
    ratio=st.floats(min_value=0.25, max_value=4.0),
)
def test_the_chunk_shrinks_as_a_long_prompt_makes_its_tokens_dearer(
    decode_s: float, overhead_s: float, token_s: float, doubling: int, ratio: float
) -> None:
    """A prompt's later chunks attend over more: on a machine whose time per prompt token doubles
    every `doubling` tokens prefilled, no chunk past the first few takes much more than its aim
    (the old budget: 6x, keeping a size whose ticks got dearer, or growing it past what it saw)."""
    budget = PrefillBudget(MAX_CHUNK, ratio, SHORT_TURN)
    budget.observe(decode_s, 4, 0)
    prefilled = 0
    for tick in range(400):
        chunk = budget.tokens_for_tick(4, 16 * LONG_PROMPT)
        per_token_s = token_s * (1 + prefilled / doubling)
        prefill_s = overhead_s + chunk * per_token_s
        aim_s = max(
            ratio * decode_s,
            overhead_s + min(overhead_s, decode_s),
            overhead_s + MIN_CHUNK_TOKENS * per_token_s,  # the floor's own cost
        )
        if tick >= 8 and chunk < MAX_CHUNK:
            assert prefill_s <= 2.5 * aim_s, (tick, chunk, prefill_s, aim_s)
        budget.observe(decode_s + prefill_s, 4, chunk)
        prefilled += chunk


@pytest.mark.parametrize(
    ("decode_s", "overhead_s", "token_s"),
    [(0.005, 0.005, 4e-6), (0.06, 0.0, 0.0015)],  # launch-bound (an H200), compute-bound (2 CPU cores)
)
def test_the_chunk_grows_though_no_tick_ever_decodes_alone(
    decode_s: float, overhead_s: float, token_s: float
) -> None:
    """Agents that arrive together: one prompt decodes while the rest prefill behind it, so no tick
    decodes alone to measure D. The chunk must still leave the floor (on an H200, 16-token chunks
    held 7 agents' first tokens back 5 s), and stay near a decode step's worth of prefill."""
    budget = PrefillBudget(MAX_CHUNK, 1.0, SHORT_TURN)
    chunks = []
    for _ in range(40):
        chunk = budget.tokens_for_tick(1, LONG_PROMPT)
        budget.observe(decode_s + overhead_s + chunk * token_s, 1, chunk)
        chunks.append(chunk)
    assert chunks[-1] > 2 * MIN_CHUNK_TOKENS
    assert overhead_s + chunks[-1] * token_s <= 2 * (decode_s + overhead_s + MIN_CHUNK_TOKENS * token_s)


def test_a_short_turn_taken_whole_beside_a_stream_does_not_stand_for_its_decode_step() -> None:
    """A stream's first tick can be one that also took a short turn whole (0.8 s here). Were that
    tick the bound on a decode step, a long prompt after it would go in chunks as long as it, a
    13-step stall for the stream on every tick until one decodes alone. It starts at the floor and
    settles near a decode step's worth of prefill."""
    decode_s, token_s = 0.06, 0.0015  # 2 CPU cores
    budget = PrefillBudget(MAX_CHUNK, 1.0, SHORT_TURN)
    budget.observe(decode_s + 500 * token_s, 1, 500)
    chunks = []
    for _ in range(20):
        chunk = budget.tokens_for_tick(1, LONG_PROMPT)
        budget.observe(decode_s + chunk * token_s, 1, chunk)
        chunks.append(chunk)
    assert chunks[0] == MIN_CHUNK_TOKENS
    assert max(chunks[1:]) * token_s <= 2 * decode_s


@given(
    st.integers(min_value=MIN_CHUNK_TOKENS, max_value=MAX_CHUNK),
    st.integers(min_value=0, max_value=8),
)
def test_prompts_prefilled_together_share_the_budget(tokens: int, num_prompts: int) -> None:
    """mlx-lm's chunk is per prompt: prompts prefilled together (on a GPU, up to 8) must not take the
    budget each, nor lose whole chunks when nothing holds them down."""
    chunk = per_prompt_chunk(tokens, num_prompts, MAX_CHUNK)
    assert MIN_CHUNK_TOKENS <= chunk <= tokens
    if tokens == MAX_CHUNK or num_prompts <= 1:
        assert chunk == tokens
    elif tokens // num_prompts >= MIN_CHUNK_TOKENS:
        assert chunk * num_prompts <= tokens  # the tick prefills the budget once, not once a prompt


@given(
    st.integers(min_value=MIN_CHUNK_TOKENS, max_value=MAX_CHUNK),
    st.lists(st.integers(min_value=0, max_value=3 * MAX_CHUNK), max_size=8),
    st.integers(min_value=0, max_value=3 * MAX_CHUNK),
)
def test_prompts_that_are_all_short_turns_go_in_whole_chunks_and_no_chunk_shrinks(
    chunk: int, prefilling: list[int], short_turn: int
) -> None:
    budget = PrefillBudget(MAX_CHUNK, 1.0, short_turn)
    widened = budget.whole_for_short_turns(chunk, prefilling)
    if prefilling and max(prefilling) <= short_turn:
        longest = max(prefilling)
        # Every prompt in as few ticks as whole chunks take: one stall a chunk for the streams, and
        # never a longer one than a chunk.
        assert chunk <= widened <= MAX_CHUNK
        assert math.ceil(longest / widened) == math.ceil(longest / MAX_CHUNK)
        if longest > 0:  # and the ticks after it, that know the prompts, agree
            assert budget.tokens_for_tick(2, longest) == budget.short_turn_chunk(longest)
            assert widened == max(chunk, budget.short_turn_chunk(longest))
    else:
        assert widened == chunk  # a long prompt (or none) keeps the budget's chunk


@given(st.integers(min_value=1, max_value=8 * MAX_CHUNK))
def test_a_short_turn_longer_than_a_chunk_is_cut_into_chunks_of_one_size(num_tokens: int) -> None:
    """260 tokens go as 130 and 130, not as 256 and 4: the same number of ticks, and the longest
    stall a running stream sees is half as long."""
    budget = PrefillBudget(MAX_CHUNK, 1.0, 8 * MAX_CHUNK)
    chunk = budget.short_turn_chunk(num_tokens)
    num_ticks = math.ceil(num_tokens / MAX_CHUNK)
    assert chunk <= MAX_CHUNK
    assert math.ceil(num_tokens / chunk) == num_ticks
    if num_tokens > MAX_CHUNK:  # the last tick's chunk is at most one token short of the others
        assert chunk * num_ticks - num_tokens < num_ticks
    else:
        assert chunk == MAX_CHUNK  # one tick: as before, whatever the prompt's length


def test_each_batch_size_keeps_its_own_decode_step() -> None:
    """A slow step with more sequences decoding (an arrival joined) does not stretch the stall
    allowed once they are fewer again: every tick then prefills, so D would never be re-measured."""
    budget = PrefillBudget(MAX_CHUNK, 1.0, SHORT_TURN)
    budget.observe(0.05, 2, 0)
    for chunk in (16, 32, 64, 48, 40):  # a line: no fixed cost, 1 ms a token
        budget.observe(0.05 + chunk * 0.001, 2, chunk)
    two = budget.tokens_for_tick(2, LONG_PROMPT)
    budget.observe(0.2, 3, 0)
    assert budget.tokens_for_tick(2, LONG_PROMPT) == two
    assert budget.tokens_for_tick(3, LONG_PROMPT) > two
    assert budget.tokens_for_tick(8, LONG_PROMPT) == budget.tokens_for_tick(3, LONG_PROMPT)  # the nearest


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(default_model_dir: Path) -> AsyncIterator[Engine]:
    config = EngineConfig(
        model=str(default_model_dir),
        cache_budget_mb=512,
        prefill_step_size=MAX_CHUNK,
        prefill_stall_ratio=1.0,
        short_turn_tokens=SHORT_TURN,  # the default is one chunk; two show the setting is followed
    )
    engine = Engine(config)
    await engine.start()
    yield engine
    await engine.stop()


def chat(engine: Engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(engine.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_running_stream_keeps_decoding_while_a_long_prompt_prefills(engine: Engine) -> None:
    # Raw text, no chat template: the model goes on counting without ending its turn.
    counting = list(engine.model.tokenizer.encode(", ".join(str(i) for i in range(1, 21)) + ","))
    long_prompt = chat(engine, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * 120)
    assert len(long_prompt) > SHORT_TURN  # a cold history, not a short turn
    # The engine is idle: its budget is swapped between ticks for one told fixed step times, so the
    # chunks follow the tokens, not how busy the machine is.
    assert engine._core is not None and engine._core._served is not None
    with modelled_budget_in(engine._core._served.batch):
        await _keeps_decoding(engine, counting, long_prompt)


async def _keeps_decoding(engine: Engine, counting: list[int], long_prompt: list[int]) -> None:
    runner = engine.submit(GenerationRequest("runner", counting, SamplingParams(max_tokens=2000)))
    arrival = engine.submit(GenerationRequest("arrival", long_prompt, SamplingParams(max_tokens=8)))
    arrival_decoding = False
    arrival_tokens: list[int] = []
    num_chunks = 1  # the last chunk ends the prompt and reports no progress

    async def follow_arrival() -> None:
        nonlocal arrival_decoding, num_chunks
        async for event in arrival:
            if isinstance(event, PromptProgress):
                num_chunks += 1
            elif isinstance(event, TokenDelta):
                arrival_decoding = True
                arrival_tokens.extend(event.token_ids)
        runner.cancel()  # the runner has served its purpose

    follower = asyncio.create_task(follow_arrival())
    runner_tokens = 0
    async for event in runner:
        if isinstance(event, TokenDelta):
            runner_tokens += len(event.token_ids)
        elif isinstance(event, Finished):
            assert arrival_decoding, f"the runner ended after {runner_tokens} tokens, before the prefill did"
    await follower
    # The runner, decoding all along, gets one token per tick, and each tick prefills one chunk: whole
    # 256-token chunks would give it one token per 256 prompt tokens; the budget gives it many. The
    # chunks are counted from the arrival's own progress events, which the engine posts in tick
    # order; comparing the two channels' events at the client would depend on how a busy event loop
    # interleaves their readers.
    whole_chunks = math.ceil(len(long_prompt) / MAX_CHUNK)
    assert num_chunks > 2 * whole_chunks, (num_chunks, len(long_prompt))
    # Prefilled in chunks of changing sizes, the reply is still mlx-lm's own greedy one.
    assert arrival_tokens == await engine.ask(ReferenceGenerate(long_prompt, 8))


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("repeats", [25, 60])  # one chunk; between one and two (a tool result)
async def test_a_short_turn_arriving_while_a_stream_decodes_goes_in_whole_chunks(
    engine: Engine, repeats: int
) -> None:
    """A returning agent's new messages (up to `short_turn_tokens`, here two chunks): the budget
    lets them stall the running streams once a chunk rather than cutting the turn into small ones,
    and that holds in the tick that admits them, before the budget knows their length."""
    counting = list(engine.model.tokenizer.encode(", ".join(str(i) for i in range(1, 21)) + ","))
    short_prompt = chat(engine, f"{uuid.uuid4().hex} " + "Summarise the notes below. " * repeats)
    whole_chunks = math.ceil(len(short_prompt) / MAX_CHUNK)
    assert MAX_CHUNK // 2 < len(short_prompt) <= SHORT_TURN
    runner = engine.submit(GenerationRequest("runner", counting, SamplingParams(max_tokens=2000)))
    async for event in runner:
        if isinstance(event, TokenDelta):
            break  # decoding: the arrival is admitted in a tick whose chunk the budget chose
    arrival = engine.submit(GenerationRequest("arrival", short_prompt, SamplingParams(max_tokens=8)))
    progress = [e async for e in arrival if isinstance(e, PromptProgress)]
    runner.cancel()
    async for _ in runner:
        pass
    num_chunks = len(progress) + 1  # the last chunk ends the prompt and reports no progress
    assert num_chunks == whole_chunks, (
        f"the {len(short_prompt)}-token turn was prefilled in {num_chunks} chunks"
    )
    # in chunks of one size: the streams' longest stall is as short as that many ticks allow
    assert [p.num_processed for p in progress] == [
        math.ceil(len(short_prompt) / whole_chunks) * (i + 1) for i in range(len(progress))
    ]
