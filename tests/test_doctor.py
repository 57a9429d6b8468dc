"""`semantic doctor`, run as the command: a line per check, a fix under each that is not OK, exit 1 on
a FAIL (an unwritable cache dir, a port someone else holds, a KV budget larger than the machine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_process import ROOT, ServerProcess, free_port

CHECKS = ("backend", "BLAS", "memory", "cache dir", "port", "model")


def doctor(*argv: str) -> tuple[int, dict[str, str]]:
    """The exit code and each check's line (with its fix, if any), by the check's name."""
    proc = subprocess.run(
        [sys.executable, "-m", "semantic.cli", "doctor", *argv], capture_output=True, text=True, cwd=ROOT
    )
    lines: dict[str, str] = {}
    name = ""
    for line in proc.stdout.splitlines():
        if line.startswith("     -> "):
            lines[name] += "\n" + line
            continue
        level, _, rest = line.partition(" ")
        assert level in ("OK", "WARN", "FAIL"), f"not a check line: {line!r}\n{proc.stderr}"
        name = rest.strip().split(":")[0]
        lines[name] = line
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, lines


def test_doctor_checks_a_usable_setup(tmp_path: Path, tiny_llama_dir: Path) -> None:
    port = str(free_port())
    code, lines = doctor(
        "--cache-dir", str(tmp_path / "cache"), "--port", port, "--model", str(tiny_llama_dir)
    )
    assert code == 0, lines
    assert tuple(lines) == CHECKS
    assert lines["port"].startswith("OK") and "is free" in lines["port"]
    assert lines["model"].startswith("OK") and "llama" in lines["model"]
    for line in lines.values():  # every line that is not OK says what to do
        assert line.startswith("OK") or "\n     -> " in line, line


def test_doctor_fails_on_a_cache_dir_it_cannot_write(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, lines = doctor("--cache-dir", str(blocker / "cache"), "--port", str(free_port()))
    assert code == 1
    assert lines["cache dir"].startswith("FAIL") and "not writable" in lines["cache dir"]
    assert "-> fix its permissions or pass --cache-dir" in lines["cache dir"]


def test_doctor_fails_on_a_port_another_program_holds(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()  # accepts connections but answers no HTTP
        port = holder.getsockname()[1]
        code, lines = doctor("--cache-dir", str(tmp_path), "--port", str(port))
    assert code == 1
    assert lines["port"].startswith("FAIL") and "pick another --port" in lines["port"]


def test_doctor_fails_a_kv_budget_beyond_the_machine(tmp_path: Path) -> None:
    code, lines = doctor("--cache-dir", str(tmp_path), "--port", str(free_port()), "--cache-budget-mb", "1e9")
    assert code == 1
    assert lines["memory"].startswith("FAIL") and "lower --cache-budget-mb" in lines["memory"]


def test_doctor_sees_a_running_server_and_loads_the_model(
    shared_server: ServerProcess, default_model_dir: Path, tmp_path: Path
) -> None:
    argv = [
        "--cache-dir",
        str(tmp_path),
        "--port",
        str(shared_server.port),
        "--model",
        str(default_model_dir),
    ]
    code, lines = doctor(*argv, "--load")
    assert code == 0, lines
    assert lines["port"].startswith("OK") and "a semantic server runs there and is ready" in lines["port"]
    assert lines["model"].startswith("OK") and "loaded in" in lines["model"]


@pytest.mark.skipif(sys.platform == "darwin", reason="the OpenBLAS preload is Linux's")
def test_doctor_says_when_openblas_is_not_preloaded(tmp_path: Path) -> None:
    env = {**os.environ, "SEMANTIC_NO_FAST_BLAS": "1"}
    env.pop("SEMANTIC_FAST_BLAS", None)
    env.pop("LD_PRELOAD", None)
    cmd = [
        sys.executable,
        "-m",
        "semantic.cli",
        "doctor",
        "--cache-dir",
        str(tmp_path),
        "--port",
        str(free_port()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    blas = next(line for line in proc.stdout.splitlines() if " BLAS: " in line)
    assert blas.startswith("WARN") and "no OpenBLAS" in blas
