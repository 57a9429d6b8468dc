"""The engine's batch stepped by hand while the replay's first turns arrive at the replay's pace:
each tick's prefill chunk, wall time, what is left to prefill and the prefill budget's estimates
(D for each number decoding, c, p: engine/scheduling/prefill_budget.py), one line a tick.

Two rounds of eight agents (as bench/agent_replay.py's first turns, arriving 0.05-0.4 s apart):
the first on a fresh process, the second with other prompts once the first has run. On a GPU the
first round shows what compiling kernels on first use costs (seconds for a batch of a new size),
the second what the budget does on its own. A diagnostic: prints, writes no results file.

    python -m semantic.launch .venv/bin/python -m bench.tick_trace [--stall-ratio 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import mlx.core as mx

from bench.agent_replay import REPLY_TOKENS, TOOL_TIME_S, AgentSession
from semantic.engine.loop.config import EngineConfig, EngineStats
from semantic.engine.loop.outbox import Outbox
from semantic.engine.loop.served_model import ServedModel
from semantic.engine.model.default_model import ensure_default_model
from tests.batch_driver import deliver, submit

NUM_AGENTS = 8


def trace_round(
    served: ServedModel, outbox: Outbox, loop: asyncio.AbstractEventLoop, first_agent: int
) -> None:
    tokenizer, batch = served.loaded.tokenizer, served.batch

    def submit_first_turn(index: int) -> None:
        session = AgentSession(index, shared_prompt=index % 2 == 0)
        session.next_turn(0)
        prompt = list(tokenizer.apply_chat_template(session.messages, add_generation_prompt=True))
        submit(served, loop, prompt, REPLY_TOKENS)

    rng = random.Random(first_agent)
    due = sorted((rng.uniform(*TOOL_TIME_S), first_agent + i) for i in range(NUM_AGENTS))
    print(f"== agents {first_agent}-: arrivals at {[round(t, 2) for t, _ in due]} s", flush=True)
    start, tick = time.perf_counter(), 0
    while due or batch.running:
        while due and due[0][0] <= time.perf_counter() - start:
            submit_first_turn(due.pop(0)[1])
        if not batch.running:
            time.sleep(0.002)
            continue
        chunk = batch.next_chunk()
        stepped = time.perf_counter()
        batch.step()
        elapsed = time.perf_counter() - stepped
        deliver(served, outbox, loop)
        budget = batch.prefill_budget
        left = [s.num_left_to_prefill for s in batch.running.values() if s.is_prefilling]
        decode_ms = {n: round(s * 1e3, 1) for n, s in budget.decode_steps.items()}
        token_us = round(budget.token_s * 1e6, 1) if budget.token_s else None
        print(
            f"{time.perf_counter() - start:6.3f}s tick {tick} chunk {chunk} took {elapsed * 1e3:.1f} ms "
            f"running {len(batch.running)} left to prefill {left} "
            f"D {decode_ms} ms c {budget.fixed_s * 1e3:.1f} ms p {token_us} us",
            flush=True,
        )
        tick += 1
    print(f"== done in {time.perf_counter() - start:.2f} s, {tick} ticks", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--stall-ratio", type=float, default=EngineConfig().prefill_stall_ratio)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    outbox = Outbox(loop)
    config = EngineConfig(
        model=str(ensure_default_model()), cache_budget_mb=2048, prefill_stall_ratio=args.stall_ratio
    )
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        served = ServedModel.load(config.model, None, config, stream, EngineStats(), outbox)
        for first_agent in (10_000, 0):
            trace_round(served, outbox, loop, first_agent)


if __name__ == "__main__":
    main()
