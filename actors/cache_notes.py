"""Each named agent's last cache note and hit/miss counts (cache_miss.py says what they mean), and
the step that explains a turn's prompt before it is submitted: worked out in the tokenizer job that
makes the prompt (`explainer`), counted on the event loop (`explain_turn`).

One `CacheNotes` serves every actor of the system on the event loop, and outlives actors that idle
out; it is bounded in agents and in the history tokens its notes hold, least recently used first.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from semantic.actors.cache_miss import (
    CacheReport,
    Reason,
    RequestDigest,
    TurnNote,
    explain,
    explain_in_worker,
    history_of,
)
from semantic.actors.model_session import ModelSession
from semantic.actors.models import ModelHost
from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.turns import PreparedPrompt, TurnRequest
from semantic.storage.agent_id import AgentId

MAX_AGENTS = 4096
MAX_HISTORY_TOKENS = 8_000_000  # 32 MiB of token ids over all agents' notes; the oldest go first


@dataclass(slots=True)
class AgentCacheCounts:
    num_hits: int = 0
    num_misses: int = 0
    last: CacheReport | None = None

    def as_json(self) -> dict[str, object]:
        last = self.last.as_json() if self.last is not None else None
        return {"hits": self.num_hits, "misses": self.num_misses, "last_turn": last}


@dataclass(slots=True)
class CacheNotes:
    """Each named agent's last note and hit/miss counts, least recently used first, bounded in
    agents and in history tokens; turns counted by reason (with anonymous ones) for /metrics."""

    max_agents: int = MAX_AGENTS
    max_history_tokens: int = MAX_HISTORY_TOKENS
    num_turns_by_reason: Counter[Reason] = field(default_factory=Counter)
    _notes: OrderedDict[AgentId, TurnNote] = field(default_factory=OrderedDict)
    _counts: OrderedDict[AgentId, AgentCacheCounts] = field(default_factory=OrderedDict)
    _num_history_tokens: int = 0

    def note_of(self, agent_id: AgentId) -> TurnNote | None:
        return self._notes.get(agent_id)

    def record(self, agent_id: AgentId, note: TurnNote) -> None:
        self._drop_note(agent_id)
        self._notes[agent_id] = note
        self._num_history_tokens += len(note.history)
        while len(self._notes) > self.max_agents or self._num_history_tokens > self.max_history_tokens:
            self._drop_note(next(iter(self._notes)))

    def count(self, agent_id: AgentId | None, report: CacheReport) -> None:
        self.num_turns_by_reason[report.reason] += 1
        if agent_id is None:
            return
        counts = self._counts.pop(agent_id, None) or AgentCacheCounts()
        counts.num_hits += report.reason is Reason.HIT
        counts.num_misses += report.is_miss
        counts.last = report
        self._counts[agent_id] = counts
        while len(self._counts) > self.max_agents:
            self._counts.popitem(last=False)

    def counts_of(self, agent_id: AgentId) -> AgentCacheCounts | None:
        return self._counts.get(agent_id)

    def forget(self, agent_id: AgentId) -> None:
        self._drop_note(agent_id)
        self._counts.pop(agent_id, None)

    def _drop_note(self, agent_id: AgentId) -> None:
        dropped = self._notes.pop(agent_id, None)
        if dropped is not None:
            self._num_history_tokens -= len(dropped.history)


@dataclass(frozen=True, slots=True)
class Explanation:
    """A turn's report and digest, worked out in the tokenizer worker against `note`, the agent's
    note when the turn's prompt was made."""

    note: TurnNote | None
    report: CacheReport
    digest: RequestDigest | None


Explainer = Callable[[list[int]], Explanation]  # run on the prompt's token ids, in the worker


def explainer(
    session: ModelSession,
    notes: CacheNotes,
    agent_id: AgentId | None,
    kept_history: list[int] | None,
    turn: TurnRequest,
) -> Explainer | None:
    """What the tokenizer job that makes the turn's prompt runs to explain it against the agent's
    note as it is now; None where `explain_turn` needs no worker (no agent, a kept conversation)."""
    if agent_id is None or kept_history is not None:
        return None
    note = notes.note_of(agent_id)
    return functools.partial(_explain_against, session.chat, note, session.loaded.fingerprint, turn)


def _explain_against(
    chat: ChatFormat, note: TurnNote | None, fingerprint: str, turn: TurnRequest, prompt_ids: list[int]
) -> Explanation:
    return Explanation(note, *explain_in_worker(chat, note, fingerprint, turn, prompt_ids))


async def explain_turn(
    models: ModelHost,
    session: ModelSession,
    notes: CacheNotes,
    agent_id: AgentId | None,
    kept_history: list[int] | None,
    turn: TurnRequest,
    prompt: PreparedPrompt,
    explained: Explanation | None = None,
) -> tuple[CacheReport, RequestDigest | None]:
    """How a turn's prompt meets its agent's cached history (a kept conversation's tokens where the
    agent keeps one), counted in `notes`; and the digest for the note the turn will leave.
    `explained` (from `explainer`) is used while the agent's note is still the one it was made
    against; otherwise (a restart's note, recorded from the agent's file) the worker explains again."""
    fingerprint = session.loaded.fingerprint
    if agent_id is None:
        report, digest = CacheReport(Reason.NO_AGENT), None
    elif kept_history is not None:  # the direct API: the prompt continues the kept tokens
        note = TurnNote(fingerprint, history_of(kept_history, ()), None) if kept_history else None
        report, digest = explain(note, fingerprint, prompt.token_ids, None), None
    else:
        note = notes.note_of(agent_id)
        if explained is not None and explained.note is note:
            report, digest = explained.report, explained.digest
        else:
            explaining = (session.chat, note, fingerprint, turn, prompt.token_ids)
            report, digest = await models.in_tokenizer_worker(explain_in_worker, *explaining)
    notes.count(agent_id, report)
    return report, digest
