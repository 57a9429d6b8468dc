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
    from semantic.actors.engine_client import EngineConfig
    from semantic.actors.handle import AgentHandle, TurnSummary
    from semantic.actors.model_registry import ModelEntry, UnknownModelError
    from semantic.actors.prompting.chat_format import ChatMessage
    from semantic.actors.prompting.tool_format import HERMES, ToolFormat, ToolSchemas
    from semantic.actors.request_stream import RequestStream
    from semantic.actors.system import AgentInfo, AgentSystem, SystemConfig
    from semantic.actors.turns import ToolChoice, TurnRequest, TurnStarted
    from semantic.engine.decoding.sampling import MAX_LOGIT_BIASES, MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams
    from semantic.engine.decoding.token_logprobs import TokenLogprob
    from semantic.engine.loop.errors import EngineError, PromptTooLongError
    from semantic.engine.loop.messages import (
        Event,
        Finished,
        FinishReason,
        PromptProgress,
        PromptStarted,
        TokenDelta,
    )
    from semantic.storage.agent_id import AgentId, InvalidAgentIdError
    from semantic.storage.persistence import PersistenceStoppedError

__version__ = "0.1.0"

_HOMES = {
    "ChatMessage": "semantic.actors.prompting.chat_format",
    "EngineError": "semantic.engine.loop.errors",
    "Event": "semantic.engine.loop.messages",
    "Finished": "semantic.engine.loop.messages",
    "FinishReason": "semantic.engine.loop.messages",
    "HERMES": "semantic.actors.prompting.tool_format",
    "MAX_LOGIT_BIASES": "semantic.engine.decoding.sampling",
    "MAX_SEED": "semantic.engine.decoding.sampling",
    "MAX_TOP_LOGPROBS": "semantic.engine.decoding.sampling",
    "ModelEntry": "semantic.actors.model_registry",
    "PromptProgress": "semantic.engine.loop.messages",
    "PromptStarted": "semantic.engine.loop.messages",
    "PersistenceStoppedError": "semantic.storage.persistence",
    "PromptTooLongError": "semantic.engine.loop.errors",
    "RequestStream": "semantic.actors.request_stream",
    "TokenDelta": "semantic.engine.loop.messages",
    "TokenLogprob": "semantic.engine.decoding.token_logprobs",
    "ToolFormat": "semantic.actors.prompting.tool_format",
    "ToolSchemas": "semantic.actors.prompting.tool_format",
    "UnknownModelError": "semantic.actors.model_registry",
    "AgentHandle": "semantic.actors.handle",
    "AgentId": "semantic.storage.agent_id",
    "AgentInfo": "semantic.actors.system",
    "AgentSystem": "semantic.actors.system",
    "EngineConfig": "semantic.actors.engine_client",
    "InvalidAgentIdError": "semantic.storage.agent_id",
    "SamplingParams": "semantic.engine.decoding.sampling",
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
