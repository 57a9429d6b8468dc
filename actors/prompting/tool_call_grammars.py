"""Grammars of tool calls whose arguments are not one JSON object, each written from the mlx-lm
parser that reads its family back: Qwen3-Coder (`<function=NAME>` with `<parameter=KEY>` blocks),
GLM-4.7 and Laguna (`<arg_key>`/`<arg_value>` pairs), MiniMax-M2 (`<invoke>` with `<parameter
name=...>`) and pythonic (`[name(key=value)]`).

A call names a declared tool and writes its declared parameters in the schema's order, the required
ones always; undeclared ones never, whatever `additionalProperties` allows. A value is written the
way its parser converts it back: a string raw (anything but a tag that would end it or its call
early, and nothing the parser would read as another value: "null" where it reads that as None,
whitespace where it strips it, a literal where it tries JSON or Python's literal_eval first), any
other value as JSON, numbers bounded where the parser goes through a float or Python's int limits.
What a family cannot carry exactly (a string `pattern`, a union the parser would read otherwise) is
refused for a strict tool (GrammarError) and loosened to the parameter's type for the others.
"""

from __future__ import annotations

import json
import keyword
import re
from dataclasses import dataclass
from typing import Any, Literal

from semantic.actors.prompting.output_grammars import JSON_STYLE, check_schema
from semantic.actors.prompting.tool_format import NAME, ToolFormat
from semantic.engine.decoding.grammar_matcher import TRIGGER_SEPARATOR, GrammarError

Mode = Literal["exact", "best", "loose"]  # refuse what cannot be enforced / loosen it / types only
Tools = list[tuple[dict[str, Any], Mode]]  # the request's tools, each with how closely to hold it

NL = "\n"
# What Python's str.strip() removes (str.isspace), as a regex class.
_SPACE = r"[\x{9}-\x{d}\x{1c}-\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}"
_SPACE += r"\x{205f}\x{3000}]"
_NULL = "[nN][uU][lL][lL]"  # what the parsers that read "null" as None compare in lower case
_NONE_NIL = ("[nN][oO][nN][eE]", "[nN][iI][lL]")  # what minimax_m2 also reads as None, where null is a type
# Raw text that json.loads and ast.literal_eval both refuse: what either could begin, a literal
# word, a prefixed string.
_UNQUOTED = (
    r"""[\x{0}-\x{20}0-9"'(\[{\-+.](?s:.*)""",
    r"(True|False|None|true|false|null|NaN|Infinity)([^A-Za-z0-9_](?s:.*))?",
    r"""[bBuUrRfF]{1,2}['"](?s:.*)""",
    f"{_SPACE}(?s:.*)",
)
_NO_CONTAINER = (f"{_SPACE}*[\\[{{](?s:.*)",)  # text that json.loads could read as a dict or a list
_INTEGER = r"/-?(0|[1-9][0-9]{0,14})/"  # exact through a float, and within Python's int-string limit
_NUMBER = r"/-?(0|[1-9][0-9]{0,199})(\.[0-9]+)?([eE][+-]?[0-9]{1,2})?/"  # finite through a float
_BOUND = 10**15  # llguidance writes a bounded number's range as a regex: an open side gets this
_SAFE_INTEGER = 2**53 - 1
_MAX_LENGTH = 1000  # longer counted lengths exhaust llguidance's lexer checks
_BOOL = '("true" | "false" | "True" | "False")'  # read in lower case; JSON's and Python's spellings
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
_KEY = re.compile(r"[!-~]+")  # printable ASCII; each family also refuses its own delimiters
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ANY = "semantic_any"  # the kept-out form of any JSON value, in the embedded schema's $defs
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly"}
_STRING_KEYS = _ANNOTATIONS | {"type", "enum", "const", "minLength", "maxLength"}


