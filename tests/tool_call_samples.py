"""Each tool-call family's real call syntax, and tokenizers whose chat templates write it.

A family's `call` is one call to get_weather(city="Paris", days=3) as its models write it (from
mlx-lm's parsers and tests and the families' chat templates). Its template fragment renders an
assistant's `tool_calls` the same way, with the markers mlx-lm infers the family from, so
`tokenizer_for(family)` gives a tokenizer (the default model's vocabulary) that mlx-lm's loader
reads as that family; the tests check that the template writes `call` exactly.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from semantic.engine.model.default_model import ensure_default_model

ARGUMENTS = {"city": "Paris", "days": 3}
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
TEXT_BEFORE = "Let me check. "


@dataclass(frozen=True, slots=True)
class Family:
    key: str  # the sample's name (a family may have two syntaxes)
    parser: str  # the format ChatFormat detects
    call: str
    fragment: str | None  # Jinja for one `tool_call` in an assistant turn; None: the default template
    parser_type: str | None = None  # tokenizer_config.json `tool_parser_type`, for families named there
    text_before: str = TEXT_BEFORE  # Llama 3's bare call must open the reply


def _jinja(fragment: str) -> str:
    """Short names in the fragments below: @NAME, @ARGS and @EACH (a loop over the arguments)."""
    return (
        fragment.replace("@NAME", "tool_call.function.name")
        .replace("@ARGS", "tool_call.function.arguments")
        .replace("@EACH", "{% for k, v in tool_call.function.arguments.items() %}")
    )


_GLM = _jinja(
    "{{ '<tool_call>' + @NAME }}@EACH{{ '<arg_key>' + k + '</arg_key><arg_value>' + v|string"
    " + '</arg_value>' }}{% endfor %}{{ '</tool_call>' }}"
)
_GLM_CALL = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)

FAMILIES = [
    Family(
        "qwen3_coder",
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        _jinja(
            r"{{ '<tool_call>\n<function=' + @NAME + '>\n' }}@EACH"
            r"{{ '<parameter=' + k + '>\n' + v|string + '\n</parameter>\n' }}{% endfor %}"
            r"{{ '</function>\n</tool_call>' }}"
        ),
    ),
    Family(
        "json_tools",
        "json_tools",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "{% set tool_call = tool_call.function %}"  # as Qwen2.5's template: mlx-lm looks for it
        r"""{{ '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}"""
        r"{{ tool_call.arguments|tojson }}{{ '}\n</tool_call>' }}",
    ),
    Family("glm47", "glm47", _GLM_CALL, _GLM),
    Family("laguna", "laguna", _GLM_CALL, _GLM, parser_type="laguna"),
    Family(
        "minimax_m2",
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        _jinja(
            r"""{{ '<minimax:tool_call>\n<invoke name="' + @NAME + '">\n' }}@EACH"""
            r"""{{ '<parameter name="' + k + '">' + v|string + '</parameter>\n' }}{% endfor %}"""
            r"{{ '</invoke>\n</minimax:tool_call>' }}"
        ),
    ),
    Family(
        "kimi_k2",
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
        _jinja(
            "{{ '<|tool_calls_section_begin|><|tool_call_begin|>functions.' + @NAME"
            " + ':0<|tool_call_argument_begin|>' + @ARGS|tojson"
            " + '<|tool_call_end|><|tool_calls_section_end|>' }}"
        ),
    ),
    Family(
        "kimi_k3",
        "kimi_k3",
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>",
        _jinja(
            """{{ '<|open|>tools<|sep|><|open|>call tool="' + @NAME + '" index="1"<|sep|>' }}@EACH"""
            """{{ '<|open|>argument key="' + k + '" type="' + ('string' if v is string else 'integer')"""
            """ + '"<|sep|>' + v|string + '<|close|>argument<|sep|>' }}{% endfor %}"""
            "{{ '<|close|>call<|sep|><|close|>tools<|sep|>' }}"
        ),
        parser_type="kimi_k3",  # its models are found by their vocabulary, which ours is not
    ),
    Family(
        "longcat",
        "longcat",
        "<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
        "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n"
        "<longcat_arg_value>3</longcat_arg_value>\n</longcat_tool_call>",
        _jinja(
            r"{{ '<longcat_tool_call>' + @NAME + '\n' }}@EACH"
            r"{{ '<longcat_arg_key>' + k + '</longcat_arg_key>\n<longcat_arg_value>' + v|string"
            r" + '</longcat_arg_value>\n' }}{% endfor %}{{ '</longcat_tool_call>' }}"
        ),
    ),
    Family(
        "minicpm5",
        "minicpm5",
        '<function name="get_weather"><param name="city">Paris</param>'
        '<param name="days">3</param></function>',
        _jinja(
            """{{ '<function name="' + @NAME + '">' }}@EACH"""
            """{{ '<param name="' + k + '">' + v|string + '</param>' }}{% endfor %}{{ '</function>' }}"""
        ),
    ),
    Family(
        "muse_spark",
        "muse_spark",
        '<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">Paris'
        '</atem:parameter><atem:parameter name="days">3</atem:parameter></atem:invoke></atem:function_calls>',
        _jinja(
            """{{ '<atem:function_calls><atem:invoke name="' + @NAME + '">' }}@EACH"""
            """{{ '<atem:parameter name="' + k + '">' + v|string + '</atem:parameter>' }}{% endfor %}"""
            "{{ '</atem:invoke></atem:function_calls>' }}"
        ),
    ),
    Family(
        "pythonic",
        "pythonic",
        '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>',
        _jinja(
            "{{ '<|tool_call_start|>[' + @NAME + '(' }}@EACH{{ k + '=' + v|tojson }}"
            "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ')]<|tool_call_end|>' }}"
        ),
    ),
    Family(
        "gemma4",
        "gemma4",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        _jinja(
            "{{ '<|tool_call>call:' + @NAME + '{' }}@EACH{{ k + ':' }}"
            """{% if v is string %}{{ '<|"|>' + v + '<|"|>' }}{% else %}{{ v|tojson }}{% endif %}"""
            "{% if not loop.last %}{{ ',' }}{% endif %}{% endfor %}{{ '}<tool_call|>' }}"
        ),
    ),
    Family(
        "function_gemma",
        "function_gemma",
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>",
        _jinja(
            "{{ '<start_function_call>call:' + @NAME + '{' }}@EACH{{ k + ':' }}"
            "{% if v is string %}{{ '<escape>' + v + '<escape>' }}{% else %}{{ v|tojson }}{% endif %}"
            "{% if not loop.last %}{{ ',' }}{% endif %}{% endfor %}{{ '}<end_function_call>' }}"
        ),
    ),
    Family(
        "mistral",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        _jinja("{{ '[TOOL_CALLS]' + @NAME + '[ARGS]' + @ARGS|tojson }}"),
    ),
    Family(
        "mistral_v3",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        _jinja("""{{ '[TOOL_CALLS][{"name": "' + @NAME + '", "arguments": ' + @ARGS|tojson + '}]' }}"""),
    ),
    Family(
        "llama3",
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        _jinja("""{{ '{"name": "' + @NAME + '", "parameters": ' + @ARGS|tojson + '}' }}"""),
        text_before="",
    ),
    Family(
        "llama3_python_tag",
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        _jinja("""{{ '<|python_tag|>{"name": "' + @NAME + '", "parameters": ' + @ARGS|tojson + '}' }}"""),
    ),
    Family(
        "hermes",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        None,  # the default model's template renders no tools: we describe them Hermes-style
    ),
]
BY_KEY = {family.key: family for family in FAMILIES}

# ChatML, as the default model writes it, with tools and assistant tool calls.
_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nINSTRUCTIONS"
    "{% for tool in tools %}{{ tool|tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% endif %}"
    "{% for tool_call in message.tool_calls or [] %}FRAGMENT{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_LLAMA_INSTRUCTIONS = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n"
)


@functools.cache
def tokenizer_for(key: str) -> TokenizerWrapper:
    """The default model's tokenizer with `key`'s chat template, loaded by mlx-lm's own loader."""
    family = BY_KEY[key]
    source = ensure_default_model("float32")
    if family.fragment is None:
        return load_tokenizer(source)
    folder = Path(tempfile.mkdtemp(prefix=f"tool-format-{key}-"))
    (folder / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config: dict[str, Any] = json.loads((source / "tokenizer_config.json").read_text())
    template = _TEMPLATE.replace("FRAGMENT", family.fragment)
    template = template.replace("INSTRUCTIONS", _LLAMA_INSTRUCTIONS if family.parser == "llama3" else "")
    config["chat_template"] = template
    if family.parser_type:
        config["tool_parser_type"] = family.parser_type
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return load_tokenizer(folder)
