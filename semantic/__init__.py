"""semantic: a local multi-agent LLM inference daemon built on MLX."""

__version__ = "0.1.0"