class _Inexact(Exception):
    """What the family cannot write exactly; a strict tool's GrammarError."""


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a family writes a value: what follows it up to its closing tag, and what the parser does."""

    post: str  # between the value and its closer
    closer: str
    words: tuple[str, ...]  # what no value may hold: its closer and the tags that end the call early
    strips: bool  # the parser strips whitespace around the value
    reads_null: bool  # the parser reads "null", in any case, as None


class _Writer:
    """A Lark grammar being written: rules by name, lexemes written once, added-token tags."""

    def __init__(self, specials: dict[str, int]) -> None:
        self.specials = specials
        self.rules: dict[str, str] = {}
        self._lexemes: dict[str, str] = {}

    def rule(self, body: str) -> str:
        self.rules[name := f"r{len(self.rules)}"] = body
        return name

    def lexeme(self, regex: str) -> str:
        return self._lexemes.setdefault(regex, f"L{len(self._lexemes)}")

    def text(self, text: str) -> str:
        """`text` as literals, an added token's text matched by that token too."""
        pieces, rest = [], text
        while rest:
            at, marker = min(((rest.find(m), m) for m in self.specials if m in rest), default=(-1, ""))
            if at < 0:
                pieces.append(json.dumps(rest, ensure_ascii=False))
                break
            if at:
                pieces.append(json.dumps(rest[:at], ensure_ascii=False))
            pieces.append(f"(<[{self.specials[marker]}]> | {json.dumps(marker, ensure_ascii=False)})")
            rest = rest[at + len(marker) :]
        return " ".join(pieces)

    def grammar(self, start: str) -> str:
        lines = [f"start: {start}", *(f"{name}: {body}" for name, body in self.rules.items())]
        return "\n".join(lines + [f"{name}: {regex}" for regex, name in self._lexemes.items()]) + "\n"


