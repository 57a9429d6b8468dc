"""Guided and strict tool calls in the formats whose arguments are not one JSON object (issue 80):
Qwen3-Coder, GLM-4.7, MiniMax-M2 and pythonic. Each family's grammar (actors/prompting/tool_call_grammars.py)
is checked against mlx-lm's own parser for it, through our ToolCallParser: a call as the family's
chat template renders it is accepted when the parser reads it back as written, and whatever the
grammar accepts (adversarial values, random walks through its masks) the parser reads as a call
to a declared tool whose arguments are valid against its schema."""

from __future__ import annotations

import functools
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLTokenizer

from semantic.actors.prompting.chat_format import ChatFormat
from semantic.actors.prompting.tool_call_grammars import (
    _SPACE,
    CallGrammars,
    Tools,
    _pattern_without,
    call_grammars,
)
from semantic.actors.turns import ForcedCall, ToolChoice, TurnRequest, output_grammar
from semantic.engine.decoding.grammar_matcher import (
    TRIGGER_SEPARATOR,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
)
from semantic.engine.decoding.sampling import SamplingParams
from semantic.protocols.tool_parser import TextPart, ToolCallEnd, ToolCallParser
from tests.tool_call_samples import BY_KEY, TOOLS, tokenizer_for

FAMILIES = ("qwen3_coder", "glm47", "minimax_m2", "pythonic")
BEFORE, AFTER = "Let me check. ", " Done."
# Tags the families use, and pieces of them: what adversarial values are made of.
PIECES = [
    "</parameter>", "</function>", "</tool_call>", "</arg_value>", "</invoke>", "</minimax:tool_call>",
    "<|tool_call_end|>", "<parameter=x>", "<arg_key>", "</param", "<function=", "null", "NULL", "None",
    " ", "\n", "\t", "<", ">", "/", '"', "'", "\\", "a", "é", "😀", "{", "}", "[", "]", "1", "True", "=", ",",
]  # fmt: skip


@dataclass(frozen=True)
class Family:
    key: str
    chat: ChatFormat
    grammars: CallGrammars
    compiler: GrammarCompiler


@functools.cache
def family(key: str) -> Family:
    tokenizer = tokenizer_for(key)
    chat = ChatFormat(tokenizer)
    grammars = call_grammars(chat.tool_format, tokenizer)
    assert grammars is not None
    return Family(key, chat, grammars, GrammarCompiler(tokenizer, list(tokenizer.eos_token_ids)))


def render(key: str, name: str, arguments: dict[str, Any]) -> str:
    """The call as the family's own chat template writes an assistant's `tool_calls` (Qwen3-Coder:
    mappings and lists as JSON, the rest through Jinja's `string`; GLM-4.7 and MiniMax-M2: strings
    as they are, the rest as JSON; pythonic: JSON)."""
    dumps = functools.partial(json.dumps, ensure_ascii=False)
    if key == "qwen3_coder":
        text = f"<tool_call>\n<function={name}>\n"
        for k, v in arguments.items():
            value = dumps(v) if isinstance(v, (dict, list)) else str(v)
            text += f"<parameter={k}>\n{value}\n</parameter>\n"
        return text + "</function>\n</tool_call>"
    if key == "glm47":
        pairs = [
            f"<arg_key>{k}</arg_key><arg_value>{_str_or_json(v)}</arg_value>" for k, v in arguments.items()
        ]
        return f"<tool_call>{name}{''.join(pairs)}</tool_call>"
    if key == "minimax_m2":
        pairs = [f'<parameter name="{k}">{_str_or_json(v)}</parameter>\n' for k, v in arguments.items()]
        return f'<minimax:tool_call>\n<invoke name="{name}">\n{"".join(pairs)}</invoke>\n</minimax:tool_call>'
    assert key == "pythonic"
    keywords = ", ".join(f"{k}={dumps(v)}" for k, v in arguments.items())
    return f"<|tool_call_start|>[{name}({keywords})]<|tool_call_end|>"


