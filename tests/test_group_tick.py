"""What rank 0 shares with the other ranks of a group, checked without a group."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.group import group_tick
from semantic.engine.group.distributed import EXIT_GROUP_LOST, backend_name
from semantic.engine.group.lockstep import DIGEST_MODULUS, clock_now, config_dict, config_from, next_digest
from semantic.engine.loop.commands import (
    Cancel,
    DropCache,
    InspectPool,
    ListCaches,
    PendingAsk,
    RestoreCache,
    SnapshotCaches,
    Submit,
)
from semantic.engine.loop.config import EngineConfig
from semantic.engine.loop.messages import EventChannel, GenerationRequest
from semantic.engine.model.loading import check_heads_divide
from semantic.storage.agent_id import AgentId
from semantic.storage.cache_file import CacheFileError, CacheIdentity, read_cache_file, write_cache_file
from tests.server_process import ROOT
from tests.test_cache_file import SPEC, a_cache

texts = st.text(max_size=20)
maybe_texts = st.none() | texts
submit_ops = st.builds(
    group_tick.SubmitOp,
    request_id=texts,
    prompt_tokens=st.lists(st.integers(0, 2**31 - 1), max_size=50),
    sampling=st.builds(
        SamplingParams,
        temperature=st.floats(0, 2),
        top_p=st.floats(0.01, 1),
        top_k=st.integers(0, 1000),
        max_tokens=st.integers(1, 10**6),
        stop=st.lists(st.text(min_size=1, max_size=20), max_size=4).map(tuple),
        seed=st.none() | st.integers(0, 2**64 - 1),
        min_p=st.floats(0, 1),
        logit_bias=st.lists(st.tuples(st.integers(0, 10**6), st.floats(-100, 100)), max_size=4).map(tuple),
    ),
    queued_at=st.floats(0, 1e9),
    agent_id=maybe_texts,
    cache_salt=maybe_texts,
    grammar=maybe_texts,
    grammar_trigger=maybe_texts,
)
ops = st.one_of(
    submit_ops,
    st.builds(group_tick.CancelOp, texts),
    st.builds(group_tick.ShutdownOp),
    st.builds(group_tick.LoadOp, texts, maybe_texts),
    st.builds(group_tick.RestoreOp, texts, texts, maybe_texts, st.integers(0, 10**6), texts),
    st.builds(group_tick.TakeOp, texts),
    st.builds(group_tick.DropOp, texts),
    st.builds(group_tick.ReferenceOp, st.lists(st.integers(0, 1000), max_size=10), st.integers(1, 100)),
)


@given(st.lists(ops, max_size=8), maybe_texts)
def test_a_plan_reaches_the_other_ranks_unchanged(
    plan_ops: list[group_tick.Op], fail_reason: str | None
) -> None:
    plan = group_tick.GroupTick(plan_ops, fail_reason, config_dict(EngineConfig()))
    assert group_tick.decode(group_tick.encode(plan)) == plan


def _submit(sampling: SamplingParams, agent_id: str | None = "ada", continues_text: bool = False) -> Submit:
    loop = asyncio.new_event_loop()
    request = GenerationRequest("r1", [1, 2, 3], sampling, agent_id=agent_id, continues_text=continues_text)
    return Submit(request, EventChannel(loop), queued_at=12.5)


def test_a_sampled_request_gets_one_seed_on_every_rank() -> None:
    submit = _submit(SamplingParams(temperature=0.7, top_p=1.0, top_k=0))
    op = group_tick.op_for(submit)
    assert isinstance(op, group_tick.SubmitOp) and op.sampling.seed is not None
    assert submit.request.sampling.seed == op.sampling.seed  # rank 0's own request draws with the same seed
    assert group_tick.request_of(op).sampling == submit.request.sampling
    assert op.queued_at == 12.5  # admission order follows rank 0's clock on every rank

    greedy = _submit(SamplingParams(temperature=0.0, top_p=1.0, top_k=0))
    greedy_op = group_tick.op_for(greedy)
    assert isinstance(greedy_op, group_tick.SubmitOp) and greedy_op.sampling.seed is None


def test_penalties_logit_bias_and_continued_text_reach_the_other_ranks() -> None:
    sampling = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.1,
        presence_penalty=-1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias=((7, -100.0), (11, 2.5)),
        top_logprobs=3,  # rank 0's alone: the others send no events
    )
    op = group_tick.op_for(_submit(sampling, continues_text=True))
    assert isinstance(op, group_tick.SubmitOp)
    plan = group_tick.decode(group_tick.encode(group_tick.GroupTick([op], None, config_dict(EngineConfig()))))
    (received,) = plan.ops
    assert isinstance(received, group_tick.SubmitOp)
    request = group_tick.request_of(received)
    assert request.sampling == msgspec.structs.replace(sampling, top_logprobs=None)
    assert request.continues_text  # where stop strings match depends on it: every rank must agree


def test_only_what_changes_the_engine_is_shared() -> None:
    loop = asyncio.new_event_loop()
    reply: asyncio.Future[object] = loop.create_future()
    assert group_tick.op_for(PendingAsk(ListCaches(), reply, loop)) is None
    assert group_tick.op_for(PendingAsk(InspectPool(), reply, loop)) is None
    assert group_tick.op_for(Cancel("r1")) == group_tick.CancelOp("r1")
    assert group_tick.op_for(PendingAsk(DropCache("ada"), reply, loop)) == group_tick.DropOp("ada")
    tokens = np.array([5, 6, 7], dtype=np.int32)
    cache = SerializedCache("ada", {"tokens": tokens}, [], 3)
    op = group_tick.op_for(PendingAsk(RestoreCache(cache, "fp"), reply, loop))
    assert op == group_tick.RestoreOp("ada", "fp", None, 3, group_tick.tokens_digest([5, 6, 7]))
    # A flush's snapshot of one agent, with the digest its file states: the id travels as a plain str.
    snapshot = SnapshotCaches(AgentId("ada"), "digest")
    op = group_tick.op_for(PendingAsk(snapshot, reply, loop))
    plan = group_tick.decode(group_tick.encode(group_tick.GroupTick([op], None, config_dict(EngineConfig()))))
    assert plan.ops == [group_tick.SnapshotOp("ada", "digest")]


@given(st.lists(st.integers(0, 2**20), max_size=64), st.lists(st.integers(0, 2**20), max_size=64))
def test_the_token_digest_tells_different_token_streams_apart(a: list[int], b: list[int]) -> None:
    def digest(tokens: list[int]) -> int:
        value = 0
        for token in tokens:
            value = next_digest(value, token)
        return value

    assert 0 <= digest(a) < DIGEST_MODULUS
    if len(a) == len(b) and a != b and len(a) <= 2:  # short sequences: the digest is injective there
        assert digest(a) != digest(b)
    assert digest(a) == digest(list(a))


def test_the_clock_travels_as_whole_microseconds() -> None:
    now = clock_now()
    assert round(now * 1_000_000) / 1_000_000 == now


def test_followers_take_rank_0s_settings_on_their_own_paths(tmp_path: Path) -> None:
    rank0 = EngineConfig(max_batch_size=4, shortest_first_max_wait_s=3.0, models_dir=Path("/rank0"))
    own = EngineConfig(models_dir=tmp_path, rank_timeout_s=9.0)
    merged = config_from(json.loads(json.dumps(config_dict(rank0))), own)
    assert merged.max_batch_size == 4 and merged.shortest_first_max_wait_s == 3.0
    assert merged.models_dir == tmp_path and merged.rank_timeout_s == 9.0


def test_tensor_parallel_refuses_head_counts_the_group_cannot_split(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 1536})
    )
    check_heads_divide(tmp_path, 3)
    with pytest.raises(ValueError, match="3 KV heads, which 2 ranks cannot split"):
        check_heads_divide(tmp_path, 2)


def test_a_shard_of_another_layout_is_refused(tmp_path: Path) -> None:
    cache = a_cache(2)  # agent-1's, of test_cache_file's one-layer model
    identity = CacheIdentity("m", "fp", 256, SPEC, 1000, "tensor rank 1 of 2")
    path = tmp_path / "agent-1.safetensors"
    write_cache_file(path, cache, identity)
    assert read_cache_file(path, identity, "agent-1").num_tokens == 2
    for layout in ("tensor rank 0 of 2", "tensor rank 1 of 3", ""):
        other = CacheIdentity("m", "fp", 256, SPEC, 1000, layout)
        with pytest.raises(CacheFileError, match="written by tensor rank 1 of 2"):
            read_cache_file(path, other, "agent-1")


def test_the_backend_is_named_from_the_launchers_environment() -> None:
    assert backend_name({"MLX_HOSTFILE": "/h.json", "MLX_RANK": "0"}) == "ring"
    assert backend_name({"MLX_IBV_DEVICES": "[]", "MLX_HOSTFILE": "x"}) == "jaccl"
    assert backend_name({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert backend_name({}) == "unknown"


def test_the_watchdog_ends_a_process_that_waits_too_long() -> None:
    script = (
        "import time\n"
        "from semantic.engine.group.distributed import Watchdog\n"
        "calls = []\n"
        "watchdog = Watchdog(0, on_stall=calls.append, grace_s=0.1)\n"
        "with watchdog.allow('a test', 0.2):\n"
        "    time.sleep(30)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == EXIT_GROUP_LOST
    assert "did not answer in time (a test)" in done.stderr


def test_ranks_sharing_a_machine_split_its_blas_threads(tmp_path: Path) -> None:
    from semantic.launch import ranks_on_this_machine

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5000"]]))
    assert ranks_on_this_machine({"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1"}) == 2
    assert ranks_on_this_machine({"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "2"}) == 1
    assert ranks_on_this_machine({"MLX_HOSTFILE": str(tmp_path / "missing.json"), "MLX_RANK": "0"}) == 1
    assert ranks_on_this_machine({}) == 1
