"""The launcher's environment: decided by the device MLX will run on, OpenBLAS preloaded on a Linux
CPU with threads that do not spin on a busy machine, and the right mlx found from any folder."""

from __future__ import annotations

import ctypes.util
import importlib.machinery
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semantic.launch import fast_blas_env, launch_device, mlx_package_dir

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher acts on Linux")
# The preload is for the CPU wheel; under mlx-cuda on a GPU the launcher rightly adds nothing.
cpu_wheel = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not list(importlib.metadata.distributions(name="mlx-cpu")),
    reason="OpenBLAS is preloaded for Linux's mlx-cpu wheel",
)
LAUNCHED_BY_US = {"SEMANTIC_FAST_BLAS", "SEMANTIC_NO_FAST_BLAS", "OPENBLAS_THREAD_TIMEOUT", "LD_PRELOAD"}
REAL_SITE = str(Path(importlib.metadata.distribution("ngsolve-openblas").locate_file("")))


def _plain_env(**extra: str) -> dict[str, str]:
    """This process's environment without what a launcher above the tests put there."""
    return {name: value for name, value in os.environ.items() if name not in LAUNCHED_BY_US} | extra


def _fake_mlx(site: Path, *dist_infos: str, cmake: str | None = None) -> Path:
    """An mlx install as the launcher reads it: the package with its `core` extension (empty), the
    dist-info of the wheels named, and the CMake config a build leaves."""
    mlx_dir = site / "mlx"
    mlx_dir.mkdir(parents=True)
    (mlx_dir / f"core{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    for name in dist_infos:
        (site / f"{name}.dist-info").mkdir()
    if cmake is not None:
        (mlx_dir / "share" / "cmake" / "MLX").mkdir(parents=True)
        (mlx_dir / "share" / "cmake" / "MLX" / "MLXConfig.cmake").write_text(cmake)
    return mlx_dir


CUDA_BUILD = (
    "if(ON)\n    find_dependency(CUDAToolkit REQUIRED)\nendif()\nif (OFF)\n    set(MLX_BUILD_METAL OFF)"
)
CPU_BUILD = (
    "if(OFF)\n    find_dependency(CUDAToolkit REQUIRED)\nendif()\nif (OFF)\n    set(MLX_BUILD_METAL OFF)"
)
METAL_BUILD = (
    "if(OFF)\n    find_dependency(CUDAToolkit REQUIRED)\nendif()\nif (ON)\n    set(MLX_BUILD_METAL ON)"
)
GPU_NODES = ("nvidiactl", "nvidia-uvm", "nvidia0")
DRIVER_ONLY = ("nvidiactl", "nvidia-uvm")  # the driver loaded, no GPU given to this container


@pytest.mark.parametrize(
    ("wheels", "cmake", "dev_nodes", "env", "argv", "device"),
    [
        (["mlx_cpu-0.32.4"], CPU_BUILD, (), {}, [], "cpu"),
        (["mlx_cpu-0.32.4"], CPU_BUILD, GPU_NODES, {}, [], "cpu"),  # a GPU box with the CPU wheel
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, GPU_NODES, {}, [], "gpu"),
        (["mlx_cuda_13-0.32.4"], CUDA_BUILD, GPU_NODES, {}, [], "gpu"),
        (["mlx_cuda-0.29.0"], None, GPU_NODES, {}, [], "gpu"),
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, (), {}, [], "cpu"),  # CUDA mlx on the CPU
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, DRIVER_ONLY, {}, [], "cpu"),
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, GPU_NODES, {"CUDA_VISIBLE_DEVICES": ""}, [], "cpu"),
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, GPU_NODES, {"CUDA_VISIBLE_DEVICES": "0"}, [], "gpu"),
        (["mlx_metal-0.32.4"], METAL_BUILD, (), {}, [], "gpu"),
        # backend.device: the flag over SEMANTIC_BACKEND_DEVICE over the wheels
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, GPU_NODES, {"SEMANTIC_BACKEND_DEVICE": "cpu"}, [], "cpu"),
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, GPU_NODES, {}, ["serve", "--device=cpu"], "cpu"),
        (
            ["mlx_cuda_12-0.32.4"],
            CUDA_BUILD,
            GPU_NODES,
            {"SEMANTIC_BACKEND_DEVICE": "cpu"},
            ["--device", "gpu"],
            "gpu",
        ),
        (["mlx_cpu-0.32.4"], CPU_BUILD, (), {}, ["serve", "--device", "gpu"], "gpu"),  # serve refuses it
        (["mlx_cuda_12-0.32.4"], CUDA_BUILD, GPU_NODES, {"SEMANTIC_BACKEND_DEVICE": "tpu"}, [], "gpu"),
        # source builds: no backend wheel, the CMake config says
        ([], CUDA_BUILD, GPU_NODES, {}, [], "gpu"),
        ([], CPU_BUILD, GPU_NODES, {}, [], "cpu"),
        ([], METAL_BUILD, (), {}, [], "gpu"),
        ([], None, GPU_NODES, {}, [], "cpu"),  # nothing says: taken for a CPU build
    ],
)
def test_the_device_is_decided_from_the_settings_the_installed_wheels_and_the_gpus_visible(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    wheels: list[str],
    cmake: str | None,
    dev_nodes: tuple[str, ...],
    env: dict[str, str],
    argv: list[str],
    device: str,
) -> None:
    monkeypatch.chdir(tmp_path)  # no `.env` of the checkout's
    mlx_dir = _fake_mlx(tmp_path / "site", *wheels, cmake=cmake)
    dev_dir = tmp_path / "dev"
    dev_dir.mkdir()
    for node in dev_nodes:
        (dev_dir / node).touch()
    assert launch_device({"PATH": "/usr/bin", **env}, argv, mlx_dir, dev_dir) == device