def _rx(text: str) -> str:
    """`text` as a regex that matches it alone."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


# Values, each with what closes it.


def _raw(w: _Writer, slot: _Slot, schema: dict[str, Any], refused: tuple[str, ...] = ()) -> str:
    """A string written as itself, held to a plain string schema (and not matching `refused`)."""
    if set(schema) - _STRING_KEYS:
        raise _Inexact(f"a string's {sorted(set(schema) - _STRING_KEYS)} cannot be checked written raw")
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = [v for v in values if isinstance(v, str) and _is_raw(slot, v, schema)]
        if not texts:
            raise _Inexact("no value the schema allows can be written raw")
        choice = " | ".join(w.text(text + slot.post) for text in dict.fromkeys(texts))
        return f"({choice}) {w.text(slot.closer)}"
    lengths = schema.get("minLength", 0), schema.get("maxLength")
    if max(lengths[0], lengths[1] or 0) > _MAX_LENGTH:
        raise _Inexact(f"string lengths above {_MAX_LENGTH} cannot be checked written raw")
    return _raw_text(w, slot, *lengths, refused=refused)


def _raw_text(
    w: _Writer, slot: _Slot, min_length: int = 0, max_length: int | None = None, refused: tuple[str, ...] = ()
) -> str:
    """Raw text as one lexeme that ends at the closer; where the closer is one added token, also the
    text without it followed by that token."""
    refused += (_NULL,) if slot.reads_null else ()
    refused += (f"{_SPACE}(?s:.*)", f"(?s:.*){_SPACE}") if slot.strips else ()
    if min_length or max_length is not None:
        refused += (f"(?s:.{{{max_length + 1},}})",) if max_length is not None else ()
        refused += (f"(?s:.{{0,{min_length - 1}}})",) if min_length else ()

    def lexeme(tail: str, words: tuple[str, ...], closer: str = "") -> str:
        parts = [f"/(?s:.*){_rx(tail)}/"]
        parts += [f"~/(?s:.*{_rx(closer)}.+)/"] if closer else []
        parts += [f"~/(?s:.*({'|'.join(map(_rx, words))}).*)/"] if words else []
        return w.lexeme(" & ".join(parts + [f"~/{regex}{_rx(tail)}/" for regex in refused]))

    others = tuple(word for word in slot.words if word != slot.closer)
    whole = lexeme(slot.post + slot.closer, others, slot.closer)
    special = w.specials.get(slot.closer)
    return whole if special is None else f"({whole} | {lexeme(slot.post, slot.words)} <[{special}]>)"


def _is_raw(slot: _Slot, text: str, schema: dict[str, Any]) -> bool:
    """Whether `text`, allowed by `schema`, written raw reads back as itself."""
    if any(word in text + slot.post + slot.closer[:-1] for word in slot.words):
        return False
    if not schema.get("minLength", 0) <= len(text) <= schema.get("maxLength", len(text)):
        return False
    return not (slot.reads_null and text.lower() == "null") and not (slot.strips and text != text.strip())


def _closed(w: _Writer, slot: _Slot, value: str) -> str:
    return f"{value} {w.text(slot.post + slot.closer)}"


def _fixed(w: _Writer, slot: _Slot, text: str) -> str:
    """`text` and its closer as one lexeme, as raw text's is: llguidance's lexer does not step back
    from a longer lexeme that failed to one that ended where the longer went on."""
    whole = w.lexeme(f"/{_rx(text + slot.post + slot.closer)}/")
    special = w.specials.get(slot.closer)
    return whole if special is None else f"({whole} | {w.lexeme(f'/{_rx(text + slot.post)}/')} <[{special}]>)"


def _json(schema: dict[str, Any], root: dict[str, Any], words: tuple[str, ...]) -> str:
    """Any JSON value of `schema` (whose $refs point into `root`) holding none of `words`."""
    pattern = _pattern_without(words) if words else ""
    kept: Any = (lambda sub: _kept_out(sub, pattern)) if words else (lambda sub: sub)
    embedded = kept(schema)
    for defs in ("$defs", "definitions"):
        if isinstance(root.get(defs), dict):
            embedded[defs] = {**embedded.get(defs, {}), **{k: kept(v) for k, v in root[defs].items()}}
    if f"#/$defs/{_ANY}" in json.dumps(embedded):
        embedded["$defs"] = {**embedded.get("$defs", {}), _ANY: _any_value(pattern)}
    return "%json " + json.dumps({**embedded, "x-guidance": JSON_STYLE})


def _number(w: _Writer, schema: dict[str, Any], root: dict[str, Any], integer: bool) -> str:
    """A number a float reads back finite (and, for an integer, exact)."""
    if not {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "enum",
        "const",
    } & set(schema):
        return w.lexeme(_INTEGER if integer else _NUMBER)
    return _json(_clamped(schema, _SAFE_INTEGER if integer else _BOUND), root, ())


def _clamped(schema: dict[str, Any], bound: int) -> dict[str, Any]:
    """`schema` with its numbers inside ±`bound`, and inside its own bounds."""
    low, high = max(schema.get("minimum", -bound), -bound), min(schema.get("maximum", bound), bound)
    return {**schema, "minimum": low, "maximum": high}


def _kept_out(schema: Any, pattern: str) -> dict[str, Any]:
    """`schema` with its strings and object keys held to `pattern`, at every depth."""
    if schema is True or schema == {}:
        return {"$ref": f"#/$defs/{_ANY}"}
    if not isinstance(schema, dict):
        raise _Inexact(f"a schema that is {json.dumps(schema)}")
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: _kept_out(sub, pattern) for name, sub in schema[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            out[key] = [_kept_out(sub, pattern) for sub in schema[key]]
    for key in ("then", "else", "contains", "additionalItems", "unevaluatedItems"):
        if key in schema:
            out[key] = _kept_out(schema[key], pattern)
    types = _types(schema)
    if types is None or "array" in types:
        items = schema.get("items", True)
        out["items"] = (
            [_kept_out(i, pattern) for i in items] if isinstance(items, list) else _kept_out(items, pattern)
        )
    if types is None or "string" in types:
        out |= (
            {"allOf": [*out.get("allOf", []), {"pattern": pattern}]}
            if "pattern" in schema
            else {"pattern": pattern}
        )
    extra = schema.get("additionalProperties", True)
    if (types is None or "object" in types) and extra is not False:
        if "patternProperties" in schema or (extra not in (True, {}) and "properties" in schema):
            raise _Inexact("object keys beside patternProperties or typed additionalProperties")
        out |= {"patternProperties": {pattern: _kept_out(extra, pattern)}, "additionalProperties": False}
    return out


def _any_value(pattern: str) -> dict[str, Any]:
    ref = {"$ref": f"#/$defs/{_ANY}"}
    return {
        "pattern": pattern,
        "patternProperties": {pattern: ref},
        "additionalProperties": False,
        "items": ref,
    }


def _pattern_without(words: tuple[str, ...]) -> str:
    """A regex without look-around (a JSON schema `pattern`) of the text that holds none of `words`;
    each word begins with `<` and holds no other, so a `<` always restarts the match."""
    assert all(w.startswith("<") and "<" not in w[1:] for w in words), "a word that may overlap itself"
    tails = {w[1:] for w in words}

    def next_chars(prefix: str) -> list[str]:
        return sorted({t[len(prefix)] for t in tails if t.startswith(prefix) and len(t) > len(prefix)})

    def escape(chars: str) -> str:
        return "".join(c if c.isascii() and c.isalnum() else f"\\x{ord(c):02x}" for c in chars)

    def leave(prefix: str) -> str:  # from a partial match back to none, on a character other than `<`
        chars = next_chars(prefix)
        ways = [f"[^{escape('<' + ''.join(chars))}]"]
        ways += [escape(c) + leave(prefix + c) for c in chars if prefix + c not in tails]
        return "(?:" + "|".join(ways) + ")"

    def stay(prefix: str) -> str:  # a partial match the text ends in, or that a `<` restarts
        ways = [escape(c) + stay(prefix + c) for c in next_chars(prefix) if prefix + c not in tails]
        return "(?:" + "|".join(["", *ways]) + ")"

    lt = escape("<")
    return f"^(?:[^{lt}]|(?:{lt}{stay('')})*{lt}{leave('')})*(?:{lt}{stay('')})*$"


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return set(kind) if isinstance(kind, list) and all(isinstance(k, str) for k in kind) else None


def _union(schema: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """A schema of one type or a plain union of types (a type list, anyOf/oneOf of single types), as
    each type's own keywords; None for anything else."""
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list):
        if set(schema) - _ANNOTATIONS - {"anyOf", "oneOf"}:
            return None
        union: dict[str, dict[str, Any]] = {}
        for branch in branches:
            part = _union(branch) if isinstance(branch, dict) else None
            if part is None or set(part) & set(union):
                return None
            union |= part
        return union
    types = _types(schema)
    if types is None or (len(types) > 1 and set(schema) - _ANNOTATIONS - {"type"}):
        return None
    return {kind: {k: v for k, v in schema.items() if k != "type"} for kind in types}


