"""Retention that knows agents (issue 68): superseded states go first, a prefix a running sub-agent
shares with its parent outlives idle agents, and `cache_control` pins hold their prefix for their
ttl (on the policy's injected clock, never a sleep) and then lapse, within their share of the pool;
Anthropic's usage reports pinned prefixes as cache writes, then reads."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import load as load_tokenizer

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.prompting.prompt_pins import CacheBreakpoint, prompt_pins
from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.cache_store.eviction import EvictionPolicy, IdleCache
from semantic.engine.cache_store.prefix_pins import CachePin
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import Submit
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.messages import EventChannel, Finished, GenerationRequest
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.protocols.anthropic_wire import chat_and_breakpoints, decode_request
from tests.server_process import ServerProcess


class Clock:
    """The policy's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# The policy alone.


def test_superseded_go_first_and_caches_a_running_one_started_from_go_last() -> None:
    caches = [
        IdleCache("parent", last_used=1.0, is_shared_by_running=True),
        IdleCache("idle-a", last_used=2.0),
        IdleCache("old-copy", last_used=5.0, is_superseded=True),
        IdleCache("idle-b", last_used=3.0),
    ]
    order = [c.agent_id for c in EvictionPolicy().order_idle(caches)]
    assert order == ["old-copy", "idle-a", "idle-b", "parent"]


@given(st.lists(st.tuples(st.floats(0, 100, allow_nan=False), st.booleans(), st.booleans()), max_size=30))
def test_the_order_is_by_group_then_least_recently_used(facts: list[tuple[float, bool, bool]]) -> None:
    policy = EvictionPolicy()
    caches = [IdleCache(f"a{i}", used, sup, shared) for i, (used, sup, shared) in enumerate(facts)]
    order = policy.order_idle(caches)
    assert sorted(c.agent_id for c in order) == sorted(c.agent_id for c in caches)
    keys = [(policy.retention_rank(c), c.last_used) for c in order]
    assert keys == sorted(keys)
    assert all(policy.retention_rank(c) == 2 for c in order if c.is_shared_by_running)


def test_a_share_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="pinned_share"):
        EvictionPolicy(pinned_share=1.5)


# A real store and pool (random KV), as tests/test_eviction.py builds them.

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 16


def _store(num_blocks: int, policy: EvictionPolicy) -> AgentCacheStore:
    spec = ModelCacheSpec(LAYERS, HEADS, HEAD_DIM, "float16", (LayerKind.FULL,) * LAYERS, None, BLOCK)
    pool = BlockPool(num_blocks, BLOCK, spec.bytes_per_block)
    return AgentCacheStore(spec, pool, lambda: [KVCache() for _ in range(LAYERS)], policy=policy)


def _file(store: AgentCacheStore, agent_id: str, tokens: list[int], used_at: float) -> None:
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        keys, values = (mx.random.normal((1, HEADS, len(tokens), HEAD_DIM)).astype(mx.float16) for _ in "kv")
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    store.store(agent_id, tokens, caches, [])
    store.agents[agent_id].last_used = used_at


def test_a_superseded_copy_goes_before_older_agents() -> None:
    store = _store(16, EvictionPolicy())
    history = list(range(2 * BLOCK + 5))
    _file(store, "other", list(range(500, 500 + BLOCK + 3)), used_at=1.0)
    _file(store, "#anon-0", history, used_at=2.0)  # the conversation before its last turn
    _file(store, "#anon-1", [*history[:-2], *range(900, 900 + BLOCK)], used_at=3.0)
    assert [a.agent_id for a in store.evictable()] == ["#anon-0", "other", "#anon-1"]


def test_a_pin_keeps_its_prefix_past_its_agent_for_its_ttl_then_lapses() -> None:
    clock = Clock()
    store = _store(16, EvictionPolicy(clock=clock))
    prompt = list(range(3 * BLOCK + 4))
    _file(store, "a", prompt, used_at=1.0)
    store.note_pins(prompt, (CachePin(2 * BLOCK + 7, 300.0),), None)
    assert store.pins.num_pinned_blocks == 2  # whole blocks only
    store.evict("a")
    pinned = store.held_block_ids(prompt[: 2 * BLOCK], None)
    assert len(pinned) == 2 and all(store.pool.blocks[b].ref_count == 1 for b in pinned)
    assert store.pool.num_free_blocks == 16 - 2

    clock.now += 299.0
    store.evictable()
    assert store.pool.num_free_blocks == 16 - 2  # still within its ttl
    # A request that starts with the prefix renews it.
    store.note_pins([*prompt[: 2 * BLOCK], 7, 7, 7], (CachePin(2 * BLOCK, 300.0),), None)
    clock.now += 299.0
    store.evictable()
    assert store.pool.num_free_blocks == 16 - 2
    clock.now += 2.0
    store.evictable()
    assert store.pins.num_pinned_blocks == 0 and store.pool.num_free_blocks == 16


