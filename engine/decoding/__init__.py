"""The running sequences: mlx-lm's batch, each sequence's tokens, text, sampling and end."""
