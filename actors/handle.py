"""AgentHandle: one agent of an embedded AgentSystem, as plain async Python (no HTTP).

async with AgentSystem(SystemConfig()) as system:
    agent = await system.open("helper", system_prompt="You are terse.")
    async for text in agent.say("What is the capital of France?"):
        print(text, end="")
    print(agent.last_turn)  # prompt, cached and generated token counts, cache tier
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from semantic.actors.turns import TurnRequest
from semantic.engine.decoding.sampling import SamplingParams
from semantic.engine.loop.messages import Finished, PromptStarted, TokenDelta
from semantic.storage.agent_id import AgentId

if TYPE_CHECKING:
    from semantic.actors.system import AgentSystem


@dataclass(frozen=True, slots=True)
class TurnSummary:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    cache_tier: str
    finish_reason: str


class AgentHandle:
    """Send an agent new user messages and iterate its reply; the agent keeps the conversation."""

    def __init__(self, system: AgentSystem, agent_id: AgentId) -> None:
        self.system = system
        self.agent_id = agent_id
        self.last_turn: TurnSummary | None = None

    async def say(
        self, content: str, max_tokens: int = 256, temperature: float = 0.0, **sampling: object
    ) -> AsyncIterator[str]:
        """Yield the reply's text as it is generated. Breaking out of the loop cancels the turn.

        The turn is durable (its conversation record fsynced) by the time the loop ends.
        """
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
        turn = TurnRequest(
            uuid.uuid4().hex,
            self.agent_id,
            [{"role": "user", "content": content}],
            params,
            keeps_conversation=True,
        )
        started = await self.system.start_turn(turn)
        tier = "none"
        async for event in started.stream:
            if isinstance(event, PromptStarted):
                tier = event.cache_tier
            elif isinstance(event, TokenDelta) and event.text:
                yield event.text
            elif isinstance(event, Finished):  # the actor's: the turn is durable by now
                self.last_turn = TurnSummary(
                    event.num_prompt_tokens,
                    event.num_cached_tokens,
                    event.num_generated_tokens,
                    tier,
                    event.reason.value,
                )

    async def reply(self, content: str, **options: object) -> str:
        """The whole reply at once."""
        return "".join([text async for text in self.say(content, **options)])  # type: ignore[arg-type]

    async def evict(self) -> bool:
        """Write the agent's cache to disk and free its memory (it reloads on the next turn)."""
        return await self.system.evict(self.agent_id)
