"""Whether a JSON schema has any finite instance: `{"$ref": "#"}`, or an object that requires a
property holding another of itself, has none. llguidance compiles such a schema and then either
allows only the end of the reply (an empty "instance") or nests forever, so it is refused up front.

The emptiness test of a context-free grammar: a local `$ref` target has a finite instance once its
schema can be satisfied using only targets already known to have one; each target is evaluated
again only when one it uses becomes known. Where unsure (keywords not modelled here, remote refs,
anchors) it assumes an instance exists, so only a schema that surely has none is refused.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

ROOT = "#"


def has_finite_instance(schema: Any) -> bool:
    if _has_nested_id(schema):
        return True  # a `#` ref inside a subschema with its own `$id` names that subschema: not modelled
    finite: set[str] = set()
    users: dict[str, set[str]] = {}  # a ref -> the targets whose schema used it
    queue, seen = deque([ROOT]), {ROOT}
    while queue:
        pointer = queue.popleft()
        target = _resolve(schema, pointer)
        used: set[str] = set()
        if pointer not in finite and (target is None or _satisfiable(target, finite, used)):
            finite.add(pointer)
            queue.extend(users.get(pointer, ()))
        for ref in used - seen:
            seen.add(ref)
            queue.append(ref)
        for ref in used:
            users.setdefault(ref, set()).add(pointer)
    return ROOT in finite


def _satisfiable(schema: Any, finite: set[str], used: set[str]) -> bool:
    """Whether `schema` has an instance built only from the `finite` targets (`used`: the refs it
    looked up and found missing)."""

    def holds(part: Any) -> bool:
        return _satisfiable(part, finite, used)

    if schema is False:
        return False
    if not isinstance(schema, dict) or "const" in schema or "enum" in schema:
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(ROOT) and ref not in finite:
        used.add(ref)
        return False
    if not all(holds(part) for part in _list(schema.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and not any(holds(part) for part in schema[key]):
            return False
    types = schema.get("type")
    if not isinstance(types, str | list):
        return True  # any JSON value (a string, say), or a malformed type llguidance refuses itself
    for kind in [types] if isinstance(types, str) else types:
        if kind == "object":
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = [name for name in _list(schema.get("required")) if isinstance(name, str)]
            if all(holds(properties.get(name, True)) for name in required):
                return True
        elif kind == "array":
            if _array_satisfiable(schema, holds):
                return True
        else:
            return True
    return False


def _array_satisfiable(schema: dict[str, Any], holds: Any) -> bool:
    min_items = schema.get("minItems", 0)
    min_items = min_items if isinstance(min_items, int) else 0
    items = schema.get("items", True)
    prefix = _list(schema.get("prefixItems", items if isinstance(items, list) else None))
    rest = True if isinstance(items, list) else items
    return all(holds(part) for part in prefix[:min_items]) and (min_items <= len(prefix) or holds(rest))


def _has_nested_id(node: Any, is_root: bool = True) -> bool:
    if isinstance(node, dict):
        if not is_root and "$id" in node:
            return True
        return any(_has_nested_id(value, False) for value in node.values())
    return isinstance(node, list) and any(_has_nested_id(value, False) for value in node)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _resolve(schema: Any, pointer: str) -> Any:
    """The subschema a local `$ref` names (a JSON pointer after `#`); None where it names none."""
    if pointer != ROOT and not pointer.startswith(ROOT + "/"):
        return None  # an anchor (`#name`)
    node = schema
    for raw in pointer.split("/")[1:]:
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
