"""A cache file's tensors against its model's layout (the cache spec its header states, which a
server reads only when it is the loaded model's): each tensor's element type and every axis.

A file from outside (`agents import`) can hold tensors of any dtype and shape under the right
names and checksum; one that reached the engine would fail its agent's turn and the batch's other
rows with it. So every tensor must be one the model's cache has, of the model's width and shape.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from semantic.engine.cache_store.cache_tensors import (
    attention_tensor_name,
    state_tensor_name,
    stored_dtype,
    window_tensor_name,
)

# Per axis: what it counts, and the fewest and most it may hold.
Axes = list[tuple[str, int, int]]


def layout_problem(
    tensors: dict[str, np.ndarray],
    spec: dict[str, Any],
    kv_starts: list[int],
    num_tokens: int,
    state_points: list[tuple[int, list[int]]],
) -> str | None:
    """The first tensor, and its axis, that `spec`'s model would not have written for a cache of
    `num_tokens` tokens (None: every one is as it would be). ValueError for a malformed spec."""
    expected = {"tokens": (np.dtype(np.int32), [("tokens", num_tokens, num_tokens)])}
    expected |= _attention_tensors(spec, kv_starts, num_tokens)
    expected |= _state_tensors(spec, state_points)
    windows = _window_tensors(spec, state_points)
    expected |= windows
    if unknown := sorted(tensors.keys() - expected.keys()):
        return f"{unknown[0]} is not a tensor of this model's cache"
    for name, (dtype, axes) in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            if name in windows or any(label == "tokens" and low == 0 for label, low, _ in axes):
                continue  # a layer that holds no token, or a point whose windows the blocks hold
            return f"{name} is missing"
        if tensor.dtype != dtype:
            return f"{name}: elements of {tensor.dtype}, this model's cache holds {dtype}"
        if tensor.ndim != len(axes):
            return f"{name}: {tensor.ndim} axes, this model's cache {len(axes)}"
        for axis, (size, (label, low, high)) in enumerate(zip(tensor.shape, axes, strict=True)):
            if not low <= size <= high:
                wanted = str(low) if low == high else f"{low} to {high}"
                return f"{name}: axis {axis} ({label}) holds {size}, this model's cache {wanted}"
    return None


def _attention_tensors(
    spec: dict[str, Any], kv_starts: list[int], num_tokens: int
) -> dict[str, tuple[np.dtype[Any], Axes]]:
    """Per attention layer, its keys and values: one batch row, the layer's KV heads, the tokens
    from its start (up to its last block's end: a block's payload may run past the last token),
    and the key or value width."""
    dtype, block_size = stored_dtype(str(spec["dtype"])), int(spec["block_size"])
    if block_size <= 0:
        raise ValueError(f"a block size of {block_size}")
    last_block_end = -(-num_tokens // block_size) * block_size
    expected = {}
    for slot, (width, start) in enumerate(zip(spec["kv_widths"], kv_starts, strict=True)):
        heads, key_width, value_width = (int(n) for n in width)
        first_block_start = start // block_size * block_size
        tokens = ("tokens", num_tokens - start, last_block_end - first_block_start)
        for part, part_width in (("keys", key_width), ("values", value_width)):
            label = "key width" if part == "keys" else "value width"
            axes = [("batch rows", 1, 1), ("KV heads", heads, heads), tokens, (label, part_width, part_width)]
            expected[attention_tensor_name(slot, part)] = (dtype, axes)
    return expected


def _state_tensors(
    spec: dict[str, Any], state_points: list[tuple[int, list[int]]]
) -> dict[str, tuple[np.dtype[Any], Axes]]:
    """Per state point, each recurrent layer's arrays, of the shapes and dtypes the spec states."""
    layers = spec["state_arrays"]
    expected = {}
    for point, (_, counts) in enumerate(state_points):
        if counts != [len(arrays) for arrays in layers]:
            raise ValueError(f"state point {point} does not have the model's recurrent layers")
        for layer, arrays in enumerate(layers):
            for index, (shape, dtype) in enumerate(arrays):
                axes = [(f"state axis {axis}", int(n), int(n)) for axis, n in enumerate(shape)]
                expected[state_tensor_name(point, layer, index)] = (stored_dtype(str(dtype)), axes)
    return expected


def _window_tensors(
    spec: dict[str, Any], state_points: list[tuple[int, list[int]]]
) -> dict[str, tuple[np.dtype[Any], Axes]]:
    """Per state point, each sliding layer's keys and values of the window before it (a point may
    leave them out): one batch row, the layer's KV heads, its window's tokens, the width."""
    kinds = list(spec.get("layer_kinds", []))
    if "sliding" not in kinds or not state_points:
        return {}
    dtype = stored_dtype(str(spec["dtype"]))
    attention = [
        (kind, window) for kind, window in zip(kinds, spec["layer_windows"], strict=True) if kind != "state"
    ]
    sliding = [
        (window, width)
        for (kind, window), width in zip(attention, spec["kv_widths"], strict=True)
        if kind == "sliding"
    ]
    expected = {}
    for point, (num_tokens, _) in enumerate(state_points):
        for index, (window, width) in enumerate(sliding):
            heads, key_width, value_width = (int(n) for n in width)
            held = min(int(window), num_tokens)
            for part, part_width in (("keys", key_width), ("values", value_width)):
                label = "key width" if part == "keys" else "value width"
                axes = [("batch rows", 1, 1), ("KV heads", heads, heads), ("tokens", held, held)]
                expected[window_tensor_name(point, index, part)] = (
                    dtype,
                    [*axes, (label, part_width, part_width)],
                )
    return expected
