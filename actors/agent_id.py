"""Agent ids: parsed once where a request enters, then trusted everywhere (file names included)."""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_AGENT_ID_LENGTH = 128
_AGENT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class InvalidAgentIdError(ValueError):
    pass


class AgentId(str):
    """A validated agent id: 1 to 128 letters, digits, '-', '_' or '.', not starting with '.'.

    Constructing one validates it, so storage can build file names from it and nothing else.
    """

    __slots__ = ()

    def __new__(cls, value: str) -> AgentId:
        if isinstance(value, AgentId):
            return value
        if not isinstance(value, str) or not _AGENT_ID.fullmatch(value):
            shown = value[:64] if isinstance(value, str) else type(value).__name__
            raise InvalidAgentIdError(
                f"invalid agent id {shown!r}: use 1 to {MAX_AGENT_ID_LENGTH} letters, digits, "
                "'-', '_' or '.', not starting with '.' or '-'"
            )
        return super().__new__(cls, value)


def agent_id_from(headers: Mapping[str, str], body_session_id: str | None = None) -> AgentId | None:
    """The explicit agent id of a request: X-Agent-Id, then session_id/X-Session-Id, then Claude Code's."""
    explicit = headers.get("x-agent-id")
    if explicit is None:
        explicit = body_session_id if body_session_id is not None else headers.get("x-session-id")
    if explicit is None:
        explicit = headers.get("x-claude-code-session-id")
    return AgentId(explicit) if explicit is not None else None
