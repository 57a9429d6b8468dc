"""Which tool-call format the served model writes, found the way mlx-lm finds it.

mlx-lm's tokenizer loader names a parser (`tool_parser_type` in the tokenizer config, else inferred
from the chat template or the vocabulary) and its `TokenizerWrapper` carries that parser's
`parse_tool_call`, `tool_call_start` and `tool_call_end`; we read those three and nothing else, so
every family mlx-lm ships is served (Qwen3-Coder, GLM-4.x, Kimi-K2/K3, MiniMax-M2, Gemma, Mistral,
pythonic, JSON, ...). Ours, where mlx-lm has nothing:

- Hermes: templates that render no tools get them Hermes-style from `chat_format` and are read
  back with mlx-lm's JSON parser between `<tool_call>` tags.
- Llama 3.x: templates that ask for a bare `{"name", "parameters"}` object (or one after
  `<|python_tag|>`); mlx-lm has no parser for it.
- `call_opening`: how each family opens a call to a named tool, to force one (`tool_choice`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from semantic.engine.mlx_adapter.api import json_tools

ToolSchemas = list[dict[str, Any]]
ParseToolCall = Callable[[str, ToolSchemas | None], Any]

NAME = "{name}"
# How each mlx-lm family opens a call to NAME, from its chat template's rendering of a call.
_CALL_OPENINGS = {
    "function_gemma": "<start_function_call>call:{name}{",
    "gemma4": "<|tool_call>call:{name}{",
    "glm47": "<tool_call>{name}",
    "laguna": "<tool_call>{name}",
    "json_tools": '<tool_call>\n{"name": "{name}", "arguments": ',
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
    ),
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="{name}" index="1"<|sep|>',
    "longcat": "<longcat_tool_call>{name}",
    "minicpm5": '<function name="{name}">',
    "minimax_m2": '<minimax:tool_call>\n<invoke name="{name}">\n',
    "muse_spark": '<atem:function_calls><atem:invoke name="{name}">',
    "pythonic": "<|tool_call_start|>[{name}(",
    "qwen3_coder": "<tool_call>\n<function={name}>\n",
}
# Blocks inside a call that a family's models also write bare (Ollama 16686, 18530 for Qwen3-Coder).
_INNER_BLOCKS = {"qwen3_coder": ("<function=", "</function>")}
_MISTRAL_OPENINGS = ('[TOOL_CALLS][{"name": "{name}", "arguments": ', "[TOOL_CALLS]{name}[ARGS]")


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's calls: the text around a call block and the parser of what is inside it."""

    name: str  # mlx-lm's parser module, or "hermes" / "llama3"
    start: str
    end: str  # "": a call block runs to the end of the reply
    parse: ParseToolCall  # block text (markers stripped) and the request's tools -> call dict(s)
    call_opening: str  # the reply text that opens a call; NAME marks where the tool's name goes
    bare_json_calls: bool = False  # a reply that opens with a `{"name"` object is a call
    # A call's inner block that models write without `start` around it (Qwen3-Coder's
    # `<function=...>...</function>`): read as a call too.
    inner_start: str = ""
    inner_end: str = ""

    def forced_prefix(self, tool_name: str | None) -> str:
        """Reply text that opens a call: to `tool_name`, or, cut before the name, to any tool."""
        if tool_name:
            return self.call_opening.replace(NAME, tool_name)
        return self.call_opening.partition(NAME)[0]


def parse_llama3(text: str, tools: ToolSchemas | None = None) -> list[dict[str, Any]]:
    """One or more `{"name", "parameters"}` objects, separated by `;` or whitespace."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    position = 0
    while (position := _skip(text, position)) < len(text):
        value, position = decoder.raw_decode(text, position)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("a Llama 3 call is an object with a name")
        calls.append(
            {"name": value["name"], "arguments": value.get("parameters", value.get("arguments", {}))}
        )
    if not calls:
        raise ValueError("no call")
    return calls


def _skip(text: str, position: int) -> int:
    while position < len(text) and (text[position].isspace() or text[position] == ";"):
        position += 1
    return position


HERMES = ToolFormat(
    "hermes",
    json_tools.tool_call_start,
    json_tools.tool_call_end,
    json_tools.parse_tool_call,
    _CALL_OPENINGS["json_tools"],
)
LLAMA3 = ToolFormat(
    "llama3", "<|python_tag|>", "", parse_llama3, '{"name": "{name}", "parameters": ', bare_json_calls=True
)


def detect_tool_format(tokenizer: Any) -> ToolFormat:
    """The format of the model whose (mlx-lm) tokenizer this is, for a template that renders tools."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    parse = getattr(tokenizer, "tool_parser", None)
    if parse is not None:
        # mlx-lm writes the name it chose into the config; a module may re-export another's parser.
        name = (
            getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
            or parse.__module__.rpartition(".")[2]
        )
        opening = _CALL_OPENINGS.get(name, tokenizer.tool_call_start)
        if name == "mistral":
            opening = _MISTRAL_OPENINGS["[ARGS]" in template]
        inner = _INNER_BLOCKS.get(name, ("", ""))
        return ToolFormat(
            name, tokenizer.tool_call_start, tokenizer.tool_call_end or "", parse, opening, False, *inner
        )
    if "parameters" in template and "<tool_call>" not in template:
        return LLAMA3
    return HERMES
