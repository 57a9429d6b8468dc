"""What the `agents` and `cache` commands share: they run holding the cache dir's lock and work on
its files, or, where a server holds the lock, ask that server (the lock file names its port) or
read what a running server's files allow (their writes are atomic renames), or refuse saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from semantic.cli_settings import add_settings_args, load_settings_from


class Server:
    """The server that holds the cache dir, reached over loopback HTTP."""

    def __init__(self, host: str, port: int, api_key: str | None) -> None:
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self.base_url = f"http://{host}:{port}"
        self.headers = {"x-api-key": api_key} if api_key else {}

    def call(self, method: str, path: str) -> Any:
        request = urllib.request.Request(f"{self.base_url}{path}", method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            message = error.read().decode(errors="replace")[:500]
            raise SystemExit(f"semantic: the server answered {error.code}: {message}") from None
        except OSError as error:
            raise SystemExit(f"semantic: cannot reach the server at {self.base_url}: {error}") from None


Direct = Callable[[argparse.Namespace, Path], int]
ViaServer = Callable[[argparse.Namespace, Path, Server], int]


def _cache_dir(args: argparse.Namespace) -> tuple[Path, str | None]:
    from semantic.engine.model.default_model import user_cache_dir

    settings = load_settings_from(args).settings
    return (Path(settings.cache.dir) if settings.cache.dir else user_cache_dir()), settings.server.api_key


def run_on_cache_dir(args: argparse.Namespace, direct: Direct, via_server: ViaServer | str) -> None:
    """Run `direct` holding the cache dir's lock; where a server holds it, `via_server` (or refuse,
    where it is a reason)."""
    from semantic.storage.cache_dir_lock import CacheDirBusyError, CacheDirLock, LockFileError, LockHolder

    cache_dir, api_key = _cache_dir(args)
    lock = CacheDirLock(cache_dir, LockHolder(os.getpid(), "command"))
    try:
        lock.acquire()
    except LockFileError as error:
        raise SystemExit(f"semantic: {error}") from None
    except CacheDirBusyError as error:
        holder = error.holder
        if holder is None or holder.role != "server":
            raise SystemExit(f"semantic: {error}; try again once it is done") from None
        if isinstance(via_server, str):
            raise SystemExit(f"semantic: {error}: {via_server}") from None
        raise SystemExit(via_server(args, cache_dir, Server(holder.host, holder.port, api_key))) from None
    try:
        code = direct(args, cache_dir)
    finally:
        lock.release()
    raise SystemExit(code)


def print_rows(args: argparse.Namespace, rows: list[dict[str, Any]], columns: list[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=1))
        return
    table = [[c.upper() for c in columns], *([str(row.get(c, "")) for c in columns] for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def add_verb(
    verbs: Any,
    name: str,
    help_text: str,
    direct: Direct,
    via_server: ViaServer | str,
    agent: bool = False,
    json_flag: bool = False,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = verbs.add_parser(name, help=help_text)
    add_settings_args(parser, server=False)  # --cache-dir and --config, as `serve` takes them
    if agent:
        parser.add_argument("agent_id")
        parser.add_argument("--model-folder", default=None, help="only the files of this model's folder")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=lambda args: run_on_cache_dir(args, direct, via_server))
    return parser
