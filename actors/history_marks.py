"""Which history a named agent's cache holds, so that a request diverging from it forks.

Claude Code sends side requests (a session title, summaries) under the main conversation's session
id, with their own system prompt. Each finished turn of a named agent leaves a mark: the model, a
digest of its prompt and the length of the history it left in the cache. The next prompt continues
the agent when it starts with the marked prompt (all but its last few tokens: a chat template may
render the generation prompt differently from the same reply in the next turn's history). A prompt
that does not, and is no longer than the marked history, is a side request: it runs as an
anonymous fork and the agent's cache stays as it was (the fork still shares the agent's full blocks
through the pool). A longer one takes the agent over: the conversation moved on (a title request
that came first, a rewritten history).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from semantic.storage.agent_id import AgentId

# Tokens at the end of a prompt that the next turn may render differently (the generation prompt).
NUM_GENERATION_PROMPT_TOKENS = 16
MAX_MARKS = 4096


def token_digest(token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("I", token_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class HistoryMark:
    model_fingerprint: str
    num_prefix_tokens: int
    prefix_digest: bytes
    num_history_tokens: int  # the prompt and the reply, as the agent's cache holds them

    @classmethod
    def of_turn(cls, model_fingerprint: str, prompt_ids: Sequence[int], num_generated: int) -> HistoryMark:
        num_prefix = max(0, len(prompt_ids) - NUM_GENERATION_PROMPT_TOKENS)
        return cls(
            model_fingerprint,
            num_prefix,
            token_digest(prompt_ids[:num_prefix]),
            len(prompt_ids) + num_generated,
        )

    def is_continued_by(self, prompt_ids: Sequence[int]) -> bool:
        return (
            len(prompt_ids) >= self.num_prefix_tokens
            and token_digest(prompt_ids[: self.num_prefix_tokens]) == self.prefix_digest
        )


class HistoryMarks:
    """The last mark of each named agent, least recently used first. Bounded, so that ids clients
    invent cannot grow it; an agent without a mark is continued by whatever comes, as before."""

    def __init__(self, max_marks: int = MAX_MARKS) -> None:
        self.max_marks = max_marks
        self._marks: OrderedDict[AgentId, HistoryMark] = OrderedDict()

    def __len__(self) -> int:
        return len(self._marks)

    def record(self, agent_id: AgentId, mark: HistoryMark) -> None:
        self._marks[agent_id] = mark
        self._marks.move_to_end(agent_id)
        while len(self._marks) > self.max_marks:
            self._marks.popitem(last=False)

    def forget(self, agent_id: AgentId) -> None:
        self._marks.pop(agent_id, None)

    def is_side_request(self, agent_id: AgentId, model_fingerprint: str, prompt_ids: Sequence[int]) -> bool:
        """Whether this prompt diverges from the agent's history without outgrowing it."""
        mark = self._marks.get(agent_id)
        if mark is None or mark.model_fingerprint != model_fingerprint:
            return False
        self._marks.move_to_end(agent_id)
        return not mark.is_continued_by(prompt_ids) and len(prompt_ids) <= mark.num_history_tokens
