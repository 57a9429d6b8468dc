"""Finding, converting, digesting and loading a model's weights."""
