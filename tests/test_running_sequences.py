"""The batch's running sequences end once each, whatever the order of tokens, finishes, failures and
set-asides: every request's events end with exactly one last event (`Finished` or an error), carry
its tokens in order, and every block reserved for it is back in the pool."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from semantic.engine.cache_store.agent_cache import AgentCacheStore
from semantic.engine.cache_store.block_pool import BlockPool
from semantic.engine.cache_store.cache_keeper import CacheKeeper
from semantic.engine.cache_store.cache_spec import LayerKind, ModelCacheSpec
from semantic.engine.decoding.running import RunningSequences
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.decoding.sequence import Sequence
from semantic.engine.decoding.text_stream import TextStream
from semantic.engine.loop.config import EngineStats
from semantic.engine.loop.messages import (
    Event,
    EventChannel,
    Finished,
    FinishReason,
    GenerationRequest,
    TokenDelta,
)
from semantic.engine.loop.outbox import Outbox

NUM_SEQUENCES, NUM_BLOCKS, BLOCK = 5, 64, 16
EOS = 0


class LetterDetokenizer:
    """Token t reads as one letter: enough text for the stream's bookkeeping."""

    def __init__(self) -> None:
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = chr(ord("a") + token % 26)

    def finalize(self) -> None:
        self.last_segment = ""


def a_sequence(index: int, loop: asyncio.AbstractEventLoop, pool: BlockPool, max_tokens: int) -> Sequence:
    request = GenerationRequest(f"request-{index}", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    text = TextStream(LetterDetokenizer(), (), {EOS})
    return Sequence(request, EventChannel(loop), f"agent-{index}", text, pool.allocate(1 + index % 3), 0)


KINDS = ["token", "token", "token", "finish", "cancel", "fail", "set aside", "resume", "flush"]
operations = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, NUM_SEQUENCES - 1),
        st.integers(0, 50),  # 0 is the end-of-sequence token
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations=operations, max_tokens=st.integers(1, 6))
def test_every_sequence_ends_once_with_its_tokens_and_frees_its_blocks(
    operations: list[tuple[str, int, int]], max_tokens: int
) -> None:
    loop = asyncio.new_event_loop()
    try:
        spec = ModelCacheSpec(1, 1, 32, "float32", (LayerKind.FULL,), None, BLOCK)
        pool = BlockPool(NUM_BLOCKS, BLOCK, spec.bytes_per_block)
        store = AgentCacheStore(spec, pool, lambda: [KVCache()])
        outbox = Outbox(loop)
        running = RunningSequences(CacheKeeper(spec, store, pool), outbox, None, EngineStats())
        sequences = [a_sequence(i, loop, pool, max_tokens) for i in range(NUM_SEQUENCES)]
        for uid, sequence in enumerate(sequences):
            running.add(uid, sequence)
        aside: dict[int, Sequence] = {}
        taken: dict[int, list[int]] = {uid: [] for uid in range(NUM_SEQUENCES)}
        for operation, uid, token in operations:
            sequence = running.get(uid)
            if operation == "resume" and uid in aside:
                running.add(uid, aside.pop(uid))
            elif sequence is None:
                continue
            elif operation == "token":
                sequence.take_token(token)
                taken[uid].append(token)
                if (reason := sequence.end_reason()) is not None:
                    running.finish(uid, reason)
            elif operation == "finish":
                running.finish(uid, FinishReason.STOP)
            elif operation == "cancel":
                running.finish(uid, FinishReason.CANCELLED)
            elif operation == "fail":
                running.fail(running.take(uid), RuntimeError("this one failed"))
            elif operation == "set aside":
                aside[uid] = running.take(uid)
            elif operation == "flush":
                running.flush()
        num_left = len(running)
        assert running.fail_all(RuntimeError("the batch failed")) == num_left
        for sequence in aside.values():
            running.fail(sequence, RuntimeError("failed while set aside"))
        assert len(running) == 0
        outbox.flush()
        loop.run_until_complete(asyncio.sleep(0))

        assert pool.num_free_blocks == NUM_BLOCKS
        for uid, sequence in enumerate(sequences):
            events: list[Event] = []
            while not sequence.events.queue.empty():
                events.append(sequence.events.queue.get_nowait())
            last = [e for e in events if isinstance(e, Finished | BaseException)]
            assert len(last) == 1 and events[-1] is last[0]
            streamed = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
            assert streamed == taken[uid] == sequence.generated_token_ids
            if isinstance(last[0], Finished):
                assert last[0].num_generated_tokens == len(taken[uid])
                assert len(taken[uid]) <= max_tokens
    finally:
        loop.close()
