"""What the engine raises to its callers."""

from __future__ import annotations


class EngineError(RuntimeError):
    pass


class ModelChangedError(EngineError):
    """The request was tokenized for a model that has since been swapped out; retry it."""


class PromptTooLongError(ValueError):
    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(
            f"prompt has {num_tokens} tokens; the model's context holds {limit} "
            "(at least 1 must be left to generate)"
        )
        self.num_tokens = num_tokens
        self.limit = limit
