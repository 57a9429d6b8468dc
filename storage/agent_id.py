"""Agent ids: parsed once where a request enters, then trusted everywhere (file names included).

With an API keys file each key's agents live in a namespace: the edge folds the namespace into the
id (`alice~session-1`), so the actors, the engine and storage see distinct agents, while clients
only ever send and see the part after the `~`, which they cannot write themselves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_AGENT_ID_LENGTH = 128
MAX_NAMESPACE_LENGTH = 32
NAMESPACE_SEPARATOR = "~"
_CLIENT_ID = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
_NAMESPACE = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,31}"
_CLIENT_AGENT_ID = re.compile(_CLIENT_ID)
_AGENT_ID = re.compile(rf"(?:{_NAMESPACE}{NAMESPACE_SEPARATOR})?{_CLIENT_ID}")
NAMESPACE_PATTERN = re.compile(_NAMESPACE)


class InvalidAgentIdError(ValueError):
    pass


class AgentId(str):
    """A validated agent id: 1 to 128 letters, digits, '-', '_' or '.', not starting with '.',
    optionally behind a namespace and '~' (see `from_client`).

    Constructing one validates it, so storage can build file names from it and nothing else.
    """

    __slots__ = ()

    def __new__(cls, value: str) -> AgentId:
        if isinstance(value, AgentId):
            return value
        if not isinstance(value, str) or not _AGENT_ID.fullmatch(value):
            raise _invalid(value)
        return super().__new__(cls, value)

    @classmethod
    def from_client(cls, value: str, namespace: str | None = None) -> AgentId:
        """The id a client sent (never holding '~'), folded into `namespace` when there is one."""
        if not isinstance(value, str) or not _CLIENT_AGENT_ID.fullmatch(value):
            raise _invalid(value)
        if namespace is None:
            return cls(value)
        assert NAMESPACE_PATTERN.fullmatch(namespace), (
            f"namespace {namespace!r} was not validated: keys file bug"
        )
        return cls(f"{namespace}{NAMESPACE_SEPARATOR}{value}")

    @property
    def namespace(self) -> str | None:
        namespace, separator, _ = self.partition(NAMESPACE_SEPARATOR)
        return namespace if separator else None

    @property
    def local_id(self) -> str:
        """The id as its client knows it: without the namespace."""
        return self.rpartition(NAMESPACE_SEPARATOR)[2]


def _invalid(value: object) -> InvalidAgentIdError:
    shown = value[:64] if isinstance(value, str) else type(value).__name__
    return InvalidAgentIdError(
        f"invalid agent id {shown!r}: use 1 to {MAX_AGENT_ID_LENGTH} letters, digits, "
        "'-', '_' or '.', not starting with '.' or '-'"
    )


def agent_id_from(
    headers: Mapping[str, str], body_session_id: str | None = None, namespace: str | None = None
) -> AgentId | None:
    """The explicit agent id of a request: X-Agent-Id, then session_id/X-Session-Id, then Claude
    Code's; folded into the caller's `namespace` when the server has one per API key."""
    explicit = headers.get("x-agent-id")
    if explicit is None:
        explicit = body_session_id if body_session_id is not None else headers.get("x-session-id")
    if explicit is None:
        explicit = headers.get("x-claude-code-session-id")
        sub_agent = headers.get("x-claude-code-agent-id")  # a Task sub-agent: its own agent
        if explicit is not None and sub_agent is not None:
            explicit = f"{explicit}.{sub_agent}"
    return AgentId.from_client(explicit, namespace) if explicit is not None else None