def _str_or_json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def parse(key: str, tools: list[dict[str, Any]], text: str) -> tuple[list[tuple[str, Any]], str]:
    """The calls our parser (mlx-lm's for the family) reads in `text`, and the text around them."""
    parser = ToolCallParser(family(key).chat.tool_format, tools)
    parts = parser.feed(text) + parser.finish()
    calls = [(part.name, part.arguments) for part in parts if isinstance(part, ToolCallEnd)]
    return calls, "".join(part.text for part in parts if isinstance(part, TextPart))


class Driver:
    """Steps a matcher the way mlx-lm's BatchGenerator calls a logits processor."""

    def __init__(self, matcher: GrammarMatcher, vocab_size: int) -> None:
        self.matcher, self.tokens = matcher, [1]
        self.logits = mx.zeros((1, vocab_size))
        self.allowed = self._step()

    def _step(self) -> np.ndarray:
        return np.isfinite(np.array(self.matcher(mx.array(self.tokens), self.logits)[0]))

    def feed(self, token_ids: list[int]) -> bool:
        """Whether the grammar allowed every token."""
        for token in token_ids:
            if not self.allowed[token]:
                return False
            self.tokens.append(token)
            self.allowed = self._step()
        return True

    def feed_text(self, text: str, key: str) -> bool:
        """Whether the grammar lets `text` through in some tokenization: at each step the longest
        allowed token that begins the rest. llguidance lets text it forces be written only in that
        text's own tokenization, never merged with what may follow it: a model is made to split a
        token there, and the text is the same."""
        rest, pieces = text.encode(), token_pieces(key)
        while rest:
            starts = (pieces.get(rest[:length], ()) for length in range(min(len(rest), MAX_PIECE), 0, -1))
            token = next((t for ids in starts for t in ids if self.allowed[t]), None)
            if token is None:
                return False
            rest = rest[len(pieces_of(key)[token]) :]
            self.tokens.append(token)
            self.allowed = self._step()
        return True


MAX_PIECE = 64


@functools.cache
def pieces_of(key: str) -> dict[int, bytes]:
    """Each token's bytes, as llguidance reads them."""
    tokenizer = family(key).chat.tokenizer
    ll_tokenizer = LLTokenizer(tokenizer.backend_tokenizer.to_str())
    return {i: ll_tokenizer.decode_bytes([i]) for i in range(len(tokenizer.vocab))}


@functools.cache
def token_pieces(key: str) -> dict[bytes, list[int]]:
    eos = set(family(key).chat.tokenizer.eos_token_ids)
    by_piece: dict[bytes, list[int]] = {}
    for token, piece in pieces_of(key).items():
        if piece and token not in eos:
            by_piece.setdefault(piece, []).append(token)
    return by_piece


def accepts_reply(key: str, tools: Tools, reply: str) -> bool:
    """Whether the lazy grammar of `tools` lets the reply through, and is done with it at its end."""
    f = family(key)
    tokenizer = f.chat.tokenizer
    driver = Driver(
        f.compiler.matcher(f.grammars.lazy(tools, "tools"), f.grammars.trigger), len(tokenizer.vocab)
    )
    return driver.feed_text(reply, key) and bool(driver.allowed.all())


def accepts_forced(key: str, tools: Tools, name: str | None, call: str) -> bool:
    """Whether the forced grammar lets the call's rest (after the opening the prompt wrote) through,
    and then allows only the reply's end."""
    f = family(key)
    tokenizer = f.chat.tokenizer
    prefix = f.chat.forced_call_prefix(name)
    assert call.startswith(prefix), (call, prefix)
    driver = Driver(f.compiler.matcher(f.grammars.forced(name, tools, "tools")), len(tokenizer.vocab))
    if not driver.feed_text(call.removeprefix(prefix), key):
        return False
    return {int(t) for t in np.flatnonzero(driver.allowed)} <= set(tokenizer.eos_token_ids)


