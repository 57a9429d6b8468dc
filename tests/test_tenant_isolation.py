"""Nothing crosses a tenant boundary (issue 78): with a keys file that keeps namespaces apart, the
caches of derived data (tokenizer segments, compiled grammars) are scoped like the KV blocks, and
one tenant's `cache_control` pins never take another's. Cache behaviour is read from the caches'
own hit and miss counts (the stand-in for timing), on a real server with the default model's
tokenizer and the tiny random-weight Llama (the words do not matter; the caches are the same)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import mlx.core as mx
import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from semantic.actors.system import SystemConfig
from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.cache_store.eviction import EvictionPolicy
from semantic.engine.cache_store.prefix_pins import CachePin
from semantic.engine.loop.config import EngineConfig
from semantic.protocols.app import create_app
from semantic.protocols.common import SYSTEM_KEY
from semantic.protocols.settings import load_settings
from tests.server_process import ServerProcess
from tests.test_tenancy import ALICE, BOB, keys_file

BLOCK_SIZE = 16
MAX_PROMPT_TOKENS = 1024  # a longer prompt is refused after it is tokenized


# ---- an in-process server (so the test reads the caches' counts), on its own loop thread ----


@dataclass
class LiveServer:
    base_url: str
    app: web.Application

    def counts(self) -> tuple[int, int, int, int]:
        """Hits and misses of the tokenizer's segment cache, then of the compiled grammars."""
        session = self.app[SYSTEM_KEY].models.session
        assert session is not None, "the model is loaded before the server listens"
        encoder, grammars = session.chat.encoder, session.grammars
        return (
            encoder.num_cache_hits,
            encoder.num_cache_misses,
            grammars.num_cache_hits,
            grammars.num_cache_misses,
        )

    def post(self, path: str, body: dict[str, Any], key: str, headers: dict[str, str] | None = None) -> Reply:
        sent = {"content-type": "application/json", "x-api-key": key, **(headers or {})}
        request = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), method="POST", headers=sent
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return Reply(reply.status, json.loads(reply.read()), dict(reply.headers))
        except urllib.error.HTTPError as error:
            return Reply(error.code, json.loads(error.read()), dict(error.headers))


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]

    def observed(self) -> dict[str, Any]:
        """What the caller sees that is not the model's text: status, prompt usage, our headers."""
        usage = {
            k: v
            for k, v in (self.body.get("usage") or {}).items()
            if "output" not in k and "completion" not in k
        }
        usage.pop("total_tokens", None)
        ours = {k.lower(): v for k, v in self.headers.items() if k.lower().startswith("x-semantic")}
        return {"status": self.status, "usage": usage, "headers": ours}


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    base = tmp_path_factory.mktemp("isolation")
    keys = keys_file(base / "keys.toml")
    engine = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, cache_budget_mb=256)
    config = SystemConfig(engine=engine, cache_dir=base / "cache", max_prompt_tokens=MAX_PROMPT_TOKENS)
    app = create_app(
        config, load_settings({"server.api_keys_file": str(keys)}, environ={}, dotenv=None).settings
    )
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[BaseTestServer] = loop.create_future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with TestServer(app, host="127.0.0.1") as server:
            ready.set_result(server)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(ready), 300), loop).result()
    yield LiveServer(str(server.make_url("")).rstrip("/"), app)
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=120)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0, **extra}


def since(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(before, after, strict=True))


def test_bob_tokenizes_a_text_alice_sent_as_a_miss_in_his_scope(live_server: LiveServer) -> None:
    """Today's main: alice's texts came out of the shared segment cache for bob (a fast tokenize),
    even where her request was refused for its length after tokenizing."""
    server = live_server
    for key in (ALICE, BOB):  # each scope has the template's markers cached
        assert server.post("/v1/chat/completions", chat("Hi."), key).status == 200
    secret = "The merger with Northwind closes on the ninth. " * 6
    before = server.counts()
    assert server.post("/v1/chat/completions", chat(secret), ALICE).status == 200
    alices = since(before, server.counts())
    before = server.counts()
    assert server.post("/v1/chat/completions", chat(secret), BOB).status == 200
    assert since(before, server.counts()) == alices  # as new to bob as it was to alice
    before = server.counts()
    assert server.post("/v1/chat/completions", chat(secret), ALICE).status == 200
    assert since(before, server.counts())[0] > alices[0]  # while alice's scope has it

    refused = "Draft terms: " + " ".join(f"clause {i} stays sealed" for i in range(400))
    before = server.counts()
    assert server.post("/v1/chat/completions", chat(refused), ALICE).status == 400  # too long, once counted
    alices = since(before, server.counts())
    before = server.counts()
    assert server.post("/v1/chat/completions", chat(refused), BOB).status == 400
    assert since(before, server.counts()) == alices


# ---- bob's requests read the same whether or not alice sent the same text first ----

_numbers = itertools.count(10_000_000)


def nonce() -> str:
    return str(next(_numbers))  # digits: each is its own token, so two nonces encode to as many


