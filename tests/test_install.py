"""One package, `semantic`, each module at one path: the checkout holds no links, the editable install
imports every module from its folder in the checkout, and the built wheel, installed (not editable)
into a fresh venv, is that package, typed.

Everything runs from a directory outside the checkout with PYTHONPATH cleared, so nothing can be
picked up from the source tree: the wheel holds only `semantic` (engine/, actors/, protocols/ and
storage/ inside it, plus py.typed), the bare names `engine`, `actors`, ... do not import, the public
API imports from the venv, and mypy type-checks against the installed package through its py.typed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests.server_process import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from typecheck import package_sources

FOLDERS = ("engine", "actors", "protocols", "storage")
PUBLIC_API = ("AgentSystem", "SystemConfig", "SamplingParams")
# Build outputs and caches at the top of the checkout, left out of the snapshot the wheel is built from.
TOP_LEVEL_SKIP = {".venv", ".git", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
TOP_LEVEL_SKIP |= {".hypothesis", ".schemathesis"}


def _clean_env() -> dict[str, str]:
    """The environment without PYTHON*/MYPY* variables or an active venv, and no user site."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "MYPY")) and key not in {"VIRTUAL_ENV", "__PYVENV_LAUNCHER__"}
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(
    cmd: Sequence[str | Path], cwd: Path, what: str, ok_codes: Sequence[int] = (0,), timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    args = [str(part) for part in cmd]
    proc = subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode in ok_codes, (
        f"{what} exited with {proc.returncode} (expected {list(ok_codes)})\n"
        f"command: {args}\ncwd: {cwd}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
    return proc


def _inside(path: str | Path, parent: Path) -> bool:
    return Path(path).resolve().is_relative_to(parent.resolve())


def _snapshot_ignore(directory: str, names: list[str]) -> set[str]:
    skipped = {name for name in names if name == "__pycache__" or name.endswith(".pyc")}
    if Path(directory).resolve() == ROOT:
        skipped |= {name for name in names if name in TOP_LEVEL_SKIP or name.endswith(".egg-info")}
    return skipped


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory outside the checkout."""
    path = tmp_path_factory.mktemp("outside")
    assert not _inside(path, ROOT), f"pytest's temporary directory {path} is inside the checkout {ROOT}"
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot of the checkout without build outputs or caches.

    Building in place would write build/ and *.egg-info into the checkout, and setuptools would pack
    whatever stale files an earlier build left in build/lib; a clean copy gives neither.
    """
    snapshot = tmp_path_factory.mktemp("source") / "semantic-src"
    shutil.copytree(ROOT, snapshot, ignore=_snapshot_ignore)
    return snapshot


@pytest.fixture(scope="module")
def wheel(source: Path, outside: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    cmd: list[str | Path] = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", dist, source]
    _run(cmd, outside, "pip wheel")
    wheels = sorted(dist.glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {dist}, found {[w.name for w in wheels]}"
    return wheels[0]


@dataclass(frozen=True)
class Venv:
    root: Path
    python: Path
    site_packages: Path


def _pip_has_python_option() -> bool:
    major, minor = (int(part) for part in re.findall(r"\d+", version("pip"))[:2])
    return (major, minor) >= (22, 3)


@pytest.fixture(scope="module")
def venv(wheel: Path, outside: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv with the wheel installed, seeing this interpreter's packages through a .pth."""
    root = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", root], outside, "python -m venv")
    python = root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_packages = Path(_run([python, "-c", probe], outside, "venv python").stdout.strip())
    assert _inside(site_packages, root), f"venv site-packages {site_packages} is not under {root}"

    # Install before the .pth exists, so pip sees an empty environment (this interpreter's
    # site-packages holds the editable install's semantic dist-info, which pip would otherwise
    # take as "already installed").
    install: list[str | Path]
    if _pip_has_python_option():
        install = [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", wheel]
    else:
        install = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", site_packages, wheel]
    _run(install, outside, "pip install")

    # Dependencies (mlx, aiohttp, mypy, ...) come from this interpreter's site-packages. A plain path
    # line in a .pth is appended to sys.path, and the .pth files in that directory (the editable
    # install's finder among them) are not run, so `semantic` can only come from the venv.
    paths = sysconfig.get_paths()
    ours = dict.fromkeys([*site.getsitepackages(), paths["purelib"], paths["platlib"]])
    (site_packages / "_test_install_deps.pth").write_text("".join(f"{path}\n" for path in ours))
    return Venv(root, python, site_packages)


PROBE = """
import importlib, json, sys, traceback

result = {"sys_path": sys.path, "bare": {}, "files": {}}
for name in NAMES:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        result["bare"][name] = {"error": "ModuleNotFoundError", "missing": exc.name}
    except BaseException as exc:
        result["bare"][name] = {"error": type(exc).__name__, "detail": traceback.format_exc()}
    else:
        result["bare"][name] = {"error": None, "file": getattr(module, "__file__", None)}
import semantic
result["files"]["semantic"] = semantic.__file__
for name in NAMES:
    result["files"]["semantic." + name] = importlib.import_module("semantic." + name).__file__
try:
    from semantic import AgentSystem, SystemConfig, SamplingParams
except BaseException:
    result["api_error"] = traceback.format_exc()
else:
    result["api_error"] = None
result["all"] = getattr(semantic, "__all__", None)
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe(venv: Venv, outside: Path) -> dict[str, Any]:
    """What the venv's python imports, run from outside the checkout."""
    script = outside / "probe_imports.py"
    script.write_text(f"NAMES = {FOLDERS!r}\n{PROBE}")
    proc = _run([venv.python, script], outside, "import probe in the venv")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_wheel_holds_only_the_semantic_package(wheel: Path, source: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if not name.endswith("/")]
        dist_info = next((n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")), None)
        assert dist_info is not None, f"no .dist-info in {wheel.name}: {names}"
        top_level_txt = archive.read(f"{dist_info}/top_level.txt").decode().split()
    listing = "\n".join(names)

    top = {name.split("/")[0] for name in names}
    assert top == {"semantic", dist_info}, f"top-level entries {sorted(top)} in {wheel.name}:\n{listing}"
    assert top_level_txt == ["semantic"], f"{dist_info}/top_level.txt lists {top_level_txt}"
    assert "semantic/py.typed" in names, f"no semantic/py.typed in {wheel.name}:\n{listing}"
    assert "semantic/__init__.py" in names, f"no semantic/__init__.py in {wheel.name}:\n{listing}"
    for folder in FOLDERS:
        expected = {
            f"semantic/{folder}/{path.relative_to(source / folder).as_posix()}"
            for path in (source / folder).rglob("*.py")
        }
        packed = {name for name in names if name.startswith(f"semantic/{folder}/") and name.endswith(".py")}
        assert f"semantic/{folder}/__init__.py" in packed, f"semantic/{folder} missing from:\n{listing}"
        assert packed == expected, (
            f"semantic/{folder} in the wheel differs from {folder}/ in the source: "
            f"missing {sorted(expected - packed)}, extra {sorted(packed - expected)}"
        )


def test_bare_folder_names_do_not_import(probe: dict[str, Any]) -> None:
    for name in FOLDERS:
        outcome = probe["bare"][name]
        assert outcome == {"error": "ModuleNotFoundError", "missing": name}, (
            f"`import {name}` in the installed venv should raise ModuleNotFoundError for {name!r}, "
            f"got {outcome}\nsys.path: {probe['sys_path']}"
        )


def test_semantic_imports_from_the_venv_not_the_checkout(probe: dict[str, Any], venv: Venv) -> None:
    for module, file in probe["files"].items():
        assert file is not None, f"{module} has no __file__"
        assert _inside(file, venv.site_packages), (
            f"{module} imported from {file}, not from the venv's {venv.site_packages}"
        )
        assert not _inside(file, ROOT), f"{module} imported from the checkout: {file}"


def test_public_api_imports_from_the_installed_package(probe: dict[str, Any]) -> None:
    assert probe["api_error"] is None, (
        f"`from semantic import {', '.join(PUBLIC_API)}` failed in the installed venv:\n{probe['api_error']}"
    )
    exported = probe["all"]
    assert isinstance(exported, list), f"semantic.__all__ is {exported!r}"
    missing = [name for name in PUBLIC_API if name not in exported]
    assert not missing, f"semantic.__all__ lacks {missing}: {exported}"


MYPY_PROBE = """\
from semantic import SystemConfig


def as_int(config: SystemConfig) -> int:
    wrong: int = config
    return wrong
"""
MYPY_CONFIG = "[mypy]\nfollow_imports = skip\n\n[mypy-semantic.*]\nfollow_imports = normal\n"
MYPY_EXPECTED = re.compile(
    r'^check_typed\.py:5: error: Incompatible types in assignment \(expression has type "[\w.]+", '
    r'variable has type "int"\)\s+\[assignment\]$'
)


def test_mypy_uses_the_installed_py_typed(venv: Venv, outside: Path) -> None:
    workdir = outside / "mypy-check"
    workdir.mkdir()
    (workdir / "check_typed.py").write_text(MYPY_PROBE)
    # mypy's defaults, not whatever config is around, but for the packages semantic imports: they are
    # taken as untyped rather than read (numpy, aiohttp and mlx's stubs took 20 of mypy's 25 s).
    (workdir / "mypy.ini").write_text(MYPY_CONFIG)
    cache = workdir / ".mypy_cache"
    cmd: list[str | Path] = [venv.python, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", cache]
    cmd += ["--show-error-codes", "--no-pretty", "--no-color-output", "check_typed.py"]
    proc = _run(cmd, workdir, "mypy", ok_codes=(0, 1))
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"

    for untyped in ("py.typed", "import-untyped", "import-not-found", "missing library stubs"):
        assert untyped not in proc.stdout, f"mypy did not see semantic as typed ({untyped!r}):\n{output}"
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and MYPY_EXPECTED.match(errors[0]), (
        f"expected exactly mypy's assignment error on check_typed.py line 5:\n{output}"
    )
    assert proc.returncode == 1, f"mypy exited with {proc.returncode}:\n{output}"


def _dist_info_text(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        dist_info = next(
            n.split("/")[0] for n in archive.namelist() if n.split("/")[0].endswith(".dist-info")
        )
        return archive.read(f"{dist_info}/{name}").decode()


def test_wheel_is_named_semantic_mlx_at_the_package_version(wheel: Path) -> None:
    """`semantic` on PyPI is someone else's; ours is semantic-mlx, versioned by semantic.__version__."""
    from semantic import __version__

    metadata = _dist_info_text(wheel, "METADATA").splitlines()
    assert "Name: semantic-mlx" in metadata and f"Version: {__version__}" in metadata, metadata[:5]
    assert wheel.name == f"semantic_mlx-{__version__}-py3-none-any.whl"
    assert "semantic = semantic.cli:main" in _dist_info_text(wheel, "entry_points.txt")


def test_no_other_installed_distribution_ships_a_semantic_package() -> None:
    from importlib.metadata import distributions

    owners = set()
    for dist in distributions():
        top_level = (dist.read_text("top_level.txt") or "").split()
        files = [str(path) for path in dist.files or []]
        if "semantic" in top_level or any(path.startswith("semantic/") for path in files):
            owners.add(dist.metadata["Name"])
    assert owners <= {"semantic-mlx"}, f"these installed distributions also ship `semantic`: {owners}"


@pytest.mark.skipif(os.name == "nt", reason="the venv's scripts are .exe files on Windows")
def test_the_semantic_command_of_the_installed_wheel_runs(venv: Venv, outside: Path) -> None:
    from semantic import __version__

    proc = _run([venv.root / "bin" / "semantic", "--version"], outside, "semantic --version")
    assert proc.stdout.strip() == f"semantic {__version__}"
    probe = "import importlib.metadata as m, semantic; print(m.version('semantic-mlx'), semantic.__file__)"
    installed, file = _run([venv.python, "-c", probe], outside, "metadata probe").stdout.split()
    assert installed == __version__ and _inside(file, venv.site_packages)


def test_the_checkout_holds_no_links() -> None:
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t")[-1] for line in tracked.stdout.splitlines() if line.startswith("120000")]
    assert links == [], f"symbolic links in the repository: {links}"
    for folder in (*FOLDERS, "semantic"):
        found = [path for path in (ROOT / folder).rglob("*") if path.is_symlink()]
        assert found == [], f"symbolic links under {folder}/: {found}"


EDITABLE_PROBE = """
import importlib, json, sys
print(json.dumps({module: importlib.import_module(module).__file__ for module in sys.argv[1:]}))
"""


def test_the_editable_install_imports_every_module_from_its_one_path(outside: Path) -> None:
    """This venv's `pip install -e .`, from outside the checkout: every module the build maps is read
    from its own file in the checkout, the layers from their top-level folders."""
    sources = package_sources()
    assert {source.module for source in sources} >= {"semantic.engine.decoding.batch", "semantic.cli"}
    script = outside / "probe_editable.py"
    script.write_text(EDITABLE_PROBE)
    env = {**_clean_env(), "SEMANTIC_NO_FAST_BLAS": "1"}
    proc = subprocess.run(
        [sys.executable, script, *(source.module for source in sources)],
        cwd=outside, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = {
        source.module: files[source.module]
        for source in sources
        if Path(files[source.module]) != ROOT / str(source.path)
    }
    assert wrong == {}, f"modules not imported from their one path in the checkout: {wrong}"
