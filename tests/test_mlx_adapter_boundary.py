"""One folder is the whole seam to mlx-lm: outside `engine/mlx_adapter/`, no module of `semantic/`
(engine, actors, protocols, storage and the top level) imports a private mlx-lm name, reads a
private attribute of an mlx-lm object, assigns to an mlx-lm module or class, subclasses an mlx-lm
class, or imports mlx-lm at all beyond the public names allowed below."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx_lm
import pytest

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "engine" / "mlx_adapter"

sys.path.insert(0, str(ROOT / "scripts"))
from typecheck import package_sources  # noqa: E402  (the build's package mapping)

# The mlx-lm names a module outside the adapter may import, each with why it does not go through the
# adapter (the engine's own uses all do, via `mlx_adapter.api`). For `import mlx_lm` the name is the
# attribute read from the package.
ALLOWED: dict[tuple[str, str], str] = {
    ("mlx_lm", "__version__"): "cli and doctor name the installed mlx-lm in their messages",
    ("mlx_lm", "load"): "doctor checks a model loads through mlx-lm's documented entry point, engine aside",
    ("mlx_lm.models.cache", "QuantizedKVCache"): "cli refuses --kv-bits that mlx-lm cannot batch, at startup",
    ("mlx_lm.generate", "TextStateMachine"): "protocols' tool parser splits replies with mlx-lm's public one",
}


def mlx_lm_private_names() -> frozenset[str]:
    """Names of private attributes and methods in mlx-lm's source (`self._x = ...`, `def _x`)."""
    pattern = re.compile(r"self\.(_[A-Za-z]\w*)\s*[:=]|def (_[A-Za-z]\w*)\(")
    names: set[str] = set()
    for path in Path(mlx_lm.__file__).parent.rglob("*.py"):
        for match in pattern.finditer(path.read_text(errors="replace")):
            name = match.group(1) or match.group(2)
            if not name.endswith("__"):
                names.add(name)
    return frozenset(names)


PRIVATE_NAMES = mlx_lm_private_names()


@dataclass(frozen=True)
class Violation:
    line: int
    what: str


def _is_mlx_lm(module: str | None) -> bool:
    return module is not None and (module == "mlx_lm" or module.startswith("mlx_lm."))


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _chain(node: ast.expr) -> list[str]:
    """`a.b.c` as ["b", "c"] (attributes after the root name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return parts[::-1]


def violations(source: str) -> list[Violation]:
    """Every way `source` (a module outside the adapter) reaches past mlx-lm's allowed public names."""
    tree = ast.parse(source)
    bound, found = _imports(tree)
    for node in ast.walk(tree):
        found.extend(_uses(node, bound))
    return found


