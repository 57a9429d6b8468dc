"""Agent ids: which request belongs to which agent, validated before they name a file."""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_AGENT_ID_LENGTH = 128
_AGENT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# Explicit ids, strongest first.
AGENT_ID_HEADERS = ("x-agent-id", "x-session-id", "x-claude-code-session-id")


class InvalidAgentIdError(ValueError):
    pass


def validate_agent_id(agent_id: str) -> str:
    if not _AGENT_ID.fullmatch(agent_id):
        raise InvalidAgentIdError(
            f"invalid agent id {agent_id[:64]!r}: use 1 to {MAX_AGENT_ID_LENGTH} letters, digits, "
            "'-', '_' or '.', not starting with '.' or '-'"
        )
    return agent_id


def agent_id_from(headers: Mapping[str, str], body_session_id: str | None = None) -> str | None:
    """The explicit agent id of a request: X-Agent-Id, then session_id/X-Session-Id, then Claude Code's."""
    explicit = headers.get("x-agent-id")
    if explicit is None:
        explicit = body_session_id if body_session_id is not None else headers.get("x-session-id")
    if explicit is None:
        explicit = headers.get("x-claude-code-session-id")
    return validate_agent_id(explicit) if explicit is not None else None
