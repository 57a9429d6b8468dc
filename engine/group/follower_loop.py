"""A rank other than 0: its engine runs the ticks rank 0 shares, on its own shard of the model.

It holds the same agents' caches as rank 0 (its heads or layers of them), makes the same
admissions and evictions, and writes and reads its own shard files (`ShardFiles`). What its
requests produce goes nowhere: rank 0 answers the clients. Each tick it compares the digest of
every token it generated with rank 0's; a difference stops it (`GroupDivergedError`).
"""

from __future__ import annotations

import asyncio
import functools
import queue
from typing import Any

import mlx.core as mx
from loguru import logger

from semantic.engine.cache_store.cache_tensors import SerializedCache, tokens_digest
from semantic.engine.decoding.grammar_matcher import GrammarCompiler
from semantic.engine.group.distributed import GroupLostError
from semantic.engine.group.group_tick import (
    CancelOp,
    DropOp,
    LoadOp,
    Op,
    ReferenceOp,
    RestoreOp,
    ShutdownOp,
    SnapshotOp,
    SubmitOp,
    TakeOp,
    UnloadOp,
    request_of,
)
from semantic.engine.group.lockstep import Follower, GroupDivergedError, Lockstep, config_from
from semantic.engine.loop.commands import (
    DropCache,
    EngineAsk,
    LoadModel,
    ReferenceGenerate,
    SnapshotCaches,
    Submit,
    TakeCache,
    UnloadModel,
)
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.engine_loop import EngineLoop
from semantic.engine.loop.messages import Event, EventChannel
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.mlx_adapter.model_hooks import cpu_kernels_on_this_thread


class _NoClients(Outbox):
    """A follower's requests have no client: their events are dropped."""

    def post(self, events: EventChannel, event: Event) -> None:
        pass

    def post_many(self, events: EventChannel, batch: list[Event]) -> None:
        pass

    def flush(self) -> None:
        pass