def _plain(union: dict[str, dict[str, Any]] | None, kind: str) -> bool:
    return union is not None and kind in union and set(union[kind]) <= _ANNOTATIONS


def _resolved_types(schema: dict[str, Any], root: dict[str, Any]) -> set[str]:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        schema = target if isinstance(target, dict) else schema
    union = _union(schema)
    return set(union) if union else {"?"}


# Families.


class _Family:
    """One family's call syntax around what `arguments` writes, and how its parser reads values."""

    head = ""  # from the block's marker to the first tool's name
    after_name = ""  # between the name and the arguments
    between_calls: str | None = None  # before another call in the same block; None: one a block
    calls_end = ""  # after the block's last call
    block_end = ""  # the block's closer, which the reply's end may take the place of
    keep_out: tuple[str, ...] = ()
    slot = _Slot("", "", (), strips=False, reads_null=False)

    def name_ok(self, name: str) -> bool:
        return bool(_NAME.fullmatch(name))

    def key_ok(self, key: str) -> bool:
        return bool(_KEY.fullmatch(key)) and not {"<", ">", '"'} & set(key)

    def arguments(self, w: _Writer, params: list[tuple[str, str, bool]]) -> str:
        """The call's arguments, from (key, value rule, is required) in order, and its own end."""
        raise NotImplementedError

    def value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        raise NotImplementedError

    def loose_value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        raise NotImplementedError

    def _null(self, w: _Writer) -> str:
        return _fixed(w, self.slot, "null")


def _in_order(params: list[tuple[str, bool]]) -> str:
    return " ".join(rule if required else f"{rule}?" for rule, required in params)


