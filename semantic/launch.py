"""Start processes with a fast BLAS on Linux.

The Linux mlx-cpu wheel multiplies matrices with the reference BLAS, which makes prefill ~25x
slower. We preload a runtime-dispatching OpenBLAS (the `ngsolve-openblas` wheel) so MLX's
`cblas_*` calls resolve to it. `LD_PRELOAD` only takes effect at process start, so the CLI
re-executes itself and `python -m semantic.launch CMD...` wraps any other command.

The same environment keeps glibc's malloc from handing each large buffer back to the kernel: MLX's
CPU allocator mallocs every array, and an attention score matrix of tens of MB otherwise comes
from a fresh `mmap` whose page faults cost more than the arithmetic on it (an elementwise op over
12.7M floats: 37 ms with mmap, 4 ms from the heap). The heap keeps its peak size instead, and
every thread shares the main arena, whose settings these are.

And OpenBLAS's idle threads stop spinning almost at once (`BLAS_TUNING`): by default each spins
for about 2^28 cycles after every call, which costs nothing on an idle machine and everything on
a busy one, where the spinning threads take the cores from the thread with work. Measured on 2
cores beside two busy processes: a 36-token reply took 29-38 s instead of 2.3 s idle, 7-11 s with
the short spin (2.1 s idle, no slower), and a 1.5K-token prefill 25-33 s, 23-25 s with it (6.8 s
idle either way).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

_DONE_MARKER = "SEMANTIC_FAST_BLAS"
# One arena: glibc gives other threads arenas of 64 MB heaps that map and unmap what outgrows them,
# so on the engine thread (not the main one) those arrays paid the page faults all the same (an
# elementwise op over 13.6M floats: 55 ms there against 7 ms on the main thread).
MALLOC_TUNING = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 34), "MALLOC_ARENA_MAX": "1"}
# OpenBLAS threads spin 2^n cycles waiting for work before they sleep; 4 is the least it takes.
BLAS_TUNING = {"OPENBLAS_THREAD_TIMEOUT": "4"}


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _gfortran_dirs(cache_dir: Path) -> list[str]:
    import ctypes.util

    if ctypes.util.find_library("gfortran"):
        return []
    # The mlx-cpu wheel bundles libgfortran under a mangled name; OpenBLAS asks for libgfortran.so.5.
    mlx_dir = _package_dir("mlx")
    if mlx_dir is None:
        return []
    bundled_dir = mlx_dir.parent / "mlx_cpu.libs"
    candidates = sorted(bundled_dir.glob("libgfortran-*.so.5*"))
    if not candidates:
        return []
    shim_dir = cache_dir / "blas-shim"
    shim_dir.mkdir(parents=True, exist_ok=True)
    link = shim_dir / "libgfortran.so.5"
    if not link.exists() or link.resolve() != candidates[0].resolve():
        tmp = shim_dir / f".libgfortran.so.5.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(candidates[0])
        os.replace(tmp, link)
    return [str(shim_dir), str(bundled_dir)]


def fast_blas_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment that preloads OpenBLAS, or None where it is not needed or not available."""
    env = dict(os.environ if environ is None else environ)
    if not sys.platform.startswith("linux") or env.get("SEMANTIC_NO_FAST_BLAS"):
        return None
    if env.get(_DONE_MARKER):  # preloaded already (a launcher above us); a group rank may still need
        return _with_blas_threads(env) if "OPENBLAS_NUM_THREADS" not in env else None  # its threads
    openblas_dir = _package_dir("ngsolve_openblas")
    libs = sorted(openblas_dir.glob("libopenblas*.so*")) if openblas_dir else []
    if not libs:
        return None
    from semantic.engine.default_model import user_cache_dir

    preload = [str(libs[0])] + [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    library_path = _gfortran_dirs(user_cache_dir()) + [
        p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p
    ]
    env.update(LD_PRELOAD=":".join(preload), LD_LIBRARY_PATH=":".join(library_path), **{_DONE_MARKER: "1"})
    for variable, value in (MALLOC_TUNING | BLAS_TUNING).items():
        env.setdefault(variable, value)
    return _with_blas_threads(env) or env


def _with_blas_threads(env: dict[str, str]) -> dict[str, str] | None:
    """Ranks of a group on one machine share its cores; OpenBLAS threads that spin while they wait
    starve the ring's collectives (measured: a 2-rank returning turn took 6.5 s with 2 threads each,
    0.37 s with 1). None where this process is not such a rank."""
    sharing = ranks_on_this_machine(env)
    if sharing <= 1:
        return None
    return {**env, "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // sharing))}


def ranks_on_this_machine(env: dict[str, str]) -> int:
    """How many ranks of the ring group mlx.launch started share this rank's address (1 alone)."""
    try:
        hosts = json.loads(Path(env["MLX_HOSTFILE"]).read_text())
        mine = {address.rsplit(":", 1)[0] for address in hosts[int(env["MLX_RANK"])]}
        return sum(1 for entry in hosts if mine & {address.rsplit(":", 1)[0] for address in entry})
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        return 1


def reexec_with_fast_blas() -> None:
    """Replace this process with itself under OpenBLAS when that helps; return otherwise."""
    env = fast_blas_env()
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m semantic.launch COMMAND [ARGS...]")
    env = fast_blas_env() or dict(os.environ)
    os.execvpe(sys.argv[1], sys.argv[1:], env)


if __name__ == "__main__":
    main()
