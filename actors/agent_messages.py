"""The messages an agent actor takes, and the errors its askers get."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from semantic.actors.turns import TurnRequest

RETRY_AFTER_S = 1
IfExists = Literal["refuse", "resume", "reset"]  # what a create does where the agent exists


class MailboxFullError(RuntimeError):
    def __init__(self, agent_id: str | None, limit: int) -> None:
        super().__init__(
            f"agent {agent_id} already has {limit} requests queued (the mailbox limit); retry later"
        )
        self.limit = limit
        self.retry_after_s = RETRY_AFTER_S


class AgentStoppedError(RuntimeError):
    pass


class AgentExistsError(RuntimeError):
    """A create named an agent that already has a conversation or a cache."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id} already exists; DELETE it first")


class AgentDeletedError(RuntimeError):
    """The agent was deleted while this turn ran or waited; the turn was not kept."""

    def __init__(self, agent_id: str, while_running: bool) -> None:
        when = "while this turn ran" if while_running else "before this turn started"
        super().__init__(f"agent {agent_id} was deleted {when}; the turn was not kept")


@dataclass(frozen=True, slots=True)
class StartTurn:
    turn: TurnRequest


@dataclass(frozen=True, slots=True)
class OpenConversation:
    """Start the kept conversation with a system prompt. Where the agent already exists (a
    conversation or a cache, in memory or on disk): `refuse` raises AgentExistsError, `resume`
    keeps its history, `reset` starts it afresh."""

    system: str | None
    if_exists: IfExists = "refuse"


@dataclass(frozen=True, slots=True)
class EvictCache:
    pass


@dataclass(frozen=True, slots=True)
class ForgetAgent:
    """Drop the agent from memory and disk; replies whether it existed (a turn it cancelled counts:
    that turn was making the agent)."""

    cancelled_turns: bool = False


AgentMessage = StartTurn | OpenConversation | EvictCache | ForgetAgent
