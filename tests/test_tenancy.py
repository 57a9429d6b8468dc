"""Tenancy on a real server: one namespace of agents per API key, and prefix sharing scoped by
namespace and by `cache_salt`; the keys file checked at start-up; salted hashes never collide.

The servers run the tiny random-weight Llama: what is checked is whose agents, blocks and cached
tokens a key reaches, not the words."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semantic import cli
from semantic.engine.cache_store.block_pool import BlockPool, hash_prefix_blocks
from semantic.protocols.settings import load_settings
from tests.server_process import ServerProcess

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-fedcba9876543210"
BLOCK_SIZE = 16  # small blocks: a short prompt already fills a few


def keys_file(path: Path, share_prefix_blocks: bool = False) -> Path:
    path.write_text(
        f"share_prefix_blocks = {str(share_prefix_blocks).lower()}\n"
        'admin = ["alice"]\n'
        f'[keys]\n"{ALICE}" = "alice"\n"{BOB}" = "bob"\n'
    )
    path.chmod(0o600)
    return path


def server_args(model_dir: Path, keys: Path) -> tuple[str, ...]:
    return (
        "--model",
        str(model_dir),
        "--block-size",
        str(BLOCK_SIZE),
        "--cache-budget-mb",
        "256",
        "--api-keys-file",
        str(keys),
    )


def api(
    server: ServerProcess,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    key: str | None = ALICE,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    sent = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        sent["x-api-key"] = key
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def listed_ids(server: ServerProcess, key: str) -> list[str]:
    status, listing = api(server, "GET", "/v1/agents", key=key)
    assert status == 200, listing
    return [agent["id"] for agent in listing["data"]]


def agent_turn(server: ServerProcess, agent: str, content: str, key: str, **extra: Any) -> dict[str, Any]:
    body = {"content": content, "max_tokens": 4, "temperature": 0, **extra}
    status, result = api(server, "POST", f"/v1/agents/{agent}/messages", body, key=key)
    assert status == 200, result
    return result  # type: ignore[no-any-return]


def chat_cached_tokens(server: ServerProcess, system: str, key: str, **extra: Any) -> int:
    """An OpenAI request without an agent id: how many prompt tokens came from the cache."""
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }
    status, reply = api(server, "POST", "/v1/chat/completions", body, key=key)
    assert status == 200, reply
    cached: int = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def messages_cached_tokens(
    server: ServerProcess, system: str, key: str, headers: dict[str, str] | None = None, **extra: Any
) -> int:
    body = {
        "system": system,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }
    status, reply = api(server, "POST", "/v1/messages", body, key=key, headers=headers)
    assert status == 200, reply
    cached: int = reply["usage"]["cache_read_input_tokens"]
    return cached


def long_system(topic: str) -> str:
    """A system prompt that starts with `topic` (so no two tests share a first block) and fills
    several blocks."""
    return f"{topic}. " + "You answer briefly, in plain words, and you never invent facts. " * 4


TERSE = {"system": long_system("You are terse")}


@pytest.fixture(scope="module")
def keyed_server(
    tiny_llama_dir: Path, tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("tenancy")
    server = ServerProcess(
        base / "cache",
        *server_args(tiny_llama_dir, keys_file(base / "keys.toml")),
        "--add-model",
        f"tiny={tiny_model_dirs['qwen2']}",
    ).start()
    yield server
    server.stop()


def test_a_key_never_sees_extends_evicts_or_deletes_another_keys_agent(keyed_server: ServerProcess) -> None:
    server = keyed_server
    status, created = api(server, "POST", "/v1/agents", {"id": "twin", **TERSE}, key=ALICE)
    assert status == 201 and created["id"] == "twin"
    first = agent_turn(server, "twin", "My name is Ada.", ALICE)
    history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]

    assert "twin" not in listed_ids(server, BOB)
    assert api(server, "GET", "/v1/agents/twin", key=BOB)[0] == 404
    status, refused = api(server, "DELETE", "/v1/agents/twin", key=BOB)
    assert status == 404 and refused["error"]["message"] == "no agent twin"  # the id as sent
    assert api(server, "POST", "/v1/agents/twin/evict", key=BOB) == (200, {"id": "twin", "evicted": False})

    # Bob's "twin" is a new agent: same system prompt, but neither Ada's history nor her blocks.
    assert api(server, "POST", "/v1/agents", {"id": "twin", **TERSE}, key=BOB)[0] == 201
    bobs = agent_turn(server, "twin", "What is my name?", BOB)
    assert bobs["agent_id"] == "twin" and bobs["usage"]["cached_tokens"] == 0
    # ... as a new agent of Alice's gets it, except that hers shares her first agent's blocks.
    assert api(server, "POST", "/v1/agents", {"id": "fresh", **TERSE}, key=ALICE)[0] == 201
    fresh = agent_turn(server, "fresh", "What is my name?", ALICE)
    assert bobs["usage"]["prompt_tokens"] == fresh["usage"]["prompt_tokens"]
    assert fresh["usage"]["cached_tokens"] >= BLOCK_SIZE

    status, info = api(server, "GET", "/v1/agents/twin", key=ALICE)
    assert status == 200 and info["id"] == "twin" and info["tier"] == "memory"
    assert info["cached_tokens"] >= history - 1
    assert api(server, "DELETE", "/v1/agents/twin", key=BOB) == (200, {"id": "twin", "deleted": True})
    assert "twin" not in listed_ids(server, BOB) and "twin" in listed_ids(server, ALICE)

    # Alice's agent went to disk under a namespaced, valid file name and resumes from there.
    assert api(server, "POST", "/v1/agents/twin/evict", key=ALICE)[1]["evicted"] is True
    assert [p.name for p in server.cache_dir.glob("agents/*/*twin.safetensors")] == ["alice~twin.safetensors"]
    second = agent_turn(server, "twin", "What is my name?", ALICE)
    assert second["usage"]["cache_tier"] == "disk" and second["usage"]["cached_tokens"] >= history - 1
    assert all("~" not in agent_id for agent_id in listed_ids(server, ALICE) + listed_ids(server, BOB))


def test_a_claude_code_session_is_per_key(keyed_server: ServerProcess) -> None:
    system = long_system("Session notes for the harbour project")
    session = {"x-claude-code-session-id": "cc-session-1"}
    assert messages_cached_tokens(keyed_server, system, ALICE, headers=session) == 0
    # Bob naming Alice's session neither extends her cache nor reads her prefix blocks.
    assert messages_cached_tokens(keyed_server, system, BOB, headers=session) == 0
    assert messages_cached_tokens(keyed_server, system, ALICE, headers=session) >= BLOCK_SIZE


def test_cached_tokens_never_show_another_namespaces_prefix(keyed_server: ServerProcess) -> None:
    system = long_system("Quarterly figures of the lighthouse fund")
    assert chat_cached_tokens(keyed_server, system, ALICE) == 0
    assert chat_cached_tokens(keyed_server, system, BOB) == 0
    assert chat_cached_tokens(keyed_server, system, ALICE) >= BLOCK_SIZE  # it is cached, for Alice
    # (named agents sharing only a prefix: the first test)


def test_cache_salt_scopes_prefix_sharing_on_every_api(keyed_server: ServerProcess) -> None:
    chat = long_system("Salted chat about tide tables")
    assert chat_cached_tokens(keyed_server, chat, ALICE, cache_salt="s1") == 0
    assert chat_cached_tokens(keyed_server, chat, ALICE, cache_salt="s2") == 0
    assert chat_cached_tokens(keyed_server, chat, ALICE) == 0  # no salt is a scope of its own
    assert chat_cached_tokens(keyed_server, chat, ALICE, cache_salt="s1") >= BLOCK_SIZE

    messages = long_system("Salted messages about river locks")
    assert messages_cached_tokens(keyed_server, messages, ALICE, cache_salt="s1") == 0
    assert messages_cached_tokens(keyed_server, messages, ALICE, cache_salt="s2") == 0
    assert messages_cached_tokens(keyed_server, messages, ALICE, cache_salt="s1") >= BLOCK_SIZE

    system = {"system": long_system("Salted agents about canal boats")}
    for agent in ("salt-a", "salt-b", "salt-c"):
        assert api(keyed_server, "POST", "/v1/agents", {"id": agent, **system})[0] == 201
    assert agent_turn(keyed_server, "salt-a", "Hi.", ALICE, cache_salt="s1")["usage"]["cached_tokens"] == 0
    assert agent_turn(keyed_server, "salt-b", "Hi.", ALICE, cache_salt="s2")["usage"]["cached_tokens"] == 0
    assert agent_turn(keyed_server, "salt-c", "Hi.", ALICE, cache_salt="s1")["usage"]["cached_tokens"] > 0


@pytest.mark.parametrize("salt", ["", "s" * 257, 5])
def test_a_bad_cache_salt_is_a_400_in_each_apis_shape(keyed_server: ServerProcess, salt: object) -> None:
    user = [{"role": "user", "content": "Hi"}]
    status, body = api(keyed_server, "POST", "/v1/chat/completions", {"messages": user, "cache_salt": salt})
    assert status == 400 and "cache_salt" in body["error"]["message"] and body["error"]["code"] == "400"
    anthropic = {"messages": user, "max_tokens": 2, "cache_salt": salt}
    status, body = api(keyed_server, "POST", "/v1/messages", anthropic)
    assert status == 400 and body["type"] == "error" and "cache_salt" in body["error"]["message"]
    status, body = api(
        keyed_server, "POST", "/v1/agents/salty/messages", {"content": "Hi", "cache_salt": salt}
    )
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "cache_salt" in body["error"]["message"]


def test_no_key_or_an_unknown_key_is_a_401_in_each_apis_shape(keyed_server: ServerProcess) -> None:
    user = [{"role": "user", "content": "Hi"}]
    for key in (None, "sk-nobody-0123456789abcdef"):
        status, body = api(keyed_server, "POST", "/v1/chat/completions", {"messages": user}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, body = api(keyed_server, "POST", "/v1/messages", {"messages": user, "max_tokens": 2}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert api(keyed_server, "GET", "/v1/agents", key=key)[0] == 401
    bearer = {"Authorization": f"Bearer {BOB}"}
    assert api(keyed_server, "GET", "/v1/agents", key=None, headers=bearer)[0] == 200
    with urllib.request.urlopen(f"{keyed_server.base_url}/health/live", timeout=30) as reply:
        assert reply.status == 200


def test_only_admin_namespaces_load_or_unload_models(keyed_server: ServerProcess) -> None:
    """A swap or unload drains every namespace's requests: bob's key may not, alice's (listed
    under `admin`) gets past the check (to a 404 for a model that is not configured)."""
    for path, body in (("/admin/models/unload", None), ("/admin/models/load", {"model": "default"})):
        status, refused = api(keyed_server, "POST", path, body, key=BOB)
        assert status == 403 and refused["error"]["type"] == "permission_error", refused
        assert "namespace 'bob' may not load or unload models" in refused["error"]["message"]
    status, reply = api(keyed_server, "POST", "/admin/models/load", {"model": "no-such-model"}, key=ALICE)
    assert status == 404, reply


def test_a_plain_key_cannot_switch_the_model_through_any_route(keyed_server: ServerProcess) -> None:
    """Today's main: bob's chat request naming another configured model swapped it, and the drain
    cancelled every other namespace's streams. A switch is an admin act whichever route asks."""
    loaded = api(keyed_server, "GET", "/health/ready", key=None)[1]["model"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    attempts = [
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}),
        ("/v1/messages", chat),
        ("/v1/messages/count_tokens", {"model": "tiny", "messages": chat["messages"]}),
        ("/v1/agents", {"id": "switcher", "model": "tiny"}),
    ]
    for path, body in attempts:
        status, refused = api(keyed_server, "POST", path, body, key=BOB)
        assert status == 403, (path, refused)
        assert "may not switch models" in json.dumps(refused), (path, refused)
        assert api(keyed_server, "GET", "/health/ready", key=None)[1]["model"] == loaded
    agent_turn(keyed_server, "bobs-agent", "Hi.", key=BOB)
    status, refused = api(
        keyed_server, "POST", "/v1/agents/bobs-agent/messages", {"content": "Hi.", "model": "tiny"}, key=BOB
    )
    assert status == 403, refused
    # Naming the loaded model is no switch, on any key.
    assert api(keyed_server, "POST", "/v1/chat/completions", {**chat, "model": loaded}, key=BOB)[0] == 200
    assert api(keyed_server, "GET", "/health/ready", key=None)[1]["model"] == loaded