def tool(name: str, properties: dict[str, Any], required: list[str], strict: bool = True) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": schema, "strict": strict}}


# The grammars' own limits, below what the parsers read back: numbers read through a float, and
# strings a parser that tries JSON and Python literals first would keep but that look like one.
LOOKS_LIKE_A_LITERAL = re.compile(
    r"""[\x00-\x20 0-9"'(\[{+.-].*|(True|False|None|true|false|null|NaN|Infinity)([^A-Za-z0-9_].*)?"""
    r"""|[bBuUrRfF]{1,2}['"].*""",
    re.DOTALL,
)


def within_limits(key: str, schema: dict[str, Any], value: Any) -> bool:
    """Whether the grammar writes `value` as the template renders it (where the parser reads it back)."""
    if key == "pythonic" and "<|tool_call_end|>" in json.dumps(value):
        return False  # our parser reads a closer in a JSON string back; mlx-lm's server would not
    if isinstance(value, str):
        if read_as_literal(key, schema):
            return not LOOKS_LIKE_A_LITERAL.fullmatch(value) and not value[:1].isspace()
        return not (key == "qwen3_coder" and "type" not in schema and value.lstrip()[:1] in ("{", "["))
    if key not in ("qwen3_coder", "minimax_m2") or isinstance(value, (bool, dict, list)) or value is None:
        return True
    if schema.get("type") == "integer":  # through a float: exact to 15 digits
        return abs(value) < 10**15
    return bool(re.fullmatch(r"-?(0|[1-9][0-9]{0,199})(\.[0-9]+)?([eE][+-]?[0-9]{1,2})?", str(value)))


def read_as_literal(key: str, schema: dict[str, Any]) -> bool:
    """Whether the parser reads a string parameter as JSON or a Python literal before as text."""
    return (key == "qwen3_coder" and isinstance(schema.get("type"), list)) or (
        key == "glm47" and schema.get("type") != "string"
    )


def validates(schema: dict[str, Any], value: Any) -> bool:
    return bool(jsonschema.Draft202012Validator(schema).is_valid(value))


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values (a float that is a whole number reads back as an int)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


texts = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
json_leaves = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | texts
# (schema, values) for one parameter; a family that cannot carry a value must refuse its rendering.
KINDS: list[tuple[dict[str, Any], st.SearchStrategy[Any]]] = [
    ({"type": "string"}, texts),
    ({"type": "string", "maxLength": 4}, texts.filter(lambda t: len(t) <= 4)),
    (
        {"type": "string", "enum": ["a b", "</x>", "null", " pad "]},
        st.sampled_from(["a b", "</x>", "null", " pad "]),
    ),
    ({"type": "integer"}, st.integers(-(10**17), 10**17)),
    ({"type": "integer", "minimum": 0, "maximum": 500}, st.integers(0, 500)),
    ({"type": "number"}, st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**6), 10**6)),
    ({"type": "boolean"}, st.booleans()),
    ({"type": "array", "items": {"type": "string"}}, st.lists(texts, max_size=3)),
    (
        {
            "type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
            "required": ["path"],
            "additionalProperties": False,
        },
        # llguidance writes an object's properties in the schema's order
        st.fixed_dictionaries({"path": texts}, optional={"line": st.integers(-5, 5)}).map(
            lambda d: {k: d[k] for k in ("path", "line") if k in d}
        ),
    ),
    ({"type": "object"}, st.dictionaries(texts, json_leaves, max_size=3)),
]
NULLABLE_STRING = ({"type": ["string", "null"]}, st.none() | texts)
PYDANTIC_OPTIONAL = ({"anyOf": [{"type": "string"}, {"type": "null"}]}, st.none() | texts)
UNIONS = {  # unions, each as its family's parser reads it: JSON, Python literals or text
    "qwen3_coder": [
        ({"type": ["integer", "null"]}, st.none() | st.integers(-1000, 1000)),
        NULLABLE_STRING,
        PYDANTIC_OPTIONAL,
    ],
    "glm47": [NULLABLE_STRING, PYDANTIC_OPTIONAL],
    "minimax_m2": [NULLABLE_STRING, PYDANTIC_OPTIONAL],
    "pythonic": [PYDANTIC_OPTIONAL],
}