class _Qwen3Coder(_Family):
    head, after_name = "\n<function=", ">\n"

    def __init__(self, bare: bool) -> None:
        self.block_end = "" if bare else "\n</tool_call>"
        self.keep_out = ("</parameter>", "</function>" if bare else "</tool_call>")
        self.slot = _Slot("\n", "</parameter>", self.keep_out, strips=False, reads_null=True)

    def arguments(self, w: _Writer, params: list[tuple[str, str, bool]]) -> str:
        written = [
            (w.rule(f"{w.text('<parameter=' + k + '>' + NL)} {v} {w.text(NL)}"), r) for k, v, r in params
        ]
        return f"{_in_order(written)} {w.text('</function>')}"

    def value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        # mlx-lm's _convert_param_value: "null" first, then by `type` as written: a list of types
        # through ast.literal_eval, none through json.loads for a dict or a list, else the text.
        kind, union = schema.get("type"), _union(schema)
        if isinstance(kind, str):
            return self._typed(w, schema, root, kind)
        if isinstance(kind, list):
            if (
                union is None
                or {"object", "array"} & set(union)
                or ("string" in union and not _plain(union, "string"))
            ):
                raise _Inexact(f"type {kind} is read by Python's literal_eval")
            kinds = [_number(w, union[k], root, k == "integer") for k in ("integer", "number") if k in union]
            kinds += ['"True" | "False"'] if "boolean" in union else []  # Python's spelling
            kinds += ['"null" | "None"'] if "null" in union else []
            alternatives = [_closed(w, self.slot, f"({kind})") for kind in kinds]
            if "string" in union:  # quoted, as Python reads JSON's strings, or as itself
                alternatives += [
                    _closed(w, self.slot, _json({"type": "string"}, root, self.keep_out)),
                    _raw_text(w, self.slot, refused=_UNQUOTED),
                ]
            return "(" + " | ".join(alternatives) + ")"
        if "enum" in schema or "const" in schema:
            values = schema.get("enum", [schema.get("const")])
            if all(isinstance(v, str) for v in values):
                kept = [v for v in values if not isinstance(_loads(v), (dict, list))]
                return _raw(w, self.slot, {k: v for k, v in schema.items() if k != "const"} | {"enum": kept})
        if union and set(union) <= {"string", "null"} and _plain(union, "string"):
            raw = _raw_text(w, self.slot, refused=_NO_CONTAINER)
            return f"({raw} | {self._null(w)})" if "null" in union else raw
        if _resolved_types(schema, root) <= {"object", "array", "null"}:
            return _closed(w, self.slot, _json(schema, root, self.keep_out))
        raise _Inexact("a parameter without a type is read as JSON or raw text, not by its schema")

    def _typed(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any], kind: str) -> str:
        if kind == "string":
            return _raw(w, self.slot, schema)
        if kind in ("integer", "number"):
            return _closed(w, self.slot, _number(w, schema, root, kind == "integer"))
        if kind == "boolean":
            return _closed(w, self.slot, _bool(schema))
        if kind in ("object", "array"):
            return _closed(w, self.slot, _json(schema, root, self.keep_out))
        if kind == "null":
            return self._null(w)
        raise _Inexact(f"type {kind!r}")

    def loose_value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        kind = schema.get("type")
        if isinstance(kind, list) and kind and set(kind) <= {"integer", "number", "null"}:
            return _closed(w, self.slot, f'({w.lexeme(_NUMBER)} | "null" | "None")')
        if kind in ("integer", "number", "boolean", "object", "array", "null"):
            return self._typed(w, {"type": kind}, root, kind)
        return _raw_text(w, self.slot)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _bool(schema: dict[str, Any]) -> str:
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else [True, False]
    texts = [f'"{t}" | "{t.capitalize()}"' for t in ("true", "false") if (t == "true") in values]
    if not texts:
        raise _Inexact("no boolean the schema allows")
    return "(" + " | ".join(texts) + ")"


