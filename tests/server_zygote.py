"""Starts the tests' servers and workers by forking one process that has already imported them.

A server's start is mostly imports (mlx-lm's tokenizer module brings in transformers), and the suite
starts about a hundred servers and conformance workers. This process imports their modules once,
then forks a child for each start that runs the start's module as `python -m MODULE ARGV...` would
(`runpy`), its output going to the start's log: the same code, environment and exit status, without
the imports. Nothing has run a model when it forks (imports only: no MLX computation, no BLAS call).

Protocol: one JSON line per connection on a Unix socket, answered with one JSON line.
  {"op": "spawn", "module": "semantic.cli", "argv": [...], "cwd": "...", "log": "...", "env": {...}}
    -> {"pid": 123}
  {"op": "status", "pid": 123} -> {"returncode": null | int}  (negative: the signal that ended it)
The zygote reaps its children and keeps their exit statuses; when its parent (the test session)
exits, it kills the children still running and exits too.

Linux only: on macOS a process that forks after loading Objective-C frameworks may crash, so the
tests start servers with `subprocess` there (tests/server_process.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any

REAP_INTERVAL_S = 0.02


def _preload() -> None:
    """The modules `semantic serve` imports before it loads a model."""
    import mlx_lm  # noqa: F401

    import semantic.actors.system
    import semantic.cli
    import semantic.protocols.app
    import semantic.server  # noqa: F401


def _exit_status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(request: dict[str, Any]) -> int:
    """In the forked child: the module, as `python -m MODULE ARGV` would run it."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    module, argv = request["module"], request["argv"]
    sys.argv = [module, *argv]  # runpy puts the module's path first, as `-m` does
    sys.orig_argv = [sys.executable, "-m", module, *argv]  # what a re-exec would run
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _reap(children: set[int], exited: dict[int, int]) -> None:
    """Moves the children that have ended from `children` to `exited`, with their statuses."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        exited[pid] = _exit_status(status)


def _serve(listener: socket.socket, parent: int) -> int | None:
    """Answers requests until the parent goes; returns an exit code in a forked child."""
    exited: dict[int, int] = {}
    children: set[int] = set()
    while os.getppid() == parent:
        _reap(children, exited)
        readable, _, _ = select.select([listener], [], [], REAP_INTERVAL_S)
        if not readable:
            continue
        conn, _ = listener.accept()
        with conn, conn.makefile("rwb") as stream:
            request = json.loads(stream.readline())
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    return _run_child(request)
                children.add(pid)
                reply: dict[str, Any] = {"pid": pid}
            else:
                _reap(children, exited)  # as of now, not of the last pass
                reply = {"returncode": exited.get(request["pid"])}
            stream.write(json.dumps(reply).encode() + b"\n")
            stream.flush()
    for pid in children:  # the session is gone (killed, say): so are the servers it started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return None


def main() -> None:
    socket_path, parent = sys.argv[1], os.getppid()
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{socket_path}.binding")
    listener.listen(16)
    os.rename(f"{socket_path}.binding", socket_path)  # the path appears once it takes connections
    code = _serve(listener, parent)
    if code is None:  # the zygote itself: its parent (the test session) is gone
        listener.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
