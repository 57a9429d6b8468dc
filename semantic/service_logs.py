"""`semantic service logs`: the installed service's log file, its last lines and (`-f`) what is
added, across rotations."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from semantic.service_units import host_platform, installed_unit, unit_path

POLL_S = 0.5  # how often `-f` looks for new lines: a person reads them


def _log_file(args: argparse.Namespace) -> Path:
    info = installed_unit(unit_path(args.platform or host_platform(), Path.home(), args.name))
    if info is None:
        raise SystemExit(f"semantic service: {args.name!r} is not installed; its unit names the log file")
    return Path(info.stderr_file if args.stderr else info.log_file)


def _tail(path: Path, lines: int) -> tuple[str, int]:
    """The last `lines` lines and the file's size, where following starts."""
    with path.open("rb") as file:
        data = file.read()
    kept = data.splitlines(keepends=True)[-lines:] if lines > 0 else []
    return b"".join(kept).decode(errors="replace"), len(data)


def logs(args: argparse.Namespace) -> None:
    path = _log_file(args)
    if not path.exists() and not args.follow:
        raise SystemExit(f"semantic service: {path} does not exist yet: the service has logged nothing")
    text, offset = _tail(path, args.lines) if path.exists() else ("", 0)
    sys.stdout.write(text)
    sys.stdout.flush()
    if args.follow:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how following ends
            _follow(path, offset)


def _follow(path: Path, offset: int) -> None:
    """Print what is appended; after a rotation (a new, shorter file) start the new file from its top."""
    inode = path.stat().st_ino if path.exists() else None
    while True:
        try:
            stat = path.stat()
        except FileNotFoundError:
            time.sleep(POLL_S)
            continue
        if stat.st_ino != inode or stat.st_size < offset:
            inode, offset = stat.st_ino, 0
        if stat.st_size > offset:
            with path.open("rb") as file:
                file.seek(offset)
                chunk = file.read()
            offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        time.sleep(POLL_S)