class _Glm(_Family):
    block_end = "</tool_call>"
    keep_out = ("</arg_value>", "</tool_call>")
    slot = _Slot("", "</arg_value>", keep_out, strips=True, reads_null=False)

    def arguments(self, w: _Writer, params: list[tuple[str, str, bool]]) -> str:
        # GLM-4.7 writes no newlines between the tags; GLM-4.5 and 4.6 one after each.
        nl = f"{w.text(NL)}?"
        opening, closing, value = w.text("<arg_key>"), w.text("</arg_key>"), w.text("<arg_value>")
        written = [
            (w.rule(f"{nl} {opening} {w.text(k)} {closing} {nl} {value} {v}"), r) for k, v, r in params
        ]
        return f"{_in_order(written)} {nl}"

    def value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        # mlx-lm's glm47: a parameter typed exactly "string" is kept as written (stripped); any
        # other goes through json.loads, then ast.literal_eval, and is kept as text where both fail.
        if schema.get("type") == "string":
            return _raw(w, self.slot, schema)
        written = _closed(w, self.slot, _json(schema, root, self.keep_out))
        if not _plain(_union(schema), "string"):
            return written
        return f"({written} | {_raw_text(w, self.slot, refused=_UNQUOTED)})"

    def loose_value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        if schema.get("type") == "string":
            return _raw_text(w, self.slot)
        typed = {"type": schema["type"]} if _types(schema) else {}
        return _closed(w, self.slot, _json(typed, root, self.keep_out))


class _MiniMax(_Family):
    head, after_name, between_calls = '\n<invoke name="', '">\n', '<invoke name="'
    block_end = "</minimax:tool_call>"
    keep_out = ("</parameter>", "</invoke>", "</minimax:tool_call>")
    slot = _Slot("", "</parameter>", keep_out, strips=True, reads_null=True)

    def arguments(self, w: _Writer, params: list[tuple[str, str, bool]]) -> str:
        opening = '<parameter name="{}">'
        written = [(w.rule(f"{w.text(opening.format(k))} {v} {w.text(NL)}"), r) for k, v, r in params]
        return f"{_in_order(written)} {w.text('</invoke>' + NL)}"

    def value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        # mlx-lm's minimax_m2: "null" first, then the types the schema names (its type, its enum's,
        # its anyOf/oneOf/allOf's), tried integer, number, boolean, object, array, string.
        types, union = _minimax_types(schema), _union(schema)
        kinds = types - {"null"}
        if kinds == {"string"}:
            if (
                union is None
                and "type" not in schema
                and not {"anyOf", "oneOf", "allOf", "$ref"} & set(schema)
            ):
                union = {"string": schema, **({"null": {}} if "null" in types else {})}  # an enum
            if union is None or set(union) - {"string", "null"}:
                raise _Inexact("a string among other schemas")
            string = dict(union["string"])
            if "enum" in string:  # with null among the types, "none" and "nil" are read as None too
                nulls = ("none", "nil") if "null" in types else ()
                string["enum"] = [v for v in string["enum"] if isinstance(v, str) and v.lower() not in nulls]
            raw = _raw(w, self.slot, string, _NONE_NIL if "null" in types else ())
            return f"({raw} | {self._null(w)})" if "null" in types else raw
        if kinds and kinds <= {"integer", "number"}:
            if union and set(union) == kinds and len(kinds) == 1:
                return _closed(w, self.slot, _number(w, schema, root, kinds == {"integer"}))
            return _closed(w, self.slot, _json(_clamped(schema, _SAFE_INTEGER), root, self.keep_out))
        if kinds == {"boolean"} or (kinds and kinds <= {"object", "array"}):
            return _closed(w, self.slot, _json(schema, root, self.keep_out))
        if not kinds:
            return self._null(w)
        raise _Inexact(f"types {sorted(kinds)} are tried in mlx-lm's order, not the schema's")

    def loose_value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        types = _minimax_types(schema) - {"null"}
        if types & {"integer", "number"}:
            return _closed(w, self.slot, w.lexeme(_NUMBER if "number" in types else _INTEGER))
        if types == {"boolean"}:
            return _closed(w, self.slot, _BOOL)
        if types and types <= {"object", "array"}:
            return _closed(w, self.slot, _json({"type": sorted(types)}, root, self.keep_out))
        return _raw_text(w, self.slot)


def _minimax_types(schema: Any) -> set[str]:
    """The types mlx-lm's minimax_m2 reads a parameter's schema as (_extract_types_from_schema)."""
    if not isinstance(schema, dict):
        return {"string"}
    types = set(_types(schema) or ())
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
    for value in schema.get("enum") or ():
        types.add(names.get(type(value), "array" if isinstance(value, list) else "object"))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            types |= _minimax_types(sub)
    return types or {"string"}


