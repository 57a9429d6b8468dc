"""semantic: a local multi-agent LLM inference daemon built on MLX.

The embedding API (see scripts/embed_example.py):

    from semantic import AgentSystem, SystemConfig

    async with AgentSystem(SystemConfig()) as system:
        agent = await system.open("my-agent", system_prompt="You are terse.")
        async for text in agent.say("Hello"):
            print(text, end="")

Names are imported on first use, so `import semantic` (the launcher does) does not load MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from semantic.actors.agent_id import AgentId, InvalidAgentIdError
    from semantic.actors.handle import AgentHandle, TurnSummary
    from semantic.actors.system import AgentInfo, AgentSystem, SystemConfig
    from semantic.actors.turns import ToolChoice, TurnRequest, TurnStarted
    from semantic.engine.engine import EngineConfig
    from semantic.engine.sampling import SamplingParams

__version__ = "0.1.0"

_HOMES = {
    "AgentHandle": "semantic.actors.handle",
    "AgentId": "semantic.actors.agent_id",
    "AgentInfo": "semantic.actors.system",
    "AgentSystem": "semantic.actors.system",
    "EngineConfig": "semantic.engine.engine",
    "InvalidAgentIdError": "semantic.actors.agent_id",
    "SamplingParams": "semantic.engine.sampling",
    "SystemConfig": "semantic.actors.system",
    "ToolChoice": "semantic.actors.turns",
    "TurnRequest": "semantic.actors.turns",
    "TurnStarted": "semantic.actors.turns",
    "TurnSummary": "semantic.actors.handle",
}

__all__ = [
    "AgentHandle",
    "AgentId",
    "AgentInfo",
    "AgentSystem",
    "EngineConfig",
    "InvalidAgentIdError",
    "SamplingParams",
    "SystemConfig",
    "ToolChoice",
    "TurnRequest",
    "TurnStarted",
    "TurnSummary",
    "__version__",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'semantic' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