def _imports(tree: ast.Module) -> tuple[dict[str, str | None], list[Violation]]:
    """The names bound to mlx-lm modules or objects (with the module each came from; None: the
    package itself), and the imports that are not allowed."""
    bound: dict[str, str | None] = {}
    found: list[Violation] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_mlx_lm(node.module):
            module = str(node.module)
            for alias in node.names:
                bound[alias.asname or alias.name] = module
                if alias.name.startswith("_"):
                    found.append(Violation(node.lineno, f"imports private {module}.{alias.name}"))
                elif (module, alias.name) not in ALLOWED:
                    found.append(Violation(node.lineno, f"imports {module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_mlx_lm(alias.name):
                    continue
                if alias.name != "mlx_lm" or alias.asname is not None:
                    found.append(Violation(node.lineno, f"imports module {alias.name}"))
                bound[alias.asname or alias.name.split(".")[0]] = None
        elif isinstance(node, ast.Call) and _called_name(node) in ("import_module", "__import__"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and _is_mlx_lm(str(first.value)):
                found.append(Violation(node.lineno, f"imports {first.value} by name"))
    return bound, found


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _uses(node: ast.AST, bound: dict[str, str | None]) -> list[Violation]:
    """What `node` does with mlx-lm that only the adapter may."""
    line = getattr(node, "lineno", 0)
    if isinstance(node, ast.Attribute):
        found = []
        root = node.value.id if isinstance(node.value, ast.Name) else None
        if root in bound and bound[root] is None and ("mlx_lm", node.attr) not in ALLOWED:
            found.append(Violation(line, f"reads mlx_lm.{'.'.join(_chain(node))}"))
        if node.attr in PRIVATE_NAMES and root not in ("self", "cls"):
            found.append(Violation(line, f"reads mlx-lm's private attribute {node.attr}"))
        return found
    if isinstance(node, ast.Call) and _called_name(node) in ("getattr", "setattr", "hasattr", "delattr"):
        function, args = _called_name(node), node.args
        name = args[1].value if len(args) > 1 and isinstance(args[1], ast.Constant) else None
        found = []
        if name in PRIVATE_NAMES:
            found.append(Violation(line, f"{function} of mlx-lm's private {name}"))
        if function in ("setattr", "delattr") and args and _root_name(args[0]) in bound:
            found.append(Violation(line, f"{function} on an mlx-lm module or class"))
        return found
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
        targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        return [
            Violation(line, f"assigns to {ast.unparse(target)} of mlx-lm")
            for target in targets
            if isinstance(target, ast.Attribute) and _root_name(target) in bound
        ]
    if isinstance(node, ast.ClassDef):
        return [
            Violation(line, f"class {node.name} subclasses mlx-lm's {ast.unparse(base)}")
            for base in node.bases
            if _root_name(base) in bound
        ]
    return []


def modules_outside_the_adapter() -> list[Path]:
    """Every module of the `semantic` package, as the build maps it, but the adapter's."""
    paths = [ROOT / source.path for source in package_sources() if source.path]
    return sorted(path for path in paths if not path.is_relative_to(ADAPTER))


def test_nothing_outside_the_adapter_reaches_into_mlx_lm() -> None:
    paths = modules_outside_the_adapter()
    scanned = {path.relative_to(ROOT).parts[0] for path in paths}
    assert scanned == {"engine", "actors", "protocols", "storage", "semantic"}
    report = [
        f"{path.relative_to(ROOT)}:{violation.line}: {violation.what}"
        for path in paths
        for violation in violations(path.read_text())
    ]
    assert report == [], (
        "mlx-lm reached outside engine/mlx_adapter/ (move it into the adapter, or import the public name "
        "from mlx_adapter.api):\n" + "\n".join(report)
    )


def test_the_adapter_is_where_the_private_access_is() -> None:
    """The scan finds what it is for: the adapter's own modules are full of it."""
    adapter = [violations(path.read_text()) for path in sorted(ADAPTER.glob("*.py"))]
    assert sum(len(found) for found in adapter) > 20
    assert "_generation_batch" in PRIVATE_NAMES and "_idx" in PRIVATE_NAMES


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("from mlx_lm.tokenizer_utils import _byte_decoder", "imports private"),
        ("from mlx_lm.models import base\nbase.scaled_dot_product_attention = None", "assigns to"),
        ("import mlx_lm\nsetattr(mlx_lm.models, 'x', 1)", "setattr on an mlx-lm"),
        ("from mlx_lm.models.cache import QuantizedKVCache\nclass Mine(QuantizedKVCache): ...", "subclasses"),
        ("from mlx_lm.generate import BatchGenerator", "imports mlx_lm.generate.BatchGenerator"),
        ("import mlx_lm.models.cache", "imports module"),
        ("import mlx_lm\nmlx_lm.generate.BatchGenerator", "reads mlx_lm.generate"),
        ("def f(generator):\n    return generator._generation_batch", "private attribute _generation_batch"),
        ("def f(cache):\n    return getattr(cache, '_idx')", "getattr of mlx-lm's private _idx"),
        ("import importlib\nimportlib.import_module('mlx_lm.generate')", "by name"),
    ],
)
def test_each_kind_of_reach_is_caught(source: str, what: str) -> None:
    assert any(what in violation.what for violation in violations(source)), violations(source)


def test_the_allowed_public_names_and_our_own_privates_pass() -> None:
    source = (
        "import mlx_lm\nfrom mlx_lm.generate import TextStateMachine\n"
        "print(mlx_lm.__version__)\n"
        "class Mine:\n    def f(self):\n        return self._idx\n"
    )
    assert violations(source) == []