class FollowerLoop(EngineLoop):
    def __init__(self, config: EngineConfig, stats: EngineStats, follower: Follower) -> None:
        # Never run: a request's event channel needs a loop to make its future; nothing awaits it.
        loop = asyncio.new_event_loop()
        super().__init__(config, stats, queue.SimpleQueue(), loop, on_evicted=None)
        self._outbox = _NoClients(loop)
        self._follower = follower
        self._grammars: tuple[str, GrammarCompiler] | None = None  # by model fingerprint

    @property
    def _lockstep(self) -> Lockstep | None:
        return self._follower

    def follow(self) -> None:
        """Load the model with rank 0 and run its ticks until it shuts the group down. Raises
        GroupLostError when rank 0 or another rank is gone, GroupDivergedError on other tokens."""
        self._stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(self._stream), cpu_kernels_on_this_thread(self.config.profile.cpu_kernels):
                try:
                    with self._tick_allowance(True):
                        self._load(self.config.model, self.config.model_name)
                    self._follow()
                finally:
                    self._close()
                    self._follower.files.close()
        finally:
            mx.clear_streams()  # before the thread ends, as on rank 0's engine thread (engine.py)

    def _follow(self) -> None:
        follower, stopping = self._follower, False
        timeout_s = self.config.rank_timeout_s + follower.heartbeat_s
        while True:
            tick = follower.receive(timeout_s)
            own_digest = self._token_digest()
            if tick.token_digest != own_digest:
                raise GroupDivergedError(
                    f"rank {follower.layout.rank} generated other tokens than rank 0 "
                    f"(digest {own_digest} against {tick.token_digest})"
                )
            plan = tick.plan
            if plan.config is not None:
                self.config = config_from(plan.config, self.config)
            with self._tick_allowance(any(isinstance(op, LoadOp) for op in plan.ops)):
                stopping |= self._apply_ops(plan.ops)
                self._run_tick(tick.now, tick.chunk, plan.fail_reason)
            if stopping and not self._is_busy:
                return

    def _apply_ops(self, ops: list[Op]) -> bool:
        stopping = False
        for op in ops:
            match op:
                case SubmitOp():
                    self._submit(op)
                case CancelOp(request_id=request_id):
                    self._cancel(request_id)
                case ShutdownOp():
                    stopping = True
                case RestoreOp():
                    read = functools.partial(self._read, op)
                    self._restore(op.agent_id, op.fingerprint, op.cache_salt, op.num_tokens, read)
                case TakeOp(agent_id=agent_id):
                    taken = self._quietly(TakeCache(agent_id))
                    if taken is not None:
                        self._save([taken])
                case SnapshotOp(agent_id=agent_id, file_digest=file_digest):
                    self._save(
                        self._quietly(SnapshotCaches(agent_id, self._shard_digest(agent_id, file_digest)))
                        or []
                    )
                case DropOp(agent_id=agent_id, keeps_files=keeps_files):
                    self._quietly(DropCache(agent_id))
                    if self.loaded is not None and not keeps_files:
                        self._follower.files.delete(agent_id, self.loaded)
                case LoadOp(source=source, name=name):
                    self._quietly(LoadModel(source, name))
                case UnloadOp():
                    self._quietly(UnloadModel())
                case ReferenceOp(prompt_tokens=prompt_tokens, max_tokens=max_tokens):
                    self._quietly(ReferenceGenerate(prompt_tokens, max_tokens))
        return stopping

    def _submit(self, op: SubmitOp) -> None:
        request = request_of(op)
        if op.grammar is not None and self._served is not None:
            compiler = self._grammar_compiler(self._served)
            request.grammar = compiler.matcher(op.grammar, op.grammar_trigger, op.cache_salt)
        self._scheduler.add(Submit(request, EventChannel(self._loop), queued_at=op.queued_at))

    def _grammar_compiler(self, served: ServedModel) -> GrammarCompiler:
        loaded = served.loaded
        if self._grammars is None or self._grammars[0] != loaded.fingerprint:
            self._grammars = (
                loaded.fingerprint,
                GrammarCompiler(loaded.tokenizer, sorted(loaded.eos_token_ids)),
            )
        return self._grammars[1]

    def _quietly(self, command: EngineAsk[Any]) -> Any:
        """Answer a command as rank 0 did; its failure is rank 0's too (it reached its caller there)."""
        try:
            return self._answer(command)
        except GroupLostError:
            raise
        except Exception as error:
            logger.info("rank {}: {} failed as on rank 0: {}", self._follower.layout.rank, command, error)
            return None

    def _read(self, op: RestoreOp) -> SerializedCache | None:
        """This rank's shard of the cache rank 0 read: None unless it holds exactly the same tokens."""
        if self.loaded is None:
            return None
        cache = self._follower.files.load(op.agent_id, self.loaded)
        if cache is None:
            return None
        if cache.num_tokens != op.num_tokens or tokens_digest(cache.tensors["tokens"]) != op.tokens_digest:
            logger.warning(
                "rank {}: the shard of {} holds other tokens than rank 0's file",
                self._follower.layout.rank,
                op.agent_id,
            )
            return None
        return cache

    def _shard_digest(self, agent_id: str, file_digest: str) -> str:
        """The digest rank 0's file of `agent_id` states, if this rank has a shard file for it too (it
        wrote and read its shards when rank 0 did; a restore checks the tokens of one anyway), else ""."""
        loaded = self.loaded
        if file_digest and loaded is not None and self._follower.files.holds(agent_id, loaded):
            return file_digest
        return ""

    def _save(self, caches: list[SerializedCache]) -> None:
        if caches and self.loaded is not None:
            self._follower.files.save(caches, self.loaded)

    @property
    def _keeps_evicted(self) -> bool:
        return True

    def _keep_evicted(self, caches: list[SerializedCache], served: ServedModel) -> None:
        """A follower writes its own shards of what it evicted (rank 0's actor writes rank 0's)."""
        self._follower.files.save(caches, served.loaded)