def bob_request(kind: str, label: str, body_text: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """One of the requests bob may send, about `label` (what differs between the two worlds)."""
    text = f"Case {label}: {body_text}"
    if kind == "chat":
        return "/v1/chat/completions", chat(text), {}
    if kind == "schema":
        schema = {
            "type": "object",
            "properties": {f"k{label}": {"type": "integer"}},
            "required": [f"k{label}"],
        }
        format_ = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        return "/v1/chat/completions", chat(text, response_format=format_), {}
    if kind == "continuation":  # an anonymous conversation's next turn, matched by its content
        messages = [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "And then?"},
        ]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0}, {}
    body = {
        "system": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 1,
        "temperature": 0,
    }
    headers = {"x-claude-code-session-id": f"session-{label}"} if kind == "agent" else {}
    return "/v1/messages", body, headers


def send(server: LiveServer, key: str, kind: str, label: str, body_text: str) -> Reply:
    path, body, headers = bob_request(kind, label, body_text)
    if kind == "continuation":  # the first turn, which the continuation then matches
        server.post(path, {**body, "messages": body["messages"][:1]}, key, headers)
    return server.post(path, body, key, headers)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["chat", "schema", "continuation", "pinned", "agent"]),
    body_text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40).map(
        lambda t: t + " Rules follow. " * 3
    ),
    seen_first=st.booleans(),
)
def test_what_bob_sees_does_not_depend_on_what_alice_sent(
    live_server: LiveServer, kind: str, body_text: str, seen_first: bool
) -> None:
    """Bob sends `T`, which alice sent first, and `T2`, as long, which nobody sent: his usage, our
    headers and his caches' hit and miss counts are the same (in either order)."""
    server = live_server
    sent, fresh = nonce(), nonce()
    send(server, BOB, kind, nonce(), body_text)  # what every request of the kind shares is warm for bob
    send(server, ALICE, kind, sent, body_text)
    observed: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {}
    for label in (sent, fresh) if seen_first else (fresh, sent):
        path, body, headers = bob_request(kind, label, body_text)
        before = server.counts()
        reply = server.post(path, body, BOB, headers)
        observed[label] = (reply.observed(), since(before, server.counts()))
    assert observed[sent] == observed[fresh]


# ---- pins: a real store and pool, as tests/test_agent_retention.py builds them ----

LAYERS, HEADS, HEAD_DIM = 2, 2, 16
ALICE_SALT, BOB_SALT = "alice\0", "bob\0"  # as protocols/tenancy.py scopes each namespace's turns


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(num_blocks: int, policy: EvictionPolicy) -> AgentCacheStore:
    spec = ModelCacheSpec(LAYERS, HEADS, HEAD_DIM, "float16", (LayerKind.FULL,) * LAYERS, None, BLOCK_SIZE)
    pool = BlockPool(num_blocks, BLOCK_SIZE, spec.bytes_per_block)
    return AgentCacheStore(spec, pool, lambda: [KVCache() for _ in range(LAYERS)], policy=policy)


def _file(store: AgentCacheStore, agent_id: str, tokens: list[int], salt: str) -> None:
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        keys, values = (mx.random.normal((1, HEADS, len(tokens), HEAD_DIM)).astype(mx.float16) for _ in "kv")
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    store.store(agent_id, tokens, caches, [], salt=salt)


def _pinned_blocks(store: AgentCacheStore, salt: str) -> int:
    return len({b for pin in store.pins.held.values() if pin.salt == salt for b in pin.block_ids})


def test_bobs_pins_never_take_alices_and_hold_at_most_his_share() -> None:
    store = _store(64, EvictionPolicy(pinned_share=0.25, clock=Clock()))  # a pin room of 16 blocks
    alices = list(range(8 * BLOCK_SIZE + 3))
    _file(store, "alice~a", alices, ALICE_SALT)
    store.note_pins(alices, (CachePin(8 * BLOCK_SIZE, 300.0),), ALICE_SALT)
    assert store.pins.is_pinned(alices[: 8 * BLOCK_SIZE], ALICE_SALT)
    for n in range(3):
        bobs = list(range(1000 * (n + 1), 1000 * (n + 1) + 6 * BLOCK_SIZE))
        _file(store, f"bob~{n}", bobs, BOB_SALT)
        store.note_pins(bobs, (CachePin(6 * BLOCK_SIZE, 300.0),), BOB_SALT)
        assert store.pins.is_pinned(alices[: 8 * BLOCK_SIZE], ALICE_SALT), n
        assert store.pins.is_pinned(bobs, BOB_SALT)  # his newest, in place of his own older ones
        assert _pinned_blocks(store, BOB_SALT) <= 16 // 2
    assert store.pins.num_pinned_blocks <= 16


