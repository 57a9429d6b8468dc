"""The messages an agent actor takes, and the errors its askers get."""

from __future__ import annotations

from dataclasses import dataclass

from semantic.actors.turns import TurnRequest

RETRY_AFTER_S = 1


class MailboxFullError(RuntimeError):
    def __init__(self, agent_id: str | None, limit: int) -> None:
        super().__init__(
            f"agent {agent_id} already has {limit} requests queued (the mailbox limit); retry later"
        )
        self.limit = limit
        self.retry_after_s = RETRY_AFTER_S


class AgentStoppedError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class StartTurn:
    turn: TurnRequest


@dataclass(frozen=True, slots=True)
class OpenConversation:
    """Start (or restart) the kept conversation with a system prompt."""

    system: str | None


@dataclass(frozen=True, slots=True)
class EvictCache:
    pass


@dataclass(frozen=True, slots=True)
class ForgetAgent:
    pass


@dataclass(frozen=True, slots=True)
class StopAgent:
    pass


AgentMessage = StartTurn | OpenConversation | EvictCache | ForgetAgent | StopAgent
