"""Who is calling: API keys, the namespace each key's agents live in, and the cache salt of a turn.

With `server.api_keys_file` every key maps to a namespace. The edge (here) folds the namespace into
every agent id a request names, so one key can neither see, extend, evict nor delete another key's
agents, and roots each turn's prefix-block hash chain in the namespace (unless the operator lets
namespaces share blocks), so `cached_tokens` never tells one key what another sent. Clients only
ever send and see their own ids. With `server.api_key` there is one key and one namespace, as with
no key at all.

The keys file (TOML):

    share_prefix_blocks = false    # true: namespaces share prefix KV blocks (faster, but leaks
                                   # through cached_tokens whether another key sent a prefix)
    admin = ["alice"]              # namespaces whose keys may load and unload models (/admin)
    [keys]
    "sk-alice-6f1c0e9b2d7a4c85" = "alice"
    "sk-bob-0d93b1f7a2e64c18" = "bob"
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from aiohttp import web
from loguru import logger

from semantic.actors.interface import NAMESPACE_PATTERN, AgentId, agent_id_from
from semantic.protocols.errors import Forbidden, Unauthorized
from semantic.protocols.settings import ServerSection

MAX_CACHE_SALT_LENGTH = 256
# The `cache_salt` request field (as in vLLM): requests share prefix blocks only with the same salt.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)]
_API_KEY = re.compile(r"[\x21-\x7e]{16,512}")  # printable ASCII: it must fit in a header as sent


class KeysFileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Tenant:
    namespace: str
    isolates_prefix_blocks: bool
    is_admin: bool = False  # may load and unload models, which drains every namespace's requests


TENANT_KEY = web.RequestKey("tenant", Tenant)


class _KeysFile(msgspec.Struct, forbid_unknown_fields=True):
    keys: dict[str, str]
    share_prefix_blocks: bool = False
    admin: list[str] = msgspec.field(default_factory=list)


class Tenancy:
    """API key -> tenant (None: the single namespace of `server.api_key`), compared in constant time."""

    def __init__(self, key_to_tenant: dict[str, Tenant | None]) -> None:
        self._digest_to_tenant = [(_digest(key), tenant) for key, tenant in key_to_tenant.items()]

    @classmethod
    def from_settings(cls, server: ServerSection) -> Tenancy | None:
        """None when the server needs no key."""
        if server.api_keys_file is not None:
            return cls.from_file(Path(server.api_keys_file))
        if server.api_key is not None:
            return cls({server.api_key: None})
        return None

    @classmethod
    def from_file(cls, path: Path) -> Tenancy:
        """Read and check a keys file; raises KeysFileError saying what is wrong (never a key)."""
        usage = (
            'expected `share_prefix_blocks = true|false`, `admin = ["namespace", ...]` and a [keys] '
            'table of "KEY" = "namespace"'
        )
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise KeysFileError(f"cannot read the API keys file {path}: {error}") from None
        keys = data.get("keys")
        for setting in ("share_prefix_blocks", "admin"):
            if isinstance(keys, dict) and setting in keys:
                raise KeysFileError(f"API keys file {path}: {setting} must come before [keys]")
        try:
            parsed = msgspec.convert(data, _KeysFile)
        except msgspec.ValidationError as error:
            raise KeysFileError(f"API keys file {path}: {error}; {usage}") from None
        if not parsed.keys:
            raise KeysFileError(f"API keys file {path} has no keys; {usage}")
        for number, (key, namespace) in enumerate(parsed.keys.items(), 1):
            if not _API_KEY.fullmatch(key):
                raise KeysFileError(
                    f"API keys file {path}: key #{number} ({len(key)} characters): a key must be "
                    "16 to 512 printable ASCII characters without spaces"
                )
            if not NAMESPACE_PATTERN.fullmatch(namespace):
                raise KeysFileError(
                    f"API keys file {path}: key #{number} has namespace {namespace[:40]!r}: use 1 to 32 "
                    "letters, digits, '-' or '_', not starting with '-'"
                )
        unknown = sorted(set(parsed.admin) - set(parsed.keys.values()))
        if unknown:
            raise KeysFileError(f"API keys file {path}: admin names {unknown[0]!r}, which no key has")
        if path.stat().st_mode & 0o077:
            logger.warning("API keys file {} is readable by other users; chmod 600 it", path)
        isolates, admins = not parsed.share_prefix_blocks, set(parsed.admin)
        return cls(
            {key: Tenant(namespace, isolates, namespace in admins) for key, namespace in parsed.keys.items()}
        )

    def tenant_of(self, given: str) -> Tenant | None:
        """The tenant of an API key as sent; raises Unauthorized for no key or an unknown one."""
        digest = _digest(given)
        found, tenant = False, None
        for candidate, candidate_tenant in self._digest_to_tenant:  # no early exit: constant time
            if hmac.compare_digest(digest, candidate):
                found, tenant = True, candidate_tenant
        if not found:
            what = "an invalid API key" if given else "no API key"
            raise Unauthorized(
                f"this server needs an API key and the request has {what}; send it as "
                "`x-api-key: KEY` or `Authorization: Bearer KEY`"
            )
        return tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# ---- the edge: what handlers call to turn a client's ids and salt into the caller's ----


def is_admin(request: web.Request) -> bool:
    """Whether the caller may act on the whole server: with a keys file, the namespaces it lists
    under `admin`; without one, every caller (one key or none: one namespace)."""
    tenant = request.get(TENANT_KEY)
    return tenant is None or tenant.is_admin


def require_admin(request: web.Request, act: str = "load or unload models") -> None:
    """Acts on the whole server (loading and unloading models drains every namespace's requests;
    metrics show every namespace's activity): with a keys file, only admin keys (403 for others)."""
    tenant = request.get(TENANT_KEY)
    if tenant is not None and not tenant.is_admin:
        raise Forbidden(
            f"namespace {tenant.namespace!r} may not {act}; the API keys file's `admin` lists the "
            "namespaces that may"
        )


def namespace_of(request: web.Request) -> str | None:
    tenant = request.get(TENANT_KEY)
    return tenant.namespace if tenant is not None else None


def client_agent_id(request: web.Request, value: str) -> AgentId:
    """An agent id a client sent (path or body), in the caller's namespace."""
    return AgentId.from_client(value, namespace_of(request))


def request_agent_id(request: web.Request, body_session_id: str | None = None) -> AgentId | None:
    """The agent id a request's headers (or body `session_id`) name, in the caller's namespace."""
    return agent_id_from(request.headers, body_session_id, namespace_of(request))


def is_visible(request: web.Request, agent_id: str) -> bool:
    """Whether the caller's namespace holds this agent (ids without one: callers without one)."""
    return AgentId(agent_id).namespace == namespace_of(request)


def scoped_cache_salt(request: web.Request, requested: str | None) -> str | None:
    """The salt a turn's prefix blocks are filed under: the client's `cache_salt`, within the
    caller's namespace unless the operator lets namespaces share blocks."""
    tenant = request.get(TENANT_KEY)
    if tenant is None or not tenant.isolates_prefix_blocks:
        return requested
    return f"{tenant.namespace}\0{requested or ''}"  # a namespace never holds NUL: no collisions
