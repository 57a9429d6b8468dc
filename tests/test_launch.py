"""The launcher's environment: OpenBLAS preloaded, with threads that do not spin on a busy machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from semantic.launch import fast_blas_env

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher acts on Linux")


@linux_only
def test_openblas_is_preloaded_with_short_spinning_threads_unless_the_user_says_otherwise() -> None:
    env = fast_blas_env({"PATH": "/usr/bin"})
    assert env is not None and "libopenblas" in env["LD_PRELOAD"]
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert env["MALLOC_ARENA_MAX"] == "1"
    mine = fast_blas_env({"PATH": "/usr/bin", "OPENBLAS_THREAD_TIMEOUT": "20"})
    assert mine is not None and mine["OPENBLAS_THREAD_TIMEOUT"] == "20"
    assert fast_blas_env({"SEMANTIC_NO_FAST_BLAS": "1"}) is None


@linux_only
def test_a_launched_command_runs_under_that_environment() -> None:
    launched_by_us = {"SEMANTIC_FAST_BLAS", "OPENBLAS_THREAD_TIMEOUT", "LD_PRELOAD"}
    env = {name: value for name, value in os.environ.items() if name not in launched_by_us}
    show = "import os; e = os.environ; print(e.get('OPENBLAS_THREAD_TIMEOUT'), 'openblas' in e['LD_PRELOAD'])"
    printed = subprocess.run(
        [sys.executable, "-m", "semantic.launch", sys.executable, "-c", show],
        capture_output=True, text=True, check=True, timeout=120, env=env,
    ).stdout.split()  # fmt: skip
    assert printed == ["4", "True"]
