"""The HTTP protocols speak to the actor layer and the public API only (issue 65)."""

from __future__ import annotations

import ast

import semantic
from tests.server_process import ROOT

PROTOCOLS = ROOT / "protocols"
PRIVATE_PACKAGES = ("semantic.engine", "semantic.storage")


def private_imports(source: str) -> list[str]:
    """The modules of `semantic.engine` or `semantic.storage` that `source` imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if _is_private(alias.name)}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            if _is_private(node.module):
                found.add(node.module)
            else:  # `from semantic import engine`
                found |= {
                    f"{node.module}.{a.name}" for a in node.names if _is_private(f"{node.module}.{a.name}")
                }
    return sorted(found)


def _is_private(module: str) -> bool:
    return any(module == package or module.startswith(f"{package}.") for package in PRIVATE_PACKAGES)


def test_the_check_finds_an_engine_import() -> None:
    found = private_imports("from semantic.engine.loop.messages import Finished")
    assert found == ["semantic.engine.loop.messages"]
    assert private_imports("import semantic.storage.persistence") == ["semantic.storage.persistence"]
    assert private_imports("from semantic import engine") == ["semantic.engine"]
    assert private_imports("from semantic import Finished\nimport semantic_engine") == []


def test_protocols_import_no_engine_or_storage_module() -> None:
    files = sorted(PROTOCOLS.glob("*.py"))
    assert len(files) > 10
    found = {path.name: private_imports(path.read_text()) for path in files}
    assert {name: modules for name, modules in found.items() if modules} == {}


def test_every_public_name_resolves() -> None:
    for name in semantic.__all__:
        assert getattr(semantic, name) is not None, name
