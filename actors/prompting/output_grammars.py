"""The grammars a reply is held to, in llguidance's format, written in the tokenizer workers from the
request: a JSON schema's, a forced call's, and each call to the request's tools (guided or strict).
A schema too large or with no finite instance (`schema_finiteness.py`) is refused with a
`GrammarError` (a 400); `engine/decoding/grammar_matcher.py` compiles the text into the matcher the
engine thread masks logits with.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from semantic.actors.prompting.schema_finiteness import has_finite_instance
from semantic.engine.decoding.grammar_matcher import GrammarError

# Compact JSON the way the models' training data writes it; no free whitespace, so a model cannot
# pad forever inside a constrained value.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_BYTES = 64 * 1024


def json_schema_grammar(schema: dict[str, Any], where: str) -> str:
    """The grammar of JSON text valid against `schema` (`where` names the field in errors)."""
    check_schema(schema, where)
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)  # type: ignore[arg-type]
    except ValueError as error:
        raise GrammarError(f"{where}: {error}") from None


def tool_call_grammar(
    name: str | None, arguments_key: str, tools: list[dict[str, Any]], closer: str | None, where: str
) -> str:
    """The grammar of the rest of a forced JSON tool call, after its opening (already in the prompt):
    to the tool `name`, the arguments after `{"name": "x", "arguments": `; to any tool (None), the
    rest from inside `{"name": "`."""
    if name is None:
        return _any_call_grammar("", tools, arguments_key, closer, where)
    (tool,) = [tool for tool in tools if tool["function"]["name"] == name]
    return f"start: {_inline_json(tool['function'], where)} {_closing(closer)}\n"


def strict_calls_grammar(
    tools: list[dict[str, Any]], arguments_key: str, closer: str | None, where: str, head: str = ""
) -> str:
    """The grammar of one JSON call to any of `tools` from `head` (the opening's text between the
    trigger and `{"name": "`) on: for a lazy matcher that the format's call opening triggers (a model
    that chooses to call). A head that starts with a newline may leave it out."""
    return _any_call_grammar(_head(head + _NAME_HEAD), tools, arguments_key, closer, where)


_NAME_HEAD = '{"name": "'


def _head(text: str) -> str:
    if text.startswith("\n"):
        return f'"\\n"? {json.dumps(text[1:])}'
    return json.dumps(text)


def loosened(tool: dict[str, Any]) -> dict[str, Any]:
    """`tool` with arguments held to nothing but a JSON object: for a tool whose schema cannot be
    enforced when guidance, not the client, asked for it."""
    return {**tool, "function": {**tool["function"], "parameters": {"type": "object"}}}


def _any_call_grammar(
    head: str, tools: list[dict[str, Any]], arguments_key: str, closer: str | None, where: str
) -> str:
    rules = []
    for index, tool in enumerate(tools):
        name_and_key = json.dumps(f'{tool["function"]["name"]}", "{arguments_key}": ')
        rules.append(
            f"call_{index}: {name_and_key} {_inline_json(tool['function'], where)} {_closing(closer)}"
        )
    choice = " | ".join(f"call_{index}" for index in range(len(tools)))
    return f"start: {head} ({choice})\n" + "\n".join(rules) + "\n"


def _closing(closer: str | None) -> str:
    return json.dumps("}\n" + closer if closer else "}")


def _inline_json(function: dict[str, Any], where: str) -> str:
    schema = dict(function.get("parameters") or {"type": "object"})
    check_schema(schema, f"{where} {function['name']!r}")
    schema["x-guidance"] = JSON_STYLE
    return "%json " + json.dumps(schema)


def check_schema(schema: dict[str, Any], where: str) -> None:
    """Raises GrammarError for a schema too large to compile or with no finite instance."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(
            f"{where}: the schema is {size} bytes, more than this server allows ({MAX_SCHEMA_BYTES})"
        )
    if not has_finite_instance(schema):
        raise GrammarError(
            f"{where}: no finite JSON value satisfies the schema: it requires an instance of itself "
            'inside every instance (a $ref cycle, such as {"$ref": "#"}, with no way out)'
        )
