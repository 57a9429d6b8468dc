"""An agent's kept conversation (the direct API's): its token ids per model, saved as each turn ends.

Owned by the agent's actor, so one turn at a time reads and extends it. Each model keeps its own
conversation (as that model's token ids): after a model swap the first turn loads the record for
the model now loaded. A turn is committed (written to disk) before the next message is handled,
so an acknowledged turn survives a crash.
"""

from __future__ import annotations

import time

from semantic.actors.model_session import ModelSession
from semantic.actors.turns import PreparedPrompt
from semantic.engine.loop.messages import Finished, FinishReason
from semantic.storage.agent_id import AgentId
from semantic.storage.conversation_file import ConversationRecord


class KeptConversation:
    def __init__(self, agent_id: AgentId | None) -> None:
        self._agent_id = agent_id
        self._record: ConversationRecord | None = None
        self._model: str | None = None  # the fingerprint of the model `_record` is for
        self.is_kept = False  # opened or extended by a turn, and not forgotten since

    async def open(self, session: ModelSession, system: str | None) -> ConversationRecord:
        """Start the conversation afresh, with `system` as its system prompt, and save it."""
        self._model = session.loaded.fingerprint
        self._record = ConversationRecord(system=system, created_at=time.time())
        await self._save(session, self._record)
        self.is_kept = True
        return self._record

    async def current(self, session: ModelSession) -> ConversationRecord:
        """The conversation for the loaded model: in memory, else from disk, else a new one."""
        fingerprint = session.loaded.fingerprint
        if self._record is None or self._model != fingerprint:
            record = None
            if session.persistence is not None and self._agent_id is not None:
                record = await session.persistence.load_conversation(self._agent_id)
            self._record = record or ConversationRecord(created_at=time.time())
            self._model = fingerprint
        return self._record

    async def commit(self, session: ModelSession, prompt: PreparedPrompt, final: Finished) -> None:
        """Extend the conversation `current` gave the turn by its prompt and reply, and save it."""
        if final.reason is FinishReason.CANCELLED:
            return
        conversation = self._record
        assert conversation is not None, "a turn committed without its conversation: actor bug"
        generated = list(final.generated_token_ids)
        if generated and generated[-1] in session.loaded.eos_token_ids:
            generated.pop()  # the continuation writes the end of the turn itself
        updated = ConversationRecord(
            conversation.system,
            prompt.token_ids + generated,
            conversation.num_turns + 1,
            conversation.created_at,
        )
        await self._save(session, updated)
        self._record = updated
        self.is_kept = True

    def forget(self) -> None:
        self._record = None
        self.is_kept = False

    async def _save(self, session: ModelSession, record: ConversationRecord) -> None:
        if session.persistence is not None and self._agent_id is not None:
            await session.persistence.save_conversation(self._agent_id, record)
