"""semantic's actor system inside your own asyncio program: no HTTP, no server.

    python -m semantic.launch python scripts/embed_example.py [--model DIR] [--cache-dir DIR]

Opens an agent, streams two turns (the second reuses the first's cache), stops the system (which
writes the agent's cache to disk), starts a new one and streams a third turn from that cache.
The last line printed is a JSON summary of the three turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from semantic import AgentSystem, EngineConfig, SystemConfig


async def turns(config: SystemConfig, questions: list[str], max_tokens: int) -> list[dict[str, object]]:
    summaries = []
    async with AgentSystem(config) as system:
        agent = await system.open("embedded-helper")
        for question in questions:
            print(f"> {question}")
            async for text in agent.say(question, max_tokens=max_tokens):
                print(text, end="", flush=True)
            print()
            assert agent.last_turn is not None
            summaries.append(
                {
                    "prompt_tokens": agent.last_turn.num_prompt_tokens,
                    "cached_tokens": agent.last_turn.num_cached_tokens,
                    "generated_tokens": agent.last_turn.num_generated_tokens,
                    "cache_tier": agent.last_turn.cache_tier,
                }
            )
    return summaries


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = SystemConfig(engine=EngineConfig(model=args.model), cache_dir=args.cache_dir or Path(tmp))
        first = await turns(config, ["What is the capital of France?", "And of Italy?"], args.max_tokens)
        # A new system on the same cache directory: the agent resumes from its file on disk.
        after_restart = await turns(config, ["And of Spain?"], args.max_tokens)
    print(json.dumps({"turns": first + after_restart}))


if __name__ == "__main__":
    asyncio.run(main())