def test_pins_hold_at_most_their_share_of_the_pool_the_least_recently_pinned_go() -> None:
    store = _store(16, EvictionPolicy(pinned_share=0.25, clock=Clock()))  # 4 blocks
    first, second, large = (list(range(base, base + 5 * BLOCK)) for base in (0, 1000, 2000))
    for agent_id, tokens in (("first", first), ("second", second), ("large", large)):
        _file(store, agent_id, tokens, used_at=1.0)
    store.note_pins(large, (CachePin(5 * BLOCK, 300.0),), None)
    assert store.pins.num_pinned_blocks == 0  # alone past the share: not pinned
    store.note_pins(first, (CachePin(3 * BLOCK, 300.0),), None)
    store.note_pins(second, (CachePin(3 * BLOCK, 300.0),), None)
    assert store.pins.is_pinned(second[: 3 * BLOCK], None)
    assert not store.pins.is_pinned(first[: 3 * BLOCK], None)
    assert store.pins.num_pinned_blocks == 3


def test_pins_are_dropped_last_to_make_room() -> None:
    store = _store(8, EvictionPolicy(pinned_share=0.5, clock=Clock()))
    prompt = list(range(3 * BLOCK))
    _file(store, "a", prompt, used_at=1.0)
    store.note_pins(prompt, (CachePin(2 * BLOCK, 3600.0),), None)
    assert [s.agent_id for s in store.evict_until(6)] == ["a"]
    assert store.pins.num_pinned_blocks == 2 and store.pool.num_free_blocks == 6
    store.evict_until(8)
    assert store.pins.num_pinned_blocks == 0 and store.pool.num_free_blocks == 8


# A real model's batch, stepped by hand under a small budget (no engine thread, no timing): the tiny
# random-weight Llama's, as what is tested is which blocks stay, not what the model says.


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def small(tiny_llama_dir: Path, loop: asyncio.AbstractEventLoop) -> tuple[ServedModel, Outbox]:
    outbox = Outbox(loop)
    # The tiny Llama in float32: 2.25 KiB of KV a token, so 16-token blocks in 1 MiB make a pool of 28.
    config = EngineConfig(model=str(tiny_llama_dir), block_size=16, cache_budget_mb=1)
    served = ServedModel.load(config.model, None, config, mx.default_stream(mx.cpu), EngineStats(), outbox)
    return served, outbox


def _insert(served: ServedModel, loop: asyncio.AbstractEventLoop, request: GenerationRequest) -> Submit:
    submit = Submit(request, EventChannel(loop))
    needed = served.loaded.spec.num_blocks_for(len(request.prompt_tokens) + request.sampling.max_tokens)
    served.batch.insert(submit, served.pool.allocate(needed))
    return submit


def _request(
    prompt: list[int], max_tokens: int, agent_id: str, banned: tuple[int, ...] = (), **fields: object
) -> GenerationRequest:
    bias = tuple((token_id, -100.0) for token_id in banned)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=bias)
    return GenerationRequest(uuid.uuid4().hex, prompt, sampling, agent_id, **fields)  # type: ignore[arg-type]


def _step(served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop) -> None:
    served.batch.step()
    served.batch.flush()
    served.batch.keep_caches()
    outbox.flush()
    loop.run_until_complete(asyncio.sleep(0))


def _run(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, request: GenerationRequest
) -> None:
    submit = _insert(served, loop, request)
    for _ in range(request.sampling.max_tokens + 4):
        _step(served, outbox, loop)
        if submit.events.done.done():
            assert isinstance(submit.events.done.result(), Finished)
            return
    raise AssertionError("the request did not finish")


def _tokens(served: ServedModel, text: str) -> list[int]:
    return list(served.loaded.tokenizer.encode(text))


def test_a_parents_prefix_a_running_sub_agent_shares_outlives_idle_agents(
    small: tuple[ServedModel, Outbox], loop: asyncio.AbstractEventLoop
) -> None:
    served, outbox = small
    store, pool = served.store, served.pool
    parent_prompt = _tokens(served, "You are the lead engineer. " * 8)[: 3 * 16 + 5]
    _run(served, outbox, loop, _request(parent_prompt, 2, "session"))
    for name in ("idle-a", "idle-b"):  # used after the parent: LRU would evict the parent first
        _run(served, outbox, loop, _request(_tokens(served, f"{name} asks about the weather. " * 3), 2, name))
    assert [a.agent_id for a in store.evictable()] == ["session", "idle-a", "idle-b"]

    # A sub-agent whose prompt starts with the parent's three full blocks, still decoding.
    sub_prompt = [*parent_prompt[: 3 * 16], *_tokens(served, " List three colours.")]
    never_ends = tuple(served.loaded.eos_token_ids)  # it runs its max_tokens
    sub = _insert(served, loop, _request(sub_prompt, 4, "session.a2c5592091ed9f872", never_ends))
    _step(served, outbox, loop)
    assert not sub.events.done.done()
    assert [a.agent_id for a in store.evictable()] == ["idle-a", "idle-b", "session"]

    # Under pressure the idle agents go and the parent stays; even evicted, its prefix would stay.
    evicted = store.evict_until(pool.num_free_blocks + 3)
    assert [s.agent_id for s in evicted] == ["idle-a", "idle-b"]
    assert "session" in store.agents
    store.evict("session")
    shared = store.held_block_ids(parent_prompt, None)
    assert len(shared) == 3 and all(pool.blocks[b].ref_count == 1 for b in shared)  # the sub-agent's

    for _ in range(8):
        if sub.events.done.done():
            break
        _step(served, outbox, loop)
    assert sub.events.done.done()
    assert store.running_shares.tips == set()  # its references went with it