def test_the_config_file_named_on_the_command_line_can_ask_for_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    mlx_dir = _fake_mlx(tmp_path / "site", "mlx_metal-0.32.4")
    (tmp_path / "semantic.toml").write_text('[backend]\ndevice = "cpu"\n')
    assert launch_device({}, ["serve", "--config", "semantic.toml"], mlx_dir) == "cpu"
    assert launch_device({}, ["serve"], mlx_dir) == "gpu"


def test_a_folder_named_mlx_on_the_path_is_not_taken_for_the_package(tmp_path: Path) -> None:
    (tmp_path / "mlx").mkdir()  # MLX's own kernel cache in $TMPDIR
    real = mlx_package_dir()
    assert real is not None and real != tmp_path / "mlx"
    assert mlx_package_dir([str(tmp_path), *sys.path]) == real


@cpu_wheel
def test_openblas_is_preloaded_with_short_spinning_threads_unless_the_user_says_otherwise() -> None:
    env = fast_blas_env({"PATH": "/usr/bin"})
    assert env is not None and "libopenblas" in env["LD_PRELOAD"]
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert env["MALLOC_ARENA_MAX"] == "1"
    mine = fast_blas_env({"PATH": "/usr/bin", "OPENBLAS_THREAD_TIMEOUT": "20"})
    assert mine is not None and mine["OPENBLAS_THREAD_TIMEOUT"] == "20"
    assert fast_blas_env({"SEMANTIC_NO_FAST_BLAS": "1"}) is None
    assert fast_blas_env({"PATH": "/usr/bin"}, argv=["serve", "--device", "gpu"]) is None


@cpu_wheel
def test_a_launched_command_runs_under_that_environment() -> None:
    show = "import os; e = os.environ; print(e.get('OPENBLAS_THREAD_TIMEOUT'), 'openblas' in e['LD_PRELOAD'])"
    printed = subprocess.run(
        [sys.executable, "-m", "semantic.launch", sys.executable, "-c", show],
        capture_output=True, text=True, check=True, timeout=120, env=_plain_env(),
    ).stdout.split()  # fmt: skip
    assert printed == ["4", "True"]


@cpu_wheel
def test_launched_from_a_folder_holding_mlx_the_command_finds_openblas_and_multiplies(tmp_path: Path) -> None:
    (tmp_path / "mlx").mkdir()  # as in $TMPDIR, where MLX caches its kernels
    (tmp_path / "mlx" / "kernels.bin").write_bytes(b"\0")
    multiply = (
        "import os, mlx.core as mx; a = mx.ones((64, 64)); assert (a @ a).sum().item() == 64 ** 3; "
        "print('openblas' in os.environ['LD_PRELOAD'])"
    )
    launched = subprocess.run(
        [sys.executable, "-m", "semantic.launch", sys.executable, "-c", multiply],
        capture_output=True, text=True, timeout=120, env=_plain_env(), cwd=tmp_path,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.split() == ["True"]


@linux_only
def test_without_libgfortran_the_command_starts_without_openblas_and_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # the system has none
    site = tmp_path / "site"
    _fake_mlx(site, "mlx_cpu-0.32.4", cmake=CPU_BUILD)  # no mlx_cpu.libs beside it
    env = fast_blas_env({"PATH": "/usr/bin"}, search_path=[str(site), REAL_SITE])
    assert env is not None and "LD_PRELOAD" not in env and "SEMANTIC_FAST_BLAS" not in env
    assert "libgfortran.so.5" in capsys.readouterr().err
    assert fast_blas_env(env, search_path=[str(site), REAL_SITE]) is None  # a launcher below: quiet
    assert capsys.readouterr().err == ""


@linux_only
@pytest.mark.skipif(bool(ctypes.util.find_library("gfortran")), reason="this system has libgfortran")
def test_a_launch_where_mlx_bundles_no_libgfortran_still_starts(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _fake_mlx(site, "mlx_cpu-0.32.4", cmake=CPU_BUILD)
    show = "import os; print('LD_PRELOAD' in os.environ, os.environ.get('SEMANTIC_NO_FAST_BLAS'))"
    launched = subprocess.run(
        [sys.executable, "-m", "semantic.launch", sys.executable, "-c", show],
        capture_output=True, text=True, timeout=120, env=_plain_env(PYTHONPATH=str(site)), cwd=tmp_path,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout.split() == ["False", "1"]
    assert launched.stderr.count("libgfortran.so.5") == 1
