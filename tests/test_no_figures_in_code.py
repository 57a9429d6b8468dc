"""Product code's comments and docstrings quote no measurement (issue 81; STYLE.md habit 20).

Figures live in bench/results/, written by the benchmark that made them; a comment says what and
why, and where a choice rests on a measurement it names the result file, so a new run changes one
file and no comment goes stale. This test reads every comment (tokenize) and docstring (ast) of
the product folders and fails on the usual phrasings of a measurement. A constant's value with its
unit ("a 10 ms tick", "256-token blocks") is not a measurement and does not match.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# semantic/ links to the other four; a link is skipped so that each file is read once.
PRODUCT_FOLDERS = ("actors", "engine", "protocols", "storage", "semantic")

_NUMBER = r"~?\d[\d,]*(?:\.\d+)?"
_TIME = r"(?:ms|µs|us|ns|s|min|seconds?)"
_UNIT = rf"(?:{_TIME}|x|%|MiB|MB|GB)"
MEASUREMENT_PHRASES = [
    # What a benchmark report says about itself. (Bare "measured" is left alone: the engine
    # measures step and chunk times as it runs, and its comments say so.)
    r"\bmeasured(?: here| before| on (?:an?|the|this|\d)| in (?:the|our|a)\b|:)",
    r"\b(?:in )?this run\b",
    r"\bthis (?:box|VM)\b",
    r"(?<![-/])\b(?:H100|H200|A100|M[1-4] (?:Pro|Max|Ultra))\b",  # not a results folder's name
    r"\bon (?:an?|the|this|our|one) (?:M[1-4]|Mac|MacBook|\d+-core|\d+-vCPU)\b",
    r"\bon this (?:CPU|GPU|Mac)\b",
    # A time said to be what something costs or takes, or two times set against each other.
    rf"(?:~|\babout |\baround |\broughly |\bnearly |\btakes |\btook |\bcosts? |\bspends? |"
    rf"\bspent |\bsaves? |\bsaved )\s?{_NUMBER}\s?{_TIME}\b",
    rf"{_NUMBER}\s?-\s?{_NUMBER}\s?{_UNIT}(?:\W|$)",
    rf"{_NUMBER}\s?{_UNIT}?,? (?:instead of|against|vs\.?|versus|where \w+ took) ~?{_NUMBER}",
    rf"\b(?:from|went from) {_NUMBER}\s?{_UNIT}? (?:to|down to|up to) {_NUMBER}",
    # A rate, or a ratio of speeds.
    rf"{_NUMBER}\s?(?:tok/s|tokens/s|tokens per second|GB/s)",
    rf"{_NUMBER}\s?(?:x|×|times) (?:faster|slower|quicker|the speed)\b",
    rf"{_NUMBER}\s?% (?:faster|slower|quicker|saved|of the (?:time|tick|step|prefill))\b",
    r"\bspeed-?ups? of\b",
    r"\b(?:benchmark|bench|profile|profiling)s? (?:showed|shows|found|finds|measured|gave)\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in MEASUREMENT_PHRASES), re.IGNORECASE)


def product_files() -> list[Path]:
    files = []
    for folder in PRODUCT_FOLDERS:
        files.extend(sorted((REPO_ROOT / folder).rglob("*.py")))
    return files


def prose_of(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and each module, class and function docstring."""
    # Comments on consecutive lines are one block, so a phrase that wraps still reads as one.
    prose: list[tuple[int, str]] = []
    last_line = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if prose and line == last_line + 1:
            prose[-1] = (prose[-1][0], prose[-1][1] + " " + token.string.lstrip("# "))
        else:
            prose.append((line, token.string.lstrip("# ")))
        last_line = line
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None and node.body:
                prose.append((node.body[0].lineno, docstring))
    return prose


def figures_in(path: Path) -> list[str]:
    hits = []
    for line, text in prose_of(path.read_text()):
        flat = " ".join(text.split())
        for match in PATTERN.finditer(flat):
            hits.append(f"{path.relative_to(REPO_ROOT)}:{line}: ...{match.group(0)}...")
    return hits


def test_product_code_quotes_no_measurement() -> None:
    files = product_files()
    assert len(files) > 50, "the product folders were not found"
    hits = [hit for path in files for hit in figures_in(path)]
    assert not hits, (
        "comments and docstrings that quote a measurement; say what and why, and name the result "
        "file in bench/results/ instead of its figure:\n" + "\n".join(hits)
    )


def test_the_phrasings_match_a_measurement_and_not_a_constant() -> None:
    measurements = [
        "measured here: 40 tok/s",
        "in this run the tick took ~140 ms",
        "on an H100 this is 3x faster",
        "a speed-up of a third",
        "prefill at 1,200 tokens/s",
        "a 25% faster first token",
        "costs about 12 ms per tick",
        "went from 190 ms to 140 ms",
    ]
    constants = [
        "a 10 ms tick while work is in flight",
        "blocks of 256 tokens",
        "the default timeout is 30 s",
        "runs on the CPU and on Metal",
        "ping every 15 s",
        "a drain gives up in 30 s",
        "the arena's 64 MB heaps",
    ]
    assert [text for text in measurements if not PATTERN.search(text)] == []
    assert [text for text in constants if PATTERN.search(text)] == []