class _Pythonic(_Family):
    head, after_name, between_calls = "[", "(", ", "
    calls_end, block_end = "]", "<|tool_call_end|>"
    keep_out = ("<|tool_call_end|>",)

    def name_ok(self, name: str) -> bool:
        return all(_IDENTIFIER.fullmatch(part) and not keyword.iskeyword(part) for part in name.split("."))

    def key_ok(self, key: str) -> bool:
        return bool(_IDENTIFIER.fullmatch(key)) and not keyword.iskeyword(key)

    def arguments(self, w: _Writer, params: list[tuple[str, str, bool]]) -> str:
        # Keywords in order, any optional one left out: from each position, the rest of the list
        # after at least one keyword (`after`) or before any (`first`); "": nothing.
        after, first = "", ""
        for key, value, required in reversed(params):
            item = w.rule(f"{w.text(key + '=')} {value}")
            if required:
                after, first = w.rule(f'", " {item} {after}'), w.rule(f"{item} {after}")
            else:
                either = f"{item} {after} | {first}" if first else f"({item} {after})?"
                after, first = w.rule(f'(", " {item})? {after}'), w.rule(either)
        return f'{first} ")"'

    def value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        # mlx-lm's pythonic: ast.literal_eval with true/false/null read as Python's; JSON as
        # llguidance writes it (no \u or \/ escapes) is a Python literal of the same value.
        return _json(schema, root, self.keep_out)

    def loose_value(self, w: _Writer, schema: dict[str, Any], root: dict[str, Any]) -> str:
        return _json({"type": schema["type"]} if _types(schema) else {}, root, self.keep_out)


def _family(name: str, bare: bool = False) -> _Family | None:
    match name:
        case "qwen3_coder":
            return _Qwen3Coder(bare)
        case "glm47" | "laguna":
            return _Glm()
        case "minimax_m2":
            return _MiniMax()
        case "pythonic":
            return _Pythonic()
    return None


# Grammars.


class CallGrammars:
    """The grammars of one format's calls to the request's tools: forced (the prompt wrote the
    opening) and lazy (from the format's triggers on)."""

    def __init__(self, tool_format: ToolFormat, family: _Family, specials: dict[str, int]) -> None:
        self._format, self._family, self._specials = tool_format, family, specials
        before, _, after = tool_format.call_opening.partition(NAME)
        assert before == tool_format.start + family.head and after == family.after_name, (
            f"{tool_format.name}: the call opening {tool_format.call_opening!r} is not the grammar's"
        )

    @property
    def trigger(self) -> str:
        """The text that opens a call; the bare inner block's opening too, where models write it."""
        if self._format.inner_start:
            return self._format.start + TRIGGER_SEPARATOR + self._format.inner_start
        return self._format.start

    def forced(self, name: str | None, tools: Tools, where: str) -> str:
        """The rest of a call whose opening the prompt wrote: `name`'s arguments on, or, for None,
        from the name of any of `tools` on."""
        w, family = _Writer(self._specials), self._family
        if name is None:
            return w.grammar(f"{self._calls(w, family, tools, where)} {_end(w, family)}")
        (tool,) = [(t, mode) for t, mode in tools if t["function"]["name"] == name]
        arguments = self._arguments(w, family, *tool, where)
        if arguments is None:
            raise GrammarError(f"{where}: {name!r} cannot be called in this model's tool-call format")
        return w.grammar(f"{arguments} {_end(w, family)}")

    def lazy(self, tools: Tools, where: str) -> str:
        """Each call from its trigger on: the rest of the block after the one trigger, or, with two,
        the block from either, the trigger included."""
        w, family = _Writer(self._specials), self._family
        head = (
            f"{w.text(NL)}? {w.text(family.head[1:])}" if family.head.startswith(NL) else w.text(family.head)
        )
        block = f"{head} {self._calls(w, family, tools, where)} {_end(w, family)}"
        inner = _family(self._format.name, bare=True)
        if not self._format.inner_start or inner is None:
            return w.grammar(block)
        bare = f"{self._calls(w, inner, tools, where)} {_end(w, inner)}"
        return w.grammar(f"{w.text(self._format.start)} {block} | {w.text(self._format.inner_start)} {bare}")

    def _calls(self, w: _Writer, family: _Family, tools: Tools, where: str) -> str:
        calls = []
        for tool, mode in tools:
            arguments = self._arguments(w, family, tool, mode, where)
            if arguments is not None:
                calls.append(w.rule(f"{w.text(tool['function']['name'] + family.after_name)} {arguments}"))
        if not calls:
            raise GrammarError(f"{where}: no tool's name can be written in this model's tool-call format")
        call = w.rule(" | ".join(calls))
        return call if family.between_calls is None else f"{call} ({w.text(family.between_calls)} {call})*"

    def _arguments(
        self, w: _Writer, family: _Family, tool: dict[str, Any], mode: Mode, where: str
    ) -> str | None:
        """The tool's arguments; None where its name cannot be written (`mode` exact: raises)."""
        name = tool["function"]["name"]
        root = tool["function"].get("parameters") or {"type": "object"}
        try:
            if not family.name_ok(name):
                raise _Inexact("its name cannot be written")
            if mode != "loose":
                check_schema(root, f"{where} {name!r}")
                _check_top(root)
            params = []
            for key, schema, required in _parameters(root):
                try:
                    params.append((key, _value(w, family, key, schema, root, mode), required))
                except _Inexact:
                    if mode == "exact" or required:
                        raise  # an optional parameter the format cannot name is left out
        except _Inexact as error:
            if mode == "exact":
                raise GrammarError(f"{where} {name!r}: {error}, in this model's tool-call format") from None
            return None
        return family.arguments(w, params)


