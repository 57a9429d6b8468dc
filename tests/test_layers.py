"""The package's layers import downward only, and the protocols see the engine through the actor layer.

From the top: `semantic/` (command line, server runner, service, launcher), `protocols/` (HTTP),
`actors/`, `storage/` (files), `engine/` (the MLX thread). A module imports its own layer and those
below it, never one above (imports inside functions and under TYPE_CHECKING included). The protocols
import the actor layer and nothing under it, and read nothing of the engine or the cache files but
through `actors/interface.py`'s `ServerView`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from typecheck import package_sources  # noqa: E402  (the build's package mapping)

LAYERS = ("semantic", "semantic.protocols", "semantic.actors", "semantic.storage", "semantic.engine")
# Attributes that reach the engine or the persistence actor; the protocols read them through ServerView.
ENGINE_ATTRIBUTES = {"engine", "persistence", "group_report", "stats", "evicted_writes"}
# Values whose `engine` is a settings section, not the engine.
SETTINGS_NAMES = {"settings", "config"}
# The read-only view itself, as the protocols name it.
VIEW_NAMES = {"view", "ServerView"}


def layer_of(module: str) -> int:
    """The index in LAYERS of the deepest layer `module` belongs to (0: the top, `semantic` itself)."""
    return max(
        index for index, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")
    )


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every `semantic` import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name == "semantic" or name.startswith("semantic.")]


def _modules() -> list[tuple[Path, str]]:
    return [(ROOT / str(source.path), source.module) for source in package_sources()]


def test_every_layer_imports_only_its_own_and_those_below() -> None:
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path, module in _modules()
        for line, name in imported_modules(path, module)
        if layer_of(name) < layer_of(module)
    ]
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_protocols_import_the_actor_layer_and_nothing_under_it() -> None:
    allowed = ("semantic.protocols", "semantic.actors")
    reaching = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path, module in _modules()
        if module.startswith("semantic.protocols")
        for line, name in imported_modules(path, module)
        if not name.startswith(allowed)
    ]
    assert reaching == [], "protocol modules reaching past the actor layer:\n" + "\n".join(reaching)


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _reads_engine(node: ast.Attribute) -> bool:
    if node.attr not in ENGINE_ATTRIBUTES or _root_name(node.value) in VIEW_NAMES:
        return False
    # `settings.engine.max_batch_size`, `self.settings.engine`: a settings section.
    value = node.value
    named = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", None)
    return not (node.attr == "engine" and (named in SETTINGS_NAMES or _root_name(value) in SETTINGS_NAMES))


def test_the_protocols_read_the_engine_only_through_the_server_view() -> None:
    reads = [
        f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}"
        for path, module in _modules()
        if module.startswith("semantic.protocols")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and _reads_engine(node)
    ]
    assert reads == [], "protocol code reading the engine past ServerView:\n" + "\n".join(reads)


def test_the_checks_see_every_layer_and_catch_an_upward_import(tmp_path: Path) -> None:
    """The scan is not vacuous: every layer has modules, and an upward import in a file is found."""
    assert {layer_of(module) for _, module in _modules()} == set(range(len(LAYERS)))
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from semantic.protocols.settings import Settings\n")
    assert [layer_of(name) for _, name in imported_modules(probe, "semantic.engine.probe")] == [1]
    attribute = ast.parse("system.engine.stats").body[0].value  # type: ignore[attr-defined]
    assert _reads_engine(attribute)
    for allowed in ("settings.engine", "view.group_report", "ServerView(system).stats"):
        assert not _reads_engine(ast.parse(allowed).body[0].value)  # type: ignore[attr-defined]
