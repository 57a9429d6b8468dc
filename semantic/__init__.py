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
    from semantic.actors.handle import AgentHandle, TurnSummary
    from semantic.actors.system import AgentInfo, AgentSystem, SystemConfig
    from semantic.actors.turns import ToolChoice, TurnRequest, TurnStarted
    from semantic.engine.chat_format import ChatMessage
    from semantic.engine.engine import EngineConfig
    from semantic.engine.errors import EngineError, PromptTooLongError
    from semantic.engine.messages import (
        Event,
        Finished,
        FinishReason,
        PromptProgress,
        PromptStarted,
        TokenDelta,
    )
    from semantic.engine.registry import ModelEntry, UnknownModelError
    from semantic.engine.request_stream import RequestStream
    from semantic.engine.sampling import MAX_LOGIT_BIASES, MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams
    from semantic.engine.token_logprobs import TokenLogprob
    from semantic.engine.tool_format import HERMES, ToolFormat, ToolSchemas
    from semantic.storage.agent_id import AgentId, InvalidAgentIdError
    from semantic.storage.persistence import PersistenceStoppedError

__version__ = "0.1.0"

_HOMES = {
    "ChatMessage": "semantic.engine.chat_format",
    "EngineError": "semantic.engine.errors",
    "Event": "semantic.engine.messages",
    "Finished": "semantic.engine.messages",
    "FinishReason": "semantic.engine.messages",
    "HERMES": "semantic.engine.tool_format",
    "MAX_LOGIT_BIASES": "semantic.engine.sampling",
    "MAX_SEED": "semantic.engine.sampling",
    "MAX_TOP_LOGPROBS": "semantic.engine.sampling",
    "ModelEntry": "semantic.engine.registry",
    "PromptProgress": "semantic.engine.messages",
    "PromptStarted": "semantic.engine.messages",
    "PersistenceStoppedError": "semantic.storage.persistence",
    "PromptTooLongError": "semantic.engine.errors",
    "RequestStream": "semantic.engine.request_stream",
    "TokenDelta": "semantic.engine.messages",
    "TokenLogprob": "semantic.engine.token_logprobs",
    "ToolFormat": "semantic.engine.tool_format",
    "ToolSchemas": "semantic.engine.tool_format",
    "UnknownModelError": "semantic.engine.registry",
    "AgentHandle": "semantic.actors.handle",
    "AgentId": "semantic.storage.agent_id",
    "AgentInfo": "semantic.actors.system",
    "AgentSystem": "semantic.actors.system",
    "EngineConfig": "semantic.engine.engine",
    "InvalidAgentIdError": "semantic.storage.agent_id",
    "SamplingParams": "semantic.engine.sampling",
    "SystemConfig": "semantic.actors.system",
    "ToolChoice": "semantic.actors.turns",
    "TurnRequest": "semantic.actors.turns",
    "TurnStarted": "semantic.actors.turns",
    "TurnSummary": "semantic.actors.handle",
}

__all__ = [
    "HERMES",
    "MAX_LOGIT_BIASES",
    "MAX_SEED",
    "MAX_TOP_LOGPROBS",
    "AgentHandle",
    "AgentId",
    "AgentInfo",
    "AgentSystem",
    "ChatMessage",
    "EngineConfig",
    "EngineError",
    "Event",
    "FinishReason",
    "Finished",
    "InvalidAgentIdError",
    "ModelEntry",
    "PersistenceStoppedError",
    "PromptProgress",
    "PromptStarted",
    "PromptTooLongError",
    "RequestStream",
    "SamplingParams",
    "SystemConfig",
    "TokenDelta",
    "TokenLogprob",
    "ToolChoice",
    "ToolFormat",
    "ToolSchemas",
    "TurnRequest",
    "TurnStarted",
    "TurnSummary",
    "UnknownModelError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'semantic' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