def _end(w: _Writer, family: _Family) -> str:
    """What ends a block: its closer, or the reply's end (mlx-lm's parser reads a block the reply
    left open at its end, and models end their reply there)."""
    closer = f"({w.text(family.block_end)})?" if family.block_end else ""
    return f"{w.text(family.calls_end)} {closer}"


def _value(w: _Writer, family: _Family, key: str, schema: Any, root: dict[str, Any], mode: Mode) -> str:
    if not family.key_ok(key):
        raise _Inexact(f"parameter {key!r}: its name cannot be written")
    schema = schema if isinstance(schema, dict) else {}
    if mode != "loose":
        try:
            return family.value(w, schema, root)
        except _Inexact as error:
            if mode == "exact":
                raise _Inexact(f"parameter {key!r}: {error}") from None
    return family.loose_value(w, schema, root)


def _check_top(schema: dict[str, Any]) -> None:
    if schema.get("type", "object") != "object":
        raise _Inexact("its parameters are not an object")
    unsupported = {"anyOf", "oneOf", "allOf", "not", "if", "$ref", "patternProperties", "propertyNames"}
    unsupported = (unsupported | {"dependentRequired", "dependentSchemas", "minProperties"}) & set(schema)
    if unsupported:
        raise _Inexact(f"its parameters' {sorted(unsupported)}")


def _parameters(schema: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(key, schema, is required) for each declared parameter in order, then required undeclared ones."""
    properties = schema.get("properties") or {}
    required = [key for key in schema.get("required") or () if isinstance(key, str)]
    extra = schema.get("additionalProperties", True)
    undeclared = [key for key in required if key not in properties]
    if undeclared and extra is False:
        raise _Inexact(f"required parameters {undeclared} that it does not allow")
    extra_schema = extra if isinstance(extra, dict) else {}
    return [(k, s, k in required) for k, s in properties.items()] + [
        (k, extra_schema, True) for k in undeclared
    ]


def call_grammars(tool_format: ToolFormat, tokenizer: Any) -> CallGrammars | None:
    """The call grammars of `tool_format`, or None where its family is not one written here. A tag
    that is one added token of the model's `tokenizer` is matched as that token too: llguidance
    reads every added token as a special one, which no literal or regex of its text matches."""
    family = _family(tool_format.name)
    if family is None:
        return None
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return CallGrammars(tool_format, family, {str(token.content): int(i) for i, token in decoder.items()})
