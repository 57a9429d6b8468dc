"""What rank 0's engine shares before each tick so every rank runs the same tick.

Every engine decision follows from its state, the messages it takes, and three things that
differ between processes: the clock (admission order), the prefill chunk (sized from measured
times) and random draws (sampling). So rank 0 shares the clock and chunk it used, gives every
sampled request a seed, and sends the messages that change engine state as named operations,
in the order it applies them. Asks that only read state (`ListCaches`, `InspectPool`) and drains
stay on rank 0; a drain's timeout reaches the others as `fail_reason`.

A tick with no operations costs one small collective (the header); its plan is not encoded.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from semantic.engine.cache_store.cache_tensors import tokens_digest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.commands import Cancel as CancelMessage
from semantic.engine.loop.commands import (
    DropCache,
    LoadModel,
    Message,
    PendingAsk,
    ReferenceGenerate,
    RestoreCache,
    Shutdown,
    SnapshotCaches,
    Submit,
    TakeCache,
    UnloadModel,
)
from semantic.engine.loop.messages import GenerationRequest

HEADER_LENGTH = 4  # plan bytes, prefill chunk, rank 0's clock (µs), digest of the tokens generated so far


class SubmitOp(msgspec.Struct, tag=True):
    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams  # whole, with rank 0's seed: a field left out would make ranks diverge
    queued_at: float
    agent_id: str | None = None
    model_fingerprint: str | None = None
    cache_salt: str | None = None
    grammar: str | None = None
    grammar_trigger: str | None = None
    continues_text: bool = False  # the reply's text, and so where stop strings match, depends on it
    shared_head_tokens: int = 0  # where a recurrent model's prefill stops to keep its state
    generation_prompt_start: int = 0  # where it stops to keep the agent's own state


class CancelOp(msgspec.Struct, tag=True):
    request_id: str


class ShutdownOp(msgspec.Struct, tag=True):
    pass


class LoadOp(msgspec.Struct, tag=True):
    source: str
    name: str | None


class UnloadOp(msgspec.Struct, tag=True):
    pass


class RestoreOp(msgspec.Struct, tag=True):
    """Each rank reads its own shard of the agent's cache; it must hold exactly these tokens."""

    agent_id: str
    fingerprint: str
    cache_salt: str | None
    num_tokens: int
    tokens_digest: str


class TakeOp(msgspec.Struct, tag=True):
    agent_id: str


class SnapshotOp(msgspec.Struct, tag=True):
    agent_id: str
    file_digest: str = ""


class DropOp(msgspec.Struct, tag=True):
    agent_id: str
    keeps_files: bool = False


class ReferenceOp(msgspec.Struct, tag=True):
    prompt_tokens: list[int]
    max_tokens: int


Op = (
    SubmitOp
    | CancelOp
    | ShutdownOp
    | LoadOp
    | UnloadOp
    | RestoreOp
    | TakeOp
    | SnapshotOp
    | DropOp
    | ReferenceOp
)


class GroupTick(msgspec.Struct):
    ops: list[Op] = []
    fail_reason: str | None = None  # every rank fails what runs and waits, with this reason
    config: dict[str, Any] | None = None  # the engine settings, when rank 0's changed


class Tick(msgspec.Struct):
    """A tick as every rank runs it."""

    now: float  # rank 0's monotonic clock
    chunk: int  # prompt tokens the batch may prefill this tick
    token_digest: int  # rank 0's digest of every token generated before this tick
    plan: GroupTick


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GroupTick)


def encode(plan: GroupTick) -> bytes:
    return _encoder.encode(plan)


def decode(data: bytes) -> GroupTick:
    return _decoder.decode(data)


def is_empty(plan: GroupTick) -> bool:
    return not plan.ops and plan.fail_reason is None and plan.config is None


def op_for(message: Message) -> Op | None:
    """The operation the other ranks apply for one of rank 0's messages (None: rank 0's alone).

    A sampled request without a seed gets one here, on rank 0's own request too, so every rank
    draws the same tokens."""
    match message:
        case Submit(request=request, queued_at=queued_at):
            return _submit_op(request, queued_at)
        case CancelMessage(request_id=request_id):
            return CancelOp(request_id)
        case Shutdown():
            return ShutdownOp()
        case PendingAsk(command=command):
            match command:
                case LoadModel(source=source, name=name):
                    return LoadOp(source, name)
                case UnloadModel():
                    return UnloadOp()
                case RestoreCache(cache=cache, fingerprint=fingerprint, cache_salt=salt):
                    digest = tokens_digest(cache.tensors["tokens"])
                    return RestoreOp(str(cache.agent_id), fingerprint, _str(salt), cache.num_tokens, digest)
                case TakeCache(agent_id=agent_id):
                    return TakeOp(str(agent_id))
                case SnapshotCaches(agent_id=agent_id, file_digest=file_digest):
                    return SnapshotOp(str(agent_id), file_digest)
                case DropCache(agent_id=agent_id, keeps_files=keeps_files):
                    return DropOp(str(agent_id), keeps_files)
                case ReferenceGenerate(prompt_tokens=prompt_tokens, max_tokens=max_tokens):
                    return ReferenceOp(list(prompt_tokens), max_tokens)
    return None


def _submit_op(request: GenerationRequest, queued_at: float) -> SubmitOp:
    sampling = request.sampling
    if not sampling.is_greedy and sampling.seed is None:
        sampling = request.sampling = msgspec.structs.replace(sampling, seed=secrets.randbits(63))
    assert sampling.temperature is not None and sampling.top_p is not None and sampling.top_k is not None
    grammar = request.grammar
    return SubmitOp(
        request_id=str(request.request_id),
        prompt_tokens=list(request.prompt_tokens),
        sampling=msgspec.structs.replace(sampling, top_logprobs=None),  # rank 0 alone reports them
        queued_at=queued_at,
        agent_id=_str(request.agent_id),
        model_fingerprint=request.model_fingerprint,
        cache_salt=_str(request.cache_salt),
        grammar=grammar.grammar if grammar is not None else None,
        grammar_trigger=grammar.trigger if grammar is not None else None,
        continues_text=request.continues_text,
        shared_head_tokens=request.shared_head_tokens,
        generation_prompt_start=request.generation_prompt_start,
    )


def _str(value: str | None) -> str | None:
    """Ids arrive as `AgentId`s and the like (str subclasses): plain strings travel."""
    return None if value is None else str(value)


def request_of(op: SubmitOp) -> GenerationRequest:
    """The request a follower runs for rank 0's (its grammar is compiled by the follower's engine)."""
    return GenerationRequest(
        request_id=op.request_id,
        prompt_tokens=op.prompt_tokens,
        sampling=op.sampling,
        agent_id=op.agent_id,
        model_fingerprint=op.model_fingerprint,
        cache_salt=op.cache_salt,
        continues_text=op.continues_text,
        shared_head_tokens=op.shared_head_tokens,
        generation_prompt_start=op.generation_prompt_start,
    )
