"""An agent actor: a bounded mailbox and one turn at a time.

Ask/tell rules (after pykka): a failure while handling an ask goes to the asker and the actor
lives on; a failure on a tell is logged and stops the actor. At stop every queued ask fails with
AgentStoppedError, so no caller waits forever.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loguru import logger

from semantic.engine.chat_format import ChatMessage
from semantic.engine.engine import RequestStream
from semantic.engine.messages import Finished, FinishReason, GenerationRequest
from semantic.engine.sampling import SamplingParams
from semantic.storage.conversation_file import ConversationRecord

if TYPE_CHECKING:
    from semantic.actors.system import AgentSystem


class MailboxFullError(RuntimeError):
    def __init__(self, agent_id: str, limit: int) -> None:
        super().__init__(
            f"agent {agent_id} already has {limit} requests queued (the mailbox limit); retry later"
        )
        self.limit = limit


class AgentStoppedError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Generate:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Converse:
    """A stateful turn: the actor appends `messages` to the conversation it keeps, as token ids."""

    messages: list[ChatMessage]
    sampling: SamplingParams
    request_id: str


@dataclass(frozen=True, slots=True)
class Open:
    """Start (or restart) the kept conversation with a system prompt."""

    system: str | None


@dataclass(frozen=True, slots=True)
class Evict:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Message = Generate | Converse | Open | Evict | Stop


class Envelope:
    __slots__ = ("message", "reply")

    def __init__(self, message: Message, reply: asyncio.Future[Any] | None) -> None:
        self.message = message
        self.reply = reply


class AgentActor:
    def __init__(self, system: AgentSystem, agent_id: str, mailbox_size: int) -> None:
        self.system = system
        self.agent_id = agent_id
        self.mailbox_size = mailbox_size
        # Unbounded underneath so Stop always gets in; `_put` enforces the bound for everything else.
        self._mailbox: asyncio.Queue[Envelope] = asyncio.Queue()
        self._stopped = False
        self.num_turns = 0
        # The direct API's conversation; None until first needed (then loaded from disk or new).
        self.conversation: ConversationRecord | None = None
        self._conversation_model: str | None = None  # the fingerprint of the model it belongs to

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    def ask(self, message: Message) -> asyncio.Future[Any]:
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._put(Envelope(message, reply))
        return reply

    def tell(self, message: Message) -> None:
        self._put(Envelope(message, None))

    def _put(self, envelope: Envelope) -> None:
        if self._stopped:
            raise AgentStoppedError(f"agent {self.agent_id} is stopped")
        if self._mailbox.qsize() >= self.mailbox_size:
            raise MailboxFullError(self.agent_id, self.mailbox_size)
        self._mailbox.put_nowait(envelope)

    def stop_nowait(self) -> None:
        """Stop after the current message; every queued ask then fails with AgentStoppedError."""
        self._stopped = True
        self._mailbox.put_nowait(Envelope(Stop(), None))

    async def run(self) -> None:
        try:
            while not self._stopped:
                envelope = await self._mailbox.get()
                if isinstance(envelope.message, Stop):
                    break
                await self._handle(envelope)
        finally:
            self._stopped = True
            self._fail_queued()
            self.system.forget(self)

    async def _handle(self, envelope: Envelope) -> None:
        try:
            result = await self._dispatch(envelope.message, envelope.reply)
        except Exception as error:
            if envelope.reply is None:
                logger.exception("agent {} failed on a tell; stopping", self.agent_id)
                raise
            if not envelope.reply.done():
                envelope.reply.set_exception(error)
            return
        if envelope.reply is not None and not envelope.reply.done():
            envelope.reply.set_result(result)

    async def _dispatch(self, message: Message, reply: asyncio.Future[Any] | None) -> Any:
        match message:
            case Generate(request=request):
                stream = await self._submit(request, reply)
                await asyncio.shield(stream.done)
                return stream
            case Converse(messages=messages, sampling=sampling, request_id=request_id):
                model = await self.system.use_model()
                conversation = await self._conversation(model.fingerprint)
                chat = self.system.chat_format
                if conversation.token_ids:
                    suffix = chat.continuation(conversation.system, messages)
                else:
                    suffix = chat.opening(conversation.system, messages)
                prompt = conversation.token_ids + chat.encode(suffix)
                request = GenerationRequest(request_id, prompt, sampling, model_fingerprint=model.fingerprint)
                stream = await self._submit(request, reply)
                final = await asyncio.shield(stream.done)
                if isinstance(final, Finished) and final.reason is not FinishReason.CANCELLED:
                    generated = list(final.generated_token_ids)
                    if generated and generated[-1] in model.eos_token_ids:
                        generated.pop()  # the continuation writes the end of the turn itself
                    conversation.token_ids = prompt + generated
                    conversation.num_turns += 1
                    await self.system.save_conversation(self.agent_id, conversation)
                return stream
            case Open(system=system_prompt):
                self._conversation_model = (await self.system.use_model()).fingerprint
                self.conversation = ConversationRecord(system=system_prompt, created_at=time.time())
                await self.system.save_conversation(self.agent_id, self.conversation)
                return self.conversation
            case Evict():
                return await self.system.evict_to_disk(self.agent_id)
            case Stop():
                return None

    async def _submit(self, request: GenerationRequest, reply: asyncio.Future[Any] | None) -> RequestStream:
        request.agent_id = self.agent_id
        if await self.system.restore_from_disk(self.agent_id):
            request.cache_tier_hint = "disk"
        stream = self.system.engine.submit(request)
        self.num_turns += 1
        # The asker gets the stream now; the actor's next message waits until this turn is done.
        if reply is not None and not reply.done():
            reply.set_result(stream)
        return stream

    async def _conversation(self, model_fingerprint: str) -> ConversationRecord:
        """The kept conversation for the loaded model (each model keeps its own, as its token ids)."""
        if self.conversation is None or self._conversation_model != model_fingerprint:
            self._conversation_model = model_fingerprint
            self.conversation = await self.system.load_conversation(self.agent_id) or ConversationRecord(
                created_at=time.time()
            )
        return self.conversation

    def _fail_queued(self) -> None:
        while not self._mailbox.empty():
            envelope = self._mailbox.get_nowait()
            if envelope.reply is not None and not envelope.reply.done():
                envelope.reply.set_exception(
                    AgentStoppedError(f"agent {self.agent_id} stopped before handling this request")
                )
