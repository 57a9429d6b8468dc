"""Start processes with the environment their device wants: a fast BLAS where MLX runs on a Linux CPU.

The Linux mlx-cpu wheel multiplies matrices with the reference BLAS, which makes prefill many times
slower (docs/benchmarks.md, "Linux CPU speed"). We preload a runtime-dispatching OpenBLAS (the
`ngsolve-openblas` wheel) so MLX's `cblas_*` calls resolve to it. `LD_PRELOAD` only takes effect at
process start, so the CLI re-executes itself and `python -m semantic.launch CMD...` wraps any other
command.

The same environment keeps glibc's malloc from handing each large buffer back to the kernel: MLX's
CPU allocator mallocs every array, and an attention score matrix of tens of MB otherwise comes
from a fresh `mmap` whose page faults cost more than the arithmetic on it. The heap keeps its peak
size instead, and
every thread shares the main arena, whose settings these are.

And OpenBLAS's idle threads stop spinning almost at once (`BLAS_TUNING`): by default each spins
for about 2^28 cycles after every call, which costs nothing on an idle machine and everything on
a busy one, where the spinning threads take the cores from the thread with work. The short spin
makes a reply beside busy processes several times faster and an idle one no slower
(docs/benchmarks.md, "Linux CPU speed").

All of it is for the CPU, so the launcher decides by device, not by OS, and without importing
mlx.core (that loads the backend's libraries into a process about to be replaced): from
`backend.device` as `serve` will read it (`--device`, SEMANTIC_BACKEND_DEVICE, .env, --config), else the
backend wheel installed beside the mlx that `import mlx.core` will load (mlx-cpu, mlx-cuda[-12|-13]
on Linux, mlx-metal on macOS). A CUDA mlx with no visible NVIDIA GPU runs on the CPU, so it gets
the CPU's environment; where OpenBLAS's libgfortran cannot be found, it starts without OpenBLAS.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from semantic.engine.loop.backend_profile import FAST_BLAS_MARKER

Backend = Literal["cpu", "metal", "cuda"]
LaunchDevice = Literal["cpu", "gpu"]

_OPT_OUT = "SEMANTIC_NO_FAST_BLAS"
# One arena: glibc gives other threads arenas of 64 MB heaps that map and unmap what outgrows them,
# so on the engine thread (not the main one) those arrays paid the page faults all the same.
MALLOC_TUNING = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 34), "MALLOC_ARENA_MAX": "1"}
# OpenBLAS threads spin 2^n cycles waiting for work before they sleep; 4 is the least it takes.
BLAS_TUNING = {"OPENBLAS_THREAD_TIMEOUT": "4"}
# mlx's release builds are two wheels: `mlx` (Python) and one holding libmlx for its backend.
_BACKEND_WHEELS: tuple[tuple[str, Backend], ...] = (
    ("mlx_metal-", "metal"),
    ("mlx_cuda", "cuda"),  # mlx-cuda, mlx-cuda-12, mlx-cuda-13
    ("mlx_cpu-", "cpu"),
)
_CUDA_IN_CMAKE = re.compile(r"if\s*\(\s*(ON|TRUE|YES|1)\s*\)\s*find_dependency\(CUDAToolkit", re.IGNORECASE)
_METAL_IN_CMAKE = re.compile(r"set\(MLX_BUILD_METAL\s+(ON|TRUE|YES|1)\)", re.IGNORECASE)
# CUDA_VISIBLE_DEVICES values that hide every GPU (SLURM writes NoDevFiles for jobs without one).
_NO_CUDA_DEVICES = {"", "-1", "NoDevFiles"}


def package_dirs(name: str, search_path: Sequence[str] | None = None) -> list[Path]:
    """The folders `import name` would search, first first: one per portion of a namespace package
    (cwd's `mlx/` folder included, where cwd is on the path)."""
    spec = importlib.machinery.PathFinder.find_spec(name, None if search_path is None else list(search_path))
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(location) for location in spec.submodule_search_locations]


