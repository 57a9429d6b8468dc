"""mypy over the `semantic` package as the build maps it: each module by its import name and its one path.

The package's layers are top-level folders that the build maps into it (`[tool.setuptools.package-dir]`
in pyproject.toml); mypy finds modules by folder names alone, so this hands it every module with both,
read from that same mapping, and mypy's settings from `[tool.mypy]`.

    python scripts/typecheck.py
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def package_sources(root: Path = ROOT) -> list[BuildSource]:
    """Every module of every package the build maps, by its import name and its file."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    sources = []
    for package in setuptools["packages"]:
        head = max((name for name in folders if package == name or package.startswith(name + ".")), key=len)
        folder = root / folders[head] / package[len(head) :].lstrip(".").replace(".", "/")
        for path in sorted(folder.glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            sources.append(BuildSource(str(path.relative_to(root)), module, None))
    return sources


def main() -> int:
    _, options = process_options(["--config-file", str(ROOT / "pyproject.toml")], require_targets=False)
    try:
        result = build.build(package_sources(), options)
    except CompileError as error:
        print("\n".join(error.messages))
        return 2
    for line in result.errors:
        print(line)
    if result.errors:
        print(f"mypy: {len(result.errors)} problem(s) in {len(package_sources())} modules")
        return 1
    print(f"mypy: no issues in {len(package_sources())} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