def test_a_cache_control_pin_holds_for_its_ttl_through_the_batch_then_lapses(
    small: tuple[ServedModel, Outbox], loop: asyncio.AbstractEventLoop
) -> None:
    served, outbox = small
    clock = Clock()
    served.store.policy.clock = clock
    store, pool = served.store, served.pool
    prompt = _tokens(served, "You are a careful reviewer of pull requests. " * 10)[: 4 * 16 + 3]
    _run(served, outbox, loop, _request(prompt, 2, "pinned", cache_pins=(CachePin(2 * 16, 300.0),)))
    assert store.pins.is_pinned(prompt[: 2 * 16], None)
    store.evict("pinned")
    refs = [pool.blocks[b].ref_count for b in store.held_block_ids(prompt, None)]
    assert len(refs) == 4 and refs[:2] == [1, 1] and not any(refs[2:])  # the pin's, then free ones
    num_free = pool.num_free_blocks
    clock.now += 301.0
    store.evictable()
    assert not store.pins.held and pool.num_free_blocks == num_free + 2


# Breakpoints: from the wire to the rendered prompt's tokens.


def test_breakpoints_on_system_tools_and_content_blocks_pin_the_prompts_prefixes(
    default_model_dir: Path,
) -> None:
    chat = ChatFormat(load_tokenizer(default_model_dir))
    ephemeral = {"type": "ephemeral"}
    body = decode_request(
        json.dumps(
            {
                "max_tokens": 4,
                "system": [
                    {"type": "text", "text": "You are terse.", "cache_control": ephemeral},
                    {"type": "text", "text": "Answer in English."},
                ],
                "tools": [{"name": "read", "input_schema": {"type": "object"}, "cache_control": ephemeral}],
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "text",
                                "text": "First part.",
                                "cache_control": {**ephemeral, "ttl": "1h"},
                            },
                            {"type": "text", "text": "Second part."},
                        ],
                    }
                ],
            }
        ).encode()
    )
    messages, breakpoints = chat_and_breakpoints(body)
    assert breakpoints == [(0, len("You are terse."), 300.0), (1, 0, 300.0), (1, len("First part."), 3600.0)]
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    text = chat.render(messages, tools)
    token_ids = chat.encode(text, None)
    marks = [CacheBreakpoint(*b) for b in breakpoints]
    pins = prompt_pins(chat, messages, tools, marks, text, token_ids, None)
    assert [p.ttl_s for p in pins] == [300.0, 300.0, 3600.0]
    decoded = [chat.tokenizer.decode(token_ids[: pin.num_tokens]) for pin in pins]
    assert decoded[0].endswith("You are terse.")  # the first system block
    assert "read" in decoded[1] and not decoded[1].endswith("First part.")  # the head, tools in it
    assert decoded[2].endswith("First part.")
    assert "Second part" in chat.tokenizer.decode(token_ids[pins[2].num_tokens :])
    assert pins[0].num_tokens < pins[1].num_tokens < pins[2].num_tokens


# Through the real server with the official SDK.

SYSTEM = "You are a precise assistant for a software team.\n" + "\n".join(
    f"Rule {i}: cite files as src/module_{i}.py and keep answers under three sentences." for i in range(30)
)


def test_usage_reports_a_pinned_prefix_written_then_read(shared_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=shared_server.base_url, api_key="local")
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

    def ask(question: str) -> anthropic.types.Usage:
        reply = client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=4,
            system=system,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": question}],
        )
        return reply.usage

    first = ask("What is 2+2?")
    created = first.cache_creation_input_tokens or 0
    assert created >= 256 and created % 256 == 0, first  # the system turn's whole blocks
    assert (first.cache_read_input_tokens or 0) == 0
    total = first.input_tokens + created
    assert first.input_tokens > 0

    second = ask("Name a prime number.")  # no agent id: another conversation with the same system
    assert (second.cache_creation_input_tokens or 0) == 0, second
    assert (second.cache_read_input_tokens or 0) >= created
    assert second.input_tokens + (second.cache_read_input_tokens or 0) > created
    assert total > created

    plain = client.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=4,
        system=SYSTEM + " Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert (plain.usage.cache_creation_input_tokens or 0) == 0  # no breakpoint, nothing written