@st.composite
def tools_and_calls(draw: st.DrawFn, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    kinds = [*KINDS, *UNIONS[key]]
    chosen = draw(st.lists(st.sampled_from(range(len(kinds))), min_size=1, max_size=3))
    properties, arguments, required = {}, {}, []
    for at, index in enumerate(chosen):
        schema, values = kinds[index]
        name = f"p{at}"
        properties[name] = schema
        if draw(st.booleans()):
            required.append(name)
        if name in required or draw(st.booleans()):
            arguments[name] = draw(values)
    return tool("edit_file", properties, required), arguments


@pytest.mark.parametrize("key", FAMILIES)
def test_each_sample_call_is_accepted_lazily_and_forced(key: str) -> None:
    """tests/tool_call_samples.py: get_weather(city="Paris", days=3) as each family writes it."""
    tools: Tools = [(t, "exact") for t in TOOLS]
    call = BY_KEY[key].call
    assert accepts_reply(key, tools, BEFORE + call + AFTER)
    assert accepts_forced(key, tools, "get_weather", call)
    assert accepts_forced(key, tools, None, call)
    assert parse(key, TOOLS, BEFORE + call + AFTER)[0] == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("key", FAMILIES)
def test_a_reply_may_end_a_call_without_its_blocks_closer(key: str) -> None:
    """Models end their reply after a call's last tag, leaving the block's closer out; mlx-lm's
    parser reads the block the reply left open, so the grammar allows that end, and only there."""
    f = family(key)
    closer = f.chat.tool_format.end
    call = BY_KEY[key].call.removesuffix(closer).removesuffix("\n" if key == "qwen3_coder" else "")
    tokenizer = f.chat.tokenizer
    driver = Driver(
        f.compiler.matcher(f.grammars.lazy([(TOOLS[0], "exact")], "tools"), f.grammars.trigger), 1
    )
    driver = Driver(driver.matcher, len(tokenizer.vocab))
    assert driver.feed(tokenizer.encode(BEFORE + call, add_special_tokens=False))
    assert driver.allowed[list(tokenizer.eos_token_ids)].all() and not driver.allowed.all()
    assert parse(key, TOOLS, BEFORE + call)[0] == [("get_weather", {"city": "Paris", "days": 3})]


def accepted_exactly_when_it_reads_back_as_written(key: str, data: st.DataObject) -> None:
    """A call as the family's template renders it is accepted (forced, after the prompt's opening;
    then lazily, from the trigger, too) when its parser reads it back as the rendering of a valid
    call, and only then: never one that reads back as other arguments, or not at all."""
    spec, arguments = data.draw(tools_and_calls(key))
    schema = spec["function"]["parameters"]
    jsonschema.validate(arguments, schema)
    call = render(key, "edit_file", arguments)
    accepted = accepts_forced(key, [(spec, "exact")], "edit_file", call)
    if accepted:  # the lazy grammar lets it through too (it may also read a call's end earlier, text after)
        assert accepts_reply(key, [(spec, "exact")], BEFORE + call + AFTER)
    calls, text = parse(key, [spec], BEFORE + call + AFTER)
    read = calls[0][1] if len(calls) == 1 and calls[0][0] == "edit_file" and text == BEFORE + AFTER else None
    # Some renderings are ambiguous (the string "null" and None alike): they read as the other value.
    # Each argument reads back as its value or as one rendered alike (0.0 reads as 0, "None" as None).
    reads_back = (
        read is not None
        and read.keys() == arguments.keys()
        and render(key, "edit_file", {k: v if same(v, read[k]) else read[k] for k, v in arguments.items()})
        == call
    )
    reads_back = reads_back and validates(schema, read)
    properties = schema["properties"]
    if accepted:
        # Text that looks like a literal is one, where the parser reads literals first: "3" is 3.
        looks_like_a_literal = any(
            isinstance(v, str)
            and read_as_literal(key, properties[k])
            and not within_limits(key, properties[k], v)
            for k, v in arguments.items()
        )
        assert reads_back or (looks_like_a_literal and read is not None and validates(schema, read)), (
            call,
            read,
        )
    elif reads_back:
        assert not all(within_limits(key, properties[k], v) for k, v in arguments.items()), (call, read)


def drawing(num_calls: int) -> Any:
    """The property above over `num_calls` drawn calls of each family."""
    draws = settings(max_examples=num_calls, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    return pytest.mark.parametrize("key", FAMILIES)(
        draws(given(data=st.data())(accepted_exactly_when_it_reads_back_as_written))
    )


# The default suite draws 15 calls of each family; the slow tests (which CI also runs) draw 120.
test_a_call_is_accepted_exactly_when_it_reads_back_as_written = drawing(15)
test_many_more_calls_are_accepted_exactly_when_they_read_back_as_written = pytest.mark.slow(drawing(120))


def random_call(key: str, tools: Tools, rng: random.Random, limit: int = 400) -> str | None:
    """A call the lazy grammar allows, from its trigger on, each next token drawn at random from its
    mask, up to the call's close or the reply's end; None where neither came within `limit` tokens."""
    f = family(key)
    tokenizer = f.chat.tokenizer
    trigger = rng.choice(f.grammars.trigger.split(TRIGGER_SEPARATOR))
    driver = Driver(
        f.compiler.matcher(f.grammars.lazy(tools, "tools"), f.grammars.trigger), len(tokenizer.vocab)
    )
    assert driver.feed(tokenizer.encode(BEFORE + trigger, add_special_tokens=False))
    for _ in range(limit):
        if driver.allowed.all():  # closed: free text again
            return str(tokenizer.decode(driver.tokens[1:]))
        choices = np.flatnonzero(driver.allowed)
        assert len(choices), "the grammar allows nothing"
        token = int(rng.choice(list(choices)))
        if token in tokenizer.eos_token_ids:
            return str(tokenizer.decode(driver.tokens[1:]))
        assert driver.feed([token])
    return None


BOUNDED = {  # values a random walk closes: bounded strings, small objects and lists
    "path": {"type": "string", "maxLength": 6},
    "mode": {"type": "string", "enum": ["r", "w"]},
    "count": {"type": "integer"},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "force": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "range": {
        "type": "object",
        "properties": {"start": {"type": "integer", "minimum": 0, "maximum": 9}, "end": {"type": "integer"}},
        "required": ["start"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("key", FAMILIES)
def test_random_walks_through_the_grammar_read_back_as_valid_calls(key: str) -> None:
    tools = [
        tool("write", {k: BOUNDED[k] for k in ("path", "mode", "count", "force")}, ["path", "count"]),
        tool("tag", {k: BOUNDED[k] for k in ("ratio", "tags", "range")}, ["range"]),
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    rng = random.Random(80)
    closed = 0
    for _ in range(12):
        text = random_call(key, [(t, "exact") for t in tools], rng)
        if text is None:
            continue
        closed += 1
        calls, rest = parse(key, tools, text)
        assert calls and rest == BEFORE, text
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])
    assert closed >= 6


@pytest.mark.parametrize("key", ["glm47", "minimax_m2", "pythonic"])
def test_a_union_keeps_its_bounds(key: str) -> None:
    spec = tool("wait", {"seconds": {"type": ["integer", "null"], "minimum": 5, "maximum": 60}}, ["seconds"])
    for seconds, allowed in ((7, True), (None, True), (3, False), (61, False)):
        call = render(key, "wait", {"seconds": seconds})
        assert accepts_forced(key, [(spec, "exact")], "wait", call) == allowed, call


def test_the_keep_out_pattern_refuses_exactly_the_words() -> None:
    words = ("</parameter>", "</tool_call>", "<|tool_call_end|>")
    pattern = re.compile(_pattern_without(words))

    @settings(max_examples=300, deadline=None)
    @given(
        st.lists(
            st.sampled_from(["<", "/", "|", ">", "p", "t", "</param", "</tool_", "eter>", "a", "\n", *words])
        )
    )
    def check(pieces: list[str]) -> None:
        text = "".join(pieces)
        assert bool(pattern.fullmatch(text)) == (not any(word in text for word in words)), text

    check()


def test_the_whitespace_class_is_what_python_strips() -> None:
    spaces = {c for c in map(chr, range(0x110000)) if c.isspace()}
    ranges = re.findall(r"\\x\{([0-9a-f]+)\}(?:-\\x\{([0-9a-f]+)\})?", _SPACE)
    listed = {chr(c) for low, high in ranges for c in range(int(low, 16), int(high or low, 16) + 1)}
    assert listed == spaces


# Which schemas are enforced, loosened or refused.

FORMATS = ("qwen3_coder", "glm47", "minimax_m2", "pythonic", "laguna")


def turn(tools: list[dict[str, Any]], guided: bool = True, choice: ToolChoice | None = None) -> TurnRequest:
    return TurnRequest(
        "r", None, [{"role": "user", "content": "hi"}], SamplingParams(), tools=tools,
        tool_choice=choice or ToolChoice(), guided_tool_calls=guided,
    )  # fmt: skip


@pytest.mark.parametrize("key", FORMATS)
def test_strict_tools_are_enforced_in_every_xml_format(key: str) -> None:
    chat = ChatFormat(tokenizer_for(key))
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    compiler = GrammarCompiler(chat.tokenizer, list(chat.tokenizer.eos_token_ids))
    for guided in (True, False):
        grammar = output_grammar(chat, turn(strict, guided), None)
        assert grammar is not None and grammar.trigger
        assert not (grammar.fallback or grammar).is_optional  # never dropped: enforced or refused
        compiler.matcher(grammar.grammar, grammar.trigger)
    forced = output_grammar(chat, turn(strict, choice=ToolChoice("required")), ForcedCall("get_weather"))
    assert forced is not None and forced.trigger is None
    compiler.matcher(forced.grammar)


def test_qwen3_coder_calls_trigger_on_the_bare_function_block_too() -> None:
    grammar = output_grammar(ChatFormat(tokenizer_for("qwen3_coder")), turn(TOOLS), None)
    assert grammar is not None and grammar.trigger == f"<tool_call>{TRIGGER_SEPARATOR}<function="
    call = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
    assert accepts_reply("qwen3_coder", [(TOOLS[0], "exact")], BEFORE + call + AFTER)
    assert parse("qwen3_coder", TOOLS, BEFORE + call + AFTER)[0] == [("get_weather", {"city": "Paris"})]


def test_what_a_format_cannot_carry_is_refused_for_strict_tools_and_loosened_otherwise() -> None:
    chat = ChatFormat(tokenizer_for("qwen3_coder"))
    patterned = {"type": "string", "pattern": "^[a-z]+$"}
    for strict in (True, False):
        spec = tool("lookup", {"word": patterned}, ["word"], strict=strict)
        if strict:
            with pytest.raises(GrammarError, match=r"'lookup': parameter 'word'.*pattern"):
                output_grammar(chat, turn([spec]), None)
        else:
            grammar = output_grammar(chat, turn([spec]), None)
            assert grammar is not None and grammar.is_optional
            assert accepts_reply(
                "qwen3_coder", [(spec, "best")], render("qwen3_coder", "lookup", {"word": "A1"})
            )
