"""`semantic cache du | gc`: the cache dir's disk use per model's folder and per agent, and the
leftovers (interrupted writes' temp files, old quarantined files) it can do without."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from semantic.cache_dir_commands import Server, add_verb, print_rows

DAY_S = 86400.0


def du_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    from semantic.storage.agents_folder import is_real_dir
    from semantic.storage.cache_dir_files import agents_in, model_folders, roots

    rows: list[dict[str, Any]] = []
    for folder in model_folders(cache_dir):
        agents = list(agents_in(folder).values())
        where = str(folder.relative_to(cache_dir))
        rows.append({"what": "model", "name": where, "bytes": sum(_size(p) for p in folder.iterdir())})
        rows += [{"what": "agent", "name": f"{where}/{a.agent_id}", "bytes": a.num_bytes} for a in agents]
    for root in roots(cache_dir):
        for name in ("quarantine", "newer-format"):
            if is_real_dir(root / name):
                where = str((root / name).relative_to(cache_dir))
                rows.append(
                    {"what": name, "name": where, "bytes": sum(_size(p) for p in (root / name).iterdir())}
                )
    print_rows(args, rows, ["what", "bytes", "name"])
    _report_links(cache_dir)
    return 0


def du_server(args: argparse.Namespace, cache_dir: Path, server: Server) -> int:
    return du_direct(args, cache_dir)


def _report_links(cache_dir: Path) -> None:
    from semantic.storage.cache_dir_files import linked_folders

    for link in linked_folders(cache_dir):
        print(f"skipped {link}: a symbolic link, not followed out of the cache dir", file=sys.stderr)


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(_size(inner) for inner in path.iterdir())
    return path.lstat().st_size


def gc_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    from semantic.storage.cache_dir_files import leftovers, remove

    found = leftovers(cache_dir, args.older_than * DAY_S, time.time())
    num_bytes = 0
    for path in found:
        num_bytes += _size(path) if not args.delete else remove(path)
        print(f"{'removed' if args.delete else 'would remove'} {path}")
    verb = "removed" if args.delete else "would remove (dry run; --delete removes)"
    print(f"{verb} {len(found)} files older than {args.older_than:g} days: {num_bytes} bytes")
    _report_links(cache_dir)
    return 0


def add_cache_parser(commands: Any) -> None:
    cache = commands.add_parser("cache", help="the cache dir's disk use and leftovers")
    cache_verbs = cache.add_subparsers(dest="cache_command", required=True)
    add_verb(
        cache_verbs, "du", "bytes per model's folder and per agent", du_direct, du_server, json_flag=True
    )
    gc = add_verb(
        cache_verbs,
        "gc",
        "remove interrupted writes' temp files and old quarantined files",
        gc_direct,
        "the server removes its temp files when it starts; stop it first to collect",
    )
    gc.add_argument("--older-than", type=float, default=7.0, metavar="DAYS", help="default 7")
    mode = gc.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", dest="delete", action="store_false", help="list only (the default)")
    mode.add_argument("--delete", dest="delete", action="store_true", help="remove them")
    gc.set_defaults(delete=False)
