"""An agent actor: a bounded mailbox, one message at a time, and nothing it does not need.

Every request is a message to an actor: a named agent's actor serialises its turns, evictions and
deletion (a delete waits for the running turn, so nothing resurrects the agent); an anonymous
request gets an actor of its own that ends with the request. A stateless turn that diverges
from the agent's cached history (a side request, see history_marks.py) runs as an anonymous fork
and does not hold the mailbox while it decodes. An idle actor stops after
`idle_s` and is recreated on demand, so memory stays bounded however many ids clients invent.

Ask rules (after pykka, see mailbox.py): a failure while handling a message goes to its asker and
the actor lives on. At stop every queued ask fails with AgentStoppedError, so no caller waits
forever. A turn's stream is the actor's until it commits the turn: its reader sees Finished only
then (or the error that kept it from being saved), so an acknowledged turn is a durable one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from loguru import logger

from semantic.actors.agent_messages import (
    AgentDeletedError,
    AgentExistsError,
    AgentMessage,
    AgentStoppedError,
    EvictCache,
    ForgetAgent,
    IfExists,
    MailboxFullError,
    OpenConversation,
    StartTurn,
)
from semantic.actors.cache_miss import CacheReport, RequestDigest, TurnNote, history_of
from semantic.actors.cache_notes import CacheNotes, explain_turn, explainer
from semantic.actors.engine_client import Engine
from semantic.actors.history_marks import HistoryMark, HistoryMarks
from semantic.actors.kept_conversation import KeptConversation
from semantic.actors.model_session import ModelSession
from semantic.actors.models import ModelHost
from semantic.actors.request_stream import RequestStream
from semantic.actors.restore_cost import RestoreCosts, RestoreDecision, Totals
from semantic.actors.turn_prompt import build_request
from semantic.actors.turns import (
    PreparedPrompt,
    TurnRequest,
    TurnStarted,
)
from semantic.engine.loop.commands import DropCache, RestoreCache, SnapshotCaches, reply_to
from semantic.engine.loop.errors import EngineError, LibraryPanic, UnsteppableCacheError, as_ordinary
from semantic.engine.loop.messages import Finished, FinishReason, GenerationRequest
from semantic.storage.agent_id import AgentId
from semantic.storage.conversation_file import ConversationRecord
from semantic.storage.mailbox import Envelope, Mailbox

Explained = tuple[CacheReport, RequestDigest | None]  # a turn's x-semantic-cache report, and its digest


class AgentActor:
    def __init__(
        self,
        agent_id: AgentId | None,
        engine: Engine,
        models: ModelHost,
        on_exit: Callable[[AgentActor], None],
        mailbox_size: int = 8,
        idle_s: float = 60.0,
        max_prompt_tokens: int | None = None,
        marks: HistoryMarks | None = None,
        cache_notes: CacheNotes | None = None,
        restore_costs: RestoreCosts | None = None,
    ) -> None:
        self.agent_id = agent_id
        self._marks = marks if marks is not None else HistoryMarks()  # shared by the system's actors
        self._cache_notes = cache_notes if cache_notes is not None else CacheNotes()  # shared too
        self._restore_costs = restore_costs if restore_costs is not None else RestoreCosts()  # shared too
        self._engine = engine
        self._models = models
        self._on_exit = on_exit
        self.mailbox_size = mailbox_size
        self.idle_s = idle_s
        self.max_prompt_tokens = max_prompt_tokens
        self._mailbox: Mailbox[AgentMessage] = Mailbox(
            mailbox_size, lambda: MailboxFullError(agent_id, mailbox_size)
        )
        self._conversation = KeptConversation(agent_id)  # the direct API's
        self._running: RequestStream | None = None  # the turn holding the mailbox, once submitted
        self._deleted: AgentDeletedError | None = None  # set by a delete until its ForgetAgent runs
        self._handling: AgentMessage | None = None

    @property
    def is_stopped(self) -> bool:
        return self._mailbox.is_closed

    @property
    def is_anonymous(self) -> bool:
        return self.agent_id is None

    def ask(self, message: AgentMessage) -> asyncio.Future[Any]:
        return self._mailbox.ask(message)

    def ask_forget(self) -> asyncio.Future[Any]:
        """Delete the agent: its running turn is cancelled and its queued turns fail (either would
        bring it back), then ForgetAgent runs; replies whether the agent existed."""
        assert self.agent_id is not None, "forget asked of an anonymous actor: registry bug"
        if self.is_stopped:
            raise self._stopped_error()
        self._deleted = AgentDeletedError(self.agent_id.local_id, while_running=True)
        cancelled_turns = isinstance(self._handling, StartTurn)
        if self._running is not None:
            self._running.fail(self._deleted)
        for queued in self._mailbox.take(lambda message: isinstance(message, StartTurn)):
            reply_to(queued.reply, error=AgentDeletedError(self.agent_id.local_id, while_running=False))
            cancelled_turns = True
        return self._mailbox.post(ForgetAgent(cancelled_turns))  # past the bound: a delete always gets in

    def stop_nowait(self) -> None:
        """Stop after the current message; every queued ask fails with AgentStoppedError now."""
        self._mailbox.close(self._stopped_error)

    def _stopped_error(self) -> AgentStoppedError:
        return AgentStoppedError(f"agent {self.agent_id} is stopped")

    async def run(self) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_s):
                        envelope = await self._mailbox.get()
                except TimeoutError:
                    if not self._mailbox:
                        break  # idle: the registry makes a new actor when the id comes back
                    continue
                if envelope is None:  # stopped
                    break
                await self._handle(envelope)
                if self.is_anonymous:
                    break  # an anonymous actor lives for its one request
        finally:
            self._mailbox.close(self._stopped_error)  # every ask still queued fails
            self._on_exit(self)  # synchronously, so no message can reach a retired actor

    async def _handle(self, envelope: Envelope[AgentMessage]) -> None:
        message, reply = envelope.message, envelope.reply
        assert reply is not None, "an agent actor takes asks only: actor bug"
        self._handling = message
        try:
            result = await self._dispatch(message, reply)
        except BaseException as caught:
            error = as_ordinary(caught)
            if isinstance(error, LibraryPanic):
                logger.opt(exception=caught).error("agent {}: a library panicked", self.agent_id)
            reply_to(reply, error=error)
            return
        finally:
            self._handling = None
        reply_to(reply, result)

    async def _dispatch(self, message: AgentMessage, reply: asyncio.Future[Any]) -> Any:
        match message:
            case StartTurn(turn=turn):
                return await self._run_turn(turn, reply)
            case OpenConversation(system=system_prompt, if_exists=if_exists):
                return await self._open(system_prompt, if_exists)
            case EvictCache():
                return await self._evict()
            case ForgetAgent(cancelled_turns=cancelled_turns):
                return await self._forget() or cancelled_turns

    async def _run_turn(self, turn: TurnRequest, reply: asyncio.Future[Any]) -> None:
        with contextlib.ExitStack() as committing:
            async with self._models.lease(
                turn.model, turn.may_switch_model
            ) as session:  # held until submitted
                conversation = await self._conversation.current(session) if turn.keeps_conversation else None
                kept = conversation.token_ids if conversation is not None else None
                notes, agent_id = self._cache_notes, self.agent_id
                prompt, request, explained = await build_request(  # the turn's one tokenizer job
                    self._models,
                    session,
                    conversation,
                    turn,
                    self.max_prompt_tokens,
                    explainer(session, notes, agent_id, kept, turn),
                )
                explain = functools.partial(
                    explain_turn, self._models, session, notes, agent_id, kept, turn, prompt, explained
                )
                is_fork = conversation is None and self._is_side_request(session, prompt)
                # A fork leaves this agent's cache alone: the engine matches it by content or starts one.
                request.agent_id = None if is_fork else self.agent_id
                stream, restore, (cache, digest) = await self._submit(
                    session, request, turn.cache_salt, explain, holds_final=not is_fork
                )
                if is_fork:
                    return self._answer_fork(reply, session, prompt, stream, cache, restore)
                if self._deleted is not None:  # deleted while this turn was being prepared
                    stream.fail(self._deleted)
                committing.enter_context(self._models.committing())  # files stay open until saved
            await self._finish_turn(
                turn, reply, session, conversation, prompt, stream, (cache, digest), restore
            )

    async def _finish_turn(
        self,
        turn: TurnRequest,
        reply: asyncio.Future[Any],
        session: ModelSession,
        conversation: ConversationRecord | None,
        prompt: PreparedPrompt,
        stream: RequestStream,
        cache: tuple[CacheReport, RequestDigest | None],
        restore: RestoreDecision | None,
    ) -> None:
        if reply.done():  # the asker left (a client that disconnected) before the turn started
            stream.cancel()
        else:
            reply.set_result(
                TurnStarted(stream, prompt, session.loaded.name, self.agent_id, cache[0], restore)
            )
        # The next message waits until this turn is done (and, for a kept conversation, durable).
        self._running = stream
        try:
            final = await asyncio.shield(stream.done)
            if isinstance(final, UnsteppableCacheError) and final.is_sole_suspect:
                await self._quarantine_cache(session, final)
            if conversation is not None and isinstance(final, Finished):
                await self._conversation.commit(session, prompt, final)
            elif isinstance(final, Finished) and final.reason is not FinishReason.CANCELLED:
                self._mark_history(session, prompt, final, cache[1])
        except Exception as error:
            logger.error("agent {}: turn {} not committed: {}", self.agent_id, turn.request_id, error)
            stream.finish(error)  # the reader's last event: the turn is not acknowledged
            return
        except BaseException:  # cancelled (a stop) before or while committing: not acknowledged
            stream.fail(AgentStoppedError(f"agent {self.agent_id} stopped before this turn was saved"))
            raise
        finally:
            self._running = None
        if isinstance(final, Finished):  # an error event reached the reader already
            stream.finish(final)

    def _is_side_request(self, session: ModelSession, prompt: PreparedPrompt) -> bool:
        """Whether a stateless prompt diverges from this agent's cached history (history_marks.py)."""
        agent_id, fingerprint = self.agent_id, session.loaded.fingerprint
        if agent_id is None or not self._marks.is_side_request(agent_id, fingerprint, prompt.token_ids):
            return False
        logger.info(
            "agent {}: a {}-token prompt diverges from its history; it runs as a fork",
            agent_id,
            len(prompt.token_ids),
        )
        return True

    def _answer_fork(
        self,
        reply: asyncio.Future[Any],
        session: ModelSession,
        prompt: PreparedPrompt,
        stream: RequestStream,
        cache: CacheReport,
        restore: RestoreDecision | None,
    ) -> None:
        """Hand over a side request without waiting for its end: it leaves this agent's cache alone."""
        if reply.done():  # the asker left before the turn started
            stream.cancel()
            return
        reply.set_result(TurnStarted(stream, prompt, session.loaded.name, self.agent_id, cache, restore))

    def _mark_history(
        self, session: ModelSession, prompt: PreparedPrompt, final: Finished, digest: RequestDigest | None
    ) -> None:
        if self.agent_id is not None:
            fingerprint = session.loaded.fingerprint
            mark = HistoryMark.of_turn(fingerprint, prompt.token_ids, final.num_generated_tokens)
            self._marks.record(self.agent_id, mark)
            history = history_of(prompt.token_ids, final.generated_token_ids)
            self._cache_notes.record(self.agent_id, TurnNote(fingerprint, history, digest))

    async def _submit(
        self,
        session: ModelSession,
        request: GenerationRequest,
        cache_salt: str | None,
        explain: Callable[[], Awaitable[Explained]],
        holds_final: bool,
    ) -> tuple[RequestStream, RestoreDecision | None, Explained]:
        """Submit the turn, behind the agent's cache if that has to be read from disk (the engine
        thread takes its messages in order), then settle the restore's answer; with the restore's
        decision where one was made, and the turn explained (`explain`, its `explain_turn`) before
        the submit (headers go first), after the read (a restarted server's note is the file's).
        With `holds_final` the stream keeps the engine's Finished for `_finish_turn` from the start."""
        restoring, decision, explained = await self._send_cache_from_disk(
            session, request.request_id, cache_salt, explain
        )
        try:
            if explained is None:  # no file read: explained from what the agent's notes hold
                explained = await explain()
            stream = self._engine.submit(request)
            if holds_final:  # before this task yields: no event can have reached the stream yet
                stream.hold_final()
            return stream, decision, explained
        finally:
            if restoring is not None:
                await self._settle_restore(session, restoring)

    async def _send_cache_from_disk(
        self,
        session: ModelSession,
        request_id: str,
        cache_salt: str | None,
        explain: Callable[[], Awaitable[Explained]],
    ) -> tuple[asyncio.Future[bool] | None, RestoreDecision | None, Explained | None]:
        """If the agent's cache is on disk and not in memory, and reading it is estimated cheaper
        than computing it (restore_cost.py), read it and send it to the engine; the answer comes
        later (`_settle_restore`), so the turn's submit follows without waiting for a tick to end:
        the engine thread takes its messages in order, the restore first. Computing it, the turn
        goes in without it and the engine prefills the history; the file stays, the agent's still."""
        persistence, agent_id = session.persistence, self.agent_id
        if persistence is None or agent_id is None:
            return None, None, None
        # Both read without a message (an ask waits for the engine thread's tick to end, seconds on
        # a CPU under load): whether the engine serves the turn's model, and holds its cache already.
        fingerprint, serving = session.loaded.fingerprint, self._engine.loaded
        if serving is None or serving.fingerprint != fingerprint:
            return None, None, None  # another model was loaded meanwhile: no cache of this one to restore
        if self._engine.holds_cache(agent_id, fingerprint):
            return None, None, None
        on_disk = await persistence.describe_cache(agent_id)
        if on_disk is None:
            return None, None, None
        costs, stats = self._restore_costs, self._engine.stats
        reads = Totals(persistence.num_read_bytes, persistence.read_s_total)
        costs.learn(persistence, reads, stats.prefill_token_s)
        decision = costs.decide(on_disk.num_bytes, on_disk.num_tokens)
        logger.info(
            "agent {} turn {}: {}; {} tokens, {:.1f} MiB",
            agent_id,
            request_id,
            decision,
            on_disk.num_tokens,
            on_disk.num_bytes / 2**20,
        )
        if not decision.reads:
            return None, decision, None
        cache = await persistence.load(agent_id)
        if cache is None:
            return None, decision, None
        if self._cache_notes.note_of(agent_id) is None:  # a restart: the file holds the history
            history = history_of(cache.tensors["tokens"].tolist(), ())
            self._cache_notes.record(agent_id, TurnNote(fingerprint, history, None))
        # Explained now (again, where the note is the file's), so the submit follows the restore at once.
        explained = await explain()
        try:
            return self._engine.send(RestoreCache(cache, fingerprint, cache_salt)), decision, explained
        except EngineError as error:  # the engine stopping: the submit says so
            logger.info("agent {}: cache not restored ({})", agent_id, error)
            return None, decision, explained

    async def _settle_restore(self, session: ModelSession, restoring: asyncio.Future[bool]) -> None:
        """The engine's answer to a restore: a file it could not take is quarantined; without room
        or while the engine stops, the turn computes its history (the engine reports the tier)."""
        try:
            await restoring
        except (EngineError, MemoryError) as error:  # the engine stopping, or short of memory: not the file
            logger.info("agent {}: cache not restored now ({}); its turn computes it", self.agent_id, error)
        except Exception as error:  # a file that passed its checks and still does not fit
            assert session.persistence is not None and self.agent_id is not None, "restore sent: actor bug"
            await session.persistence.quarantine(self.agent_id, f"could not restore it: {error}")

    async def _quarantine_cache(self, session: ModelSession, error: UnsteppableCacheError) -> None:
        """The engine could not step this agent's cache (dropped there): its file, if it has one, is
        the likely source; moved aside, the next turn computes the history from the conversation."""
        persistence, agent_id = session.persistence, self.agent_id
        if persistence is None or agent_id is None:
            return
        entry = (await persistence.on_disk(agent_id)).get(agent_id)
        if entry is not None and entry.has_cache:
            await persistence.quarantine(agent_id, f"a batch step failed with its cache: {error}")

    async def _evict(self) -> bool:
        """Write the agent's cache to disk, then free its blocks; False if it had none in memory or
        it is not to be written (over the disk budget). A failed write raises (DiskFullError when
        the disk is full: 507) and the cache stays in memory for the agent's next turn."""
        persistence = self._models.persistence
        if self.agent_id is None or self._engine.loaded is None:
            return False
        if persistence is None:  # no folder to write to: evicting only frees the memory
            await self._engine.ask(DropCache(self.agent_id, keeps_files=True))
            return False
        # A copy first, freed only once its file is written; the mailbox keeps this agent's turns out.
        copies = await self._engine.ask(SnapshotCaches(self.agent_id))
        if not copies:
            return False
        try:
            if not await persistence.write(copies[0]):
                return False
        except OSError as error:
            logger.warning("agent {}: cache not evicted, it stays in memory: {}", self.agent_id, error)
            raise
        await self._engine.ask(DropCache(self.agent_id, keeps_files=True))
        return True

    async def _open(self, system_prompt: str | None, if_exists: IfExists) -> None:
        """Start the kept conversation, after checking in this one step whether the agent exists
        (so two creates, or a create beside a first turn, cannot both succeed)."""
        session = await self._models.ready()
        if if_exists != "reset" and await self._exists():
            if if_exists == "refuse":
                assert self.agent_id is not None, "create sent to an anonymous actor: registry bug"
                raise AgentExistsError(self.agent_id.local_id)
            return
        await self._conversation.open(session, system_prompt)

    async def _exists(self) -> bool:
        """Whether the agent has a conversation or a cache, in memory or in the agents' folder."""
        if self.agent_id is None:
            return False
        if self._conversation.is_kept:
            return True
        loaded = self._engine.loaded
        if loaded is not None and self._engine.holds_cache(self.agent_id, loaded.fingerprint):
            return True
        persistence = self._models.persistence  # kept while the model is unloaded
        return persistence is not None and bool(await persistence.on_disk(self.agent_id))

    async def _forget(self) -> bool:
        """Drop the agent's cache and conversation from memory and disk; whether it existed."""
        assert self.agent_id is not None, "forget sent to an anonymous actor: registry bug"
        self._deleted = None  # turns asked after the delete start the agent afresh
        existed = await self._exists()
        self._conversation.forget()
        self._marks.forget(self.agent_id)
        self._cache_notes.forget(self.agent_id)
        if self._engine.loaded is not None:
            await self._engine.ask(DropCache(self.agent_id))
        persistence = self._models.persistence
        if persistence is not None:
            await persistence.delete(self.agent_id)
        return existed