def mlx_package_dir(search_path: Sequence[str] | None = None) -> Path | None:
    """The mlx that `import mlx.core` loads: the portion of the `mlx` namespace package holding the
    `core` extension, not a folder that merely is named `mlx/` (MLX's kernel cache in $TMPDIR)."""
    for folder in package_dirs("mlx", search_path):
        if any((folder / f"core{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES):
            return folder
    return None


def mlx_backend(mlx_dir: Path) -> Backend | None:
    """What the mlx in `mlx_dir` was built for: its backend wheel's dist-info beside it, else the
    CMake config a source build installs. None where neither says."""
    for prefix, backend in _BACKEND_WHEELS:
        if next(mlx_dir.parent.glob(f"{prefix}*.dist-info"), None) is not None:
            return backend
    try:
        config = (mlx_dir / "share" / "cmake" / "MLX" / "MLXConfig.cmake").read_text()
    except OSError:
        return None
    if _METAL_IN_CMAKE.search(config):
        return "metal"
    return "cuda" if _CUDA_IN_CMAKE.search(config) else "cpu"


def nvidia_gpu_visible(environ: Mapping[str, str], dev_dir: Path = Path("/dev")) -> bool:
    """Whether CUDA would see a GPU: a device node of the NVIDIA driver, not hidden by
    CUDA_VISIBLE_DEVICES."""
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in _NO_CUDA_DEVICES:
        return False
    return next(dev_dir.glob("nvidia[0-9]*"), None) is not None


def launch_device(
    environ: Mapping[str, str], argv: Sequence[str], mlx_dir: Path, dev_dir: Path = Path("/dev")
) -> LaunchDevice:
    """Where MLX will run in the launched process: `backend.device` where it says cpu or gpu, else
    (auto, or a value `serve` will refuse) the GPU where the build has one: Metal, or CUDA with a
    GPU to run on. A CUDA build without one runs on the CPU; an unknown build is taken for a CPU one."""
    requested = requested_device(environ, argv)
    if requested in ("cpu", "gpu"):
        return "cpu" if requested == "cpu" else "gpu"
    backend = mlx_backend(mlx_dir)
    if backend == "metal" or (backend == "cuda" and nvidia_gpu_visible(environ, dev_dir)):
        return "gpu"
    return "cpu"


def requested_device(environ: Mapping[str, str], argv: Sequence[str] = ()) -> str:
    """`backend.device` as the settings will give it: `--device` in argv over the environment over
    `.env` over the `--config` file. The bare flag or variable where the settings do not load."""
    from semantic.protocols.settings import ConfigError, load_settings

    flag = _flag_value(argv, "--device")
    config = _flag_value(argv, "--config")
    try:
        loaded = load_settings(
            {} if flag is None else {"backend.device": flag},
            environ=environ,
            config_file=None if config is None else Path(config),
        )
    except ConfigError:  # `serve` says what is wrong; the launcher only needs the device
        return flag or environ.get("SEMANTIC_BACKEND_DEVICE", "auto")
    return loaded.settings.backend.device


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None  # argparse keeps the last one given
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.partition("=")[2]
    return value


def _gfortran_dirs(mlx_dir: Path, cache_dir: Path) -> list[str] | None:
    """Folders that make OpenBLAS's libgfortran.so.5 loadable: [] where the system has it, None where
    nothing here provides it."""
    import ctypes.util

    if (ctypes.util.find_library("gfortran") or "").endswith(".so.5"):
        return []
    # mlx's Linux wheels bundle libgfortran under a mangled name (auditwheel) in `mlx_*.libs`.
    candidates = sorted(mlx_dir.parent.glob("mlx*.libs/libgfortran-*.so.5*"))
    if not candidates:
        return None
    shim_dir = cache_dir / "blas-shim"
    shim_dir.mkdir(parents=True, exist_ok=True)
    link = shim_dir / "libgfortran.so.5"
    if not link.exists() or link.resolve() != candidates[0].resolve():
        tmp = shim_dir / f".libgfortran.so.5.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(candidates[0])
        os.replace(tmp, link)
    return [str(shim_dir), str(candidates[0].parent)]


def fast_blas_env(
    environ: Mapping[str, str] | None = None,
    argv: Sequence[str] = (),
    search_path: Sequence[str] | None = None,
) -> dict[str, str] | None:
    """The environment to launch with: OpenBLAS and the malloc settings where MLX will run on a
    Linux CPU (`argv`: the semantic CLI's, for `--device`; `search_path`: where mlx and OpenBLAS
    are looked up, sys.path by default). None where the environment stays as it is."""
    env = dict(os.environ if environ is None else environ)
    if not sys.platform.startswith("linux") or env.get(_OPT_OUT):
        return None
    if env.get(FAST_BLAS_MARKER):  # preloaded already (a launcher above us); a group rank may still need
        return _with_blas_threads(env) if "OPENBLAS_NUM_THREADS" not in env else None  # its threads
    mlx_dir = mlx_package_dir(search_path)
    if mlx_dir is None:
        return None
    if launch_device(env, argv, mlx_dir) == "gpu":
        return None
    libs = [
        lib
        for folder in package_dirs("ngsolve_openblas", search_path)
        for lib in sorted(folder.glob("libopenblas*.so*"))
    ]
    if not libs:
        return None
    # engine/model/default_model.py's user_cache_dir, which would import mlx.core into the launcher
    cache_dir = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "semantic"
    gfortran_dirs = _gfortran_dirs(mlx_dir, cache_dir)
    if gfortran_dirs is None:
        print(
            "semantic: starting without OpenBLAS (CPU prefill ~25x slower): it needs libgfortran.so.5, "
            f"which neither the system nor the mlx in {mlx_dir} provides; install libgfortran5",
            file=sys.stderr,
        )
        return {**env, _OPT_OUT: "1"}  # a launcher below us need not look (or warn) again
    preload = [str(libs[0])] + [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    library_path = gfortran_dirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env.update(
        LD_PRELOAD=":".join(preload), LD_LIBRARY_PATH=":".join(library_path), **{FAST_BLAS_MARKER: "1"}
    )
    for variable, value in (MALLOC_TUNING | BLAS_TUNING).items():
        env.setdefault(variable, value)
    return _with_blas_threads(env) or env


def _with_blas_threads(env: dict[str, str]) -> dict[str, str] | None:
    """Ranks of a group on one machine share its cores; OpenBLAS threads that spin while they wait
    starve the ring's collectives: one thread each makes a group's turns many times faster. None
    where this process is not such a rank."""
    sharing = ranks_on_this_machine(env)
    if sharing <= 1:
        return None
    return {**env, "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // sharing))}


def ranks_on_this_machine(env: Mapping[str, str]) -> int:
    """How many ranks of the ring group mlx.launch started share this rank's address (1 alone)."""
    try:
        hosts = json.loads(Path(env["MLX_HOSTFILE"]).read_text())
        mine = {address.rsplit(":", 1)[0] for address in hosts[int(env["MLX_RANK"])]}
        return sum(1 for entry in hosts if mine & {address.rsplit(":", 1)[0] for address in entry})
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        return 1


def reexec_with_fast_blas() -> None:
    """Replace this process (the semantic CLI) with itself under OpenBLAS when that helps; return
    otherwise."""
    env = fast_blas_env(argv=sys.argv[1:])
    if env is not None and env.get(FAST_BLAS_MARKER):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m semantic.launch COMMAND [ARGS...]")
    env = fast_blas_env() or dict(os.environ)
    os.execvpe(sys.argv[1], sys.argv[1:], env)


if __name__ == "__main__":
    main()