def test_the_pools_pressure_takes_the_largest_holders_pins_first() -> None:
    """Bob's load on the pool drops his own pins while he holds more than alice."""
    store = _store(128, EvictionPolicy(pinned_share=0.5, clock=Clock()))  # a pin room of 64 blocks
    alices = list(range(4 * BLOCK_SIZE))
    _file(store, "alice~a", alices, ALICE_SALT)
    store.note_pins(alices, (CachePin(4 * BLOCK_SIZE, 300.0),), ALICE_SALT)
    for n in range(3):
        bobs = list(range(1000 * (n + 1), 1000 * (n + 1) + 5 * BLOCK_SIZE))
        _file(store, f"bob~{n}", bobs, BOB_SALT)
        store.note_pins(bobs, (CachePin(5 * BLOCK_SIZE, 300.0),), BOB_SALT)
    assert _pinned_blocks(store, BOB_SALT) == 15
    order = [store.pins.held[key].salt for key in store.pins.drop_order()]
    assert order == [BOB_SALT, BOB_SALT, BOB_SALT, ALICE_SALT]  # bob's 5 > alice's 4 until his last
    while store.pins.held and store.pins.drop():
        if _pinned_blocks(store, BOB_SALT) > 0:
            assert store.pins.is_pinned(alices, ALICE_SALT)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([ALICE_SALT, BOB_SALT, "carol\0x"]), st.integers(1, 10)), max_size=12)
)
def test_a_pin_is_only_ever_let_go_by_its_own_tenant(steps: list[tuple[str, int]]) -> None:
    store = _store(96, EvictionPolicy(pinned_share=0.25, clock=Clock()))  # a pin room of 24 blocks
    for n, (salt, num_blocks) in enumerate(steps):
        tokens = list(range(10_000 * (n + 1), 10_000 * (n + 1) + num_blocks * BLOCK_SIZE))
        held_before = {key: pin.salt for key, pin in store.pins.held.items()}
        _file(store, f"agent-{n}", tokens, salt)
        store.note_pins(tokens, (CachePin(num_blocks * BLOCK_SIZE, 300.0),), salt)
        lost = {owner for key, owner in held_before.items() if key not in store.pins.held}
        taken = {pin.salt for key, pin in store.pins.held.items() if key not in held_before}
        assert lost <= taken | {salt}, (lost, salt)  # a waiting pin, once held, replaces its owner's
        assert store.pins.num_pinned_blocks <= 24
        owners = {pin.salt for pin in store.pins.held.values()}
        if store.pins.is_pinned(tokens, salt):  # taken within its share (an older pin may hold more
            assert _pinned_blocks(store, salt) <= 24 // max(1, len(owners))  # from before others came)


# ---- through the server, with the anthropic SDK and two keys ----


def test_alices_pinned_prefix_is_still_read_after_bob_pins_several(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    keys = keys_file(tmp_path / "keys.toml")
    # The tiny model's blocks are small: this budget holds about as few of them as 64 MiB holds of the
    # default model's, so a few prompts cycle the pool.
    args = ("--model", str(tiny_llama_dir), "--block-size", str(BLOCK_SIZE), "--cache-budget-mb", "3")
    server = ServerProcess(tmp_path / "cache", *args, "--api-keys-file", str(keys)).start()
    try:
        found = re.search(r"pool (\d+) blocks", server.log())
        assert found, "the server logs its pool's size"
        room = int(found.group(1)) * 0.25  # the default cache.pinned_share
        alice = anthropic.Anthropic(base_url=server.base_url, api_key=ALICE)
        bob = anthropic.Anthropic(base_url=server.base_url, api_key=BOB)

        def ask(client: anthropic.Anthropic, system: str, pin: bool = True) -> anthropic.types.Usage:
            block: dict[str, Any] = {"type": "text", "text": system}
            if pin:
                block["cache_control"] = {"type": "ephemeral"}
            reply = client.messages.create(
                model="default",
                max_tokens=1,
                system=[block],  # type: ignore[list-item]
                messages=[{"role": "user", "content": "Hi."}],
            )
            return reply.usage

        def words(topic: str, num_words: int) -> str:
            return f"{topic}: " + " ".join(f"w{i % 10}" for i in range(num_words))

        pinned, unpinned = words("Alice's handbook", 70), words("Alice's notes", 70)
        assert (ask(alice, pinned).cache_creation_input_tokens or 0) >= 128
        ask(alice, unpinned, pin=False)
        # Bob pins prefixes of nearly half the room each: two of them and alice's overfill it.
        bob_words = int((room // 2 - 1) * BLOCK_SIZE) // 2 - 8
        for n in range(3):
            assert (ask(bob, words(f"Bob's manual {n}", bob_words)).cache_creation_input_tokens or 0) > 0
        for n in range(8):  # load that cycles the pool, so only a pin keeps a prefix
            ask(bob, words(f"Bob's filler {n}", int(room) * BLOCK_SIZE // 2), pin=False)
        assert (ask(alice, unpinned, pin=False).cache_read_input_tokens or 0) == 0  # the load took it
        assert (ask(alice, pinned).cache_read_input_tokens or 0) >= 128
    finally:
        server.stop()