def test_metrics_show_every_namespace_so_only_admin_keys_read_them(keyed_server: ServerProcess) -> None:
    """Today's main: any key read the whole server's activity at /metrics."""
    request = urllib.request.Request(keyed_server.base_url + "/metrics", headers={"x-api-key": BOB})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 403
    request = urllib.request.Request(keyed_server.base_url + "/metrics", headers={"x-api-key": ALICE})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200 and b"semantic_" in reply.read()


def test_shared_prefix_blocks_when_the_operator_allows_and_namespaces_survive_a_restart(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = server_args(tiny_llama_dir, keys_file(tmp_path / "keys.toml", share_prefix_blocks=True))
    server = ServerProcess(tmp_path / "cache", *args).start()
    try:
        system = long_system("Shared manual of the ferry service")
        assert chat_cached_tokens(server, system, ALICE) == 0
        assert chat_cached_tokens(server, system, BOB) >= BLOCK_SIZE  # the operator chose to share
        assert api(server, "POST", "/v1/agents", {"id": "keeper", "system": "Be terse."}, key=ALICE)[0] == 201
        history = agent_turn(server, "keeper", "Remember 42.", ALICE)["usage"]
        assert api(server, "GET", "/v1/agents/keeper", key=BOB)[0] == 404  # agents stay per key
    finally:
        assert server.stop() == 0

    restarted = ServerProcess(tmp_path / "cache", *args).start()
    try:
        assert listed_ids(restarted, ALICE) == ["keeper"] and listed_ids(restarted, BOB) == []
        resumed = agent_turn(restarted, "keeper", "What did I ask you to remember?", ALICE)["usage"]
        assert resumed["cache_tier"] == "disk"
        assert resumed["cached_tokens"] >= history["prompt_tokens"] + history["completion_tokens"] - 1
    finally:
        restarted.stop()


# ---- start-up: the keys file and the API key are checked before anything loads ----


def check_startup(tmp_path: Path, **server: Any) -> str:
    """The start-up checks' refusal for these `server.*` settings ("" if accepted)."""
    settings = load_settings({f"server.{k}": v for k, v in server.items()}, environ={}, dotenv=None).settings
    try:
        cli._check_bind(settings)
    except SystemExit as refusal:
        return str(refusal.code)
    return ""


@pytest.mark.parametrize(
    ("content", "refusal"),
    [
        (None, "cannot read the API keys file"),
        ("[keys\n", "cannot read the API keys file"),
        ('share = true\n[keys]\n"sk-alice-0123456789abcdef" = "alice"\n', "unknown field `share`"),
        ('[keys]\n"sk-alice-0123456789abcdef" = "alice"\nshare_prefix_blocks = true\n', "before [keys]"),
        ("keys = 3\n", "Expected `object`"),
        ('share_prefix_blocks = "yes"\n[keys]\n"sk-alice-0123456789abcdef" = "a"\n', "Expected `bool`"),
        ("[keys]\n", "has no keys"),
        ('[keys]\n"short" = "alice"\n', "key #1 (5 characters)"),
        ('[keys]\n"sk-alice-0123456789abcdef" = "al ice"\n', "has namespace 'al ice'"),
        ('[keys]\n"sk-alice-0123456789abcdef" = "~x"\n', "has namespace '~x'"),
        ('[keys]\n"sk-alice-0123456789abcdef" = 3\n', "Expected `str`"),
        (
            'admin = ["bob"]\n[keys]\n"sk-alice-0123456789abcdef" = "alice"\n',
            "admin names 'bob', which no key",
        ),
        (
            '[keys]\n"sk-alice-0123456789abcdef" = "alice"\nadmin = ["alice"]\n',
            "admin must come before [keys]",
        ),
    ],
)
def test_a_bad_keys_file_stops_the_server_at_start_up(
    tmp_path: Path, content: str | None, refusal: str
) -> None:
    path = tmp_path / "keys.toml"
    if content is not None:
        path.write_text(content)
    message = check_startup(tmp_path, api_keys_file=str(path))
    assert refusal in message and "0123456789abcdef" not in message  # never echoes a key


def test_start_up_refuses_an_empty_api_key_and_two_kinds_of_keys(tmp_path: Path) -> None:
    keys = keys_file(tmp_path / "keys.toml")
    assert "refusing an empty API key" in check_startup(tmp_path, api_key="")
    assert "refusing an empty API key" in check_startup(tmp_path, api_key="  ")
    assert "not both" in check_startup(tmp_path, api_key="k" * 20, api_keys_file=str(keys))
    assert check_startup(tmp_path, api_keys_file=str(keys)) == ""
    remote = {"host": "0.0.0.0", "allow_remote": True}
    assert check_startup(tmp_path, api_keys_file=str(keys), **remote) == ""  # a keys file is a key


def test_the_real_cli_exits_on_a_bad_keys_file(tmp_path: Path) -> None:
    (tmp_path / "keys.toml").write_text("[keys]\n")
    server = ServerProcess(tmp_path / "cache", "--api-keys-file", str(tmp_path / "keys.toml"))
    with pytest.raises(RuntimeError, match="has no keys"):
        server.start(timeout=60)


# ---- the engine: salted chains ----

salts = st.none() | st.text(max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=4, max_size=24),
    salt_a=salts,
    salt_b=salts,
)
def test_salted_chained_hashes_never_collide_across_salts(
    tokens: list[int], salt_a: str | None, salt_b: str | None
) -> None:
    hashes_a = hash_prefix_blocks(tokens, 4, salt_a)
    hashes_b = hash_prefix_blocks(tokens, 4, salt_b)
    if salt_a == salt_b:
        assert hashes_a == hashes_b
        return
    assert not set(hashes_a) & set(hashes_b)
    # and a pool holding the blocks under one salt serves none of them under the other
    pool = BlockPool(len(hashes_a), 4)
    for index, (block_id, block_hash) in enumerate(zip(pool.allocate(len(hashes_a)), hashes_a, strict=True)):
        pool.cache_full_block(block_id, block_hash, tokens[index * 4 : (index + 1) * 4], payload=None)
    assert all(
        pool.get_cached_block(block_hash, tokens[index * 4 : (index + 1) * 4]) is None
        for index, block_hash in enumerate(hashes_b)
    )
