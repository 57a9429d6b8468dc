"""`semantic agents ls | show | rm | export | import | verify`: on the cache dir's files under its
lock, or through the server that holds it (semantic/cache_dir_commands.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from semantic.cache_cli import add_cache_parser
from semantic.cache_dir_commands import Server, add_verb, print_rows

if TYPE_CHECKING:  # storage loads MLX: only once a command runs
    from semantic.storage.cache_dir_files import AgentFiles


def _agent_row(files: AgentFiles) -> dict[str, Any]:
    from semantic.storage.conversation_file import ConversationFileError, read_conversation

    header = files.header()
    row = {
        "id": str(files.agent_id),
        "model": header.get("model_name", ""),
        "model_folder": files.folder.name,
        "cached_tokens": int(header.get("num_tokens", 0) or 0),
        "bytes": files.num_bytes,
        "cache_format": header.get("format_version", ""),
        "conversation": files.has_conversation,
    }
    if files.has_conversation:
        try:
            record = read_conversation(files.conversation_path)
            row["turns"] = record.num_turns if record else 0
        except ConversationFileError as error:
            row["conversation_error"] = str(error)
    return row


def ls_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    from semantic.storage.cache_dir_files import all_agents

    rows = [_agent_row(files) for files in all_agents(cache_dir)]
    print_rows(args, rows, ["id", "model", "cached_tokens", "bytes", "conversation"])
    return 0


def ls_server(args: argparse.Namespace, cache_dir: Path, server: Server) -> int:
    rows = server.call("GET", "/v1/agents")["data"]
    print_rows(args, rows, ["id", "cached_tokens", "tier", "last_used_s_ago"])
    return 0


def _found(args: argparse.Namespace, cache_dir: Path) -> list[AgentFiles]:
    from semantic.storage.agent_id import AgentId, InvalidAgentIdError
    from semantic.storage.cache_dir_files import find_agent

    try:
        found = find_agent(cache_dir, AgentId(args.agent_id))
    except InvalidAgentIdError as error:
        raise SystemExit(f"semantic: {error}") from None
    if getattr(args, "model_folder", None):
        found = [files for files in found if files.folder.name == args.model_folder]
    if not found:
        raise SystemExit(f"semantic: no agent {args.agent_id} in {cache_dir}")
    return found


def show_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    rows = [_agent_row(files) for files in _found(args, cache_dir)]
    print(json.dumps(rows if len(rows) > 1 else rows[0], indent=1))
    return 0


def show_server(args: argparse.Namespace, cache_dir: Path, server: Server) -> int:
    print(json.dumps(server.call("GET", f"/v1/agents/{_checked_id(args.agent_id)}"), indent=1))
    return 0


def _checked_id(agent_id: str) -> str:
    from semantic.storage.agent_id import AgentId, InvalidAgentIdError

    try:
        return AgentId(agent_id)
    except InvalidAgentIdError as error:
        raise SystemExit(f"semantic: {error}") from None


def rm_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    for files in _found(args, cache_dir):
        for path in files.paths:
            path.unlink(missing_ok=True)
            print(f"removed {path}")
    return 0


def rm_server(args: argparse.Namespace, cache_dir: Path, server: Server) -> int:
    print(json.dumps(server.call("DELETE", f"/v1/agents/{_checked_id(args.agent_id)}")))
    return 0


def export_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    from semantic.storage.agent_archive import export_archive

    found = _found(args, cache_dir)
    if len(found) > 1:
        folders = ", ".join(files.folder.name for files in found)
        raise SystemExit(
            f"semantic: agent {args.agent_id} has files for several models ({folders}): pass --model-folder"
        )
    manifest = export_archive(found[0], args.output)
    print(
        f"wrote {args.output}: agent {manifest.agent_id}, {len(manifest.files)} files, "
        f"model {manifest.model_fingerprint[:16]}"
    )
    return 0


def export_server(args: argparse.Namespace, cache_dir: Path, server: Server) -> int:
    """Have the server write the agent's cache to disk and free it, then read its (atomically
    written) files."""
    server.call("POST", f"/v1/agents/{_checked_id(args.agent_id)}/evict")
    return export_direct(args, cache_dir)


def import_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    from semantic.storage.agent_archive import ArchiveError, import_archive

    try:
        manifest, folder = import_archive(args.archive, cache_dir, force=args.force)
    except (ArchiveError, OSError) as error:
        raise SystemExit(f"semantic: not imported: {error}") from None
    print(f"imported agent {manifest.agent_id} into {folder}")
    return 0


def verify_direct(args: argparse.Namespace, cache_dir: Path) -> int:
    from semantic.storage.cache_dir_files import put_aside, verify

    num_checked, findings = verify(cache_dir)
    for finding in findings:
        action = "set aside (a newer release's)" if finding.is_newer else "quarantine"
        done = "moved" if args.fix else "would"
        if args.fix:
            put_aside(finding)
        print(f"{done} {action}: {finding.path}: {finding.problem}")
    print(
        f"{num_checked} files checked, {len(findings)} "
        f"{'moved aside' if args.fix else 'to move aside (--fix)'}"
    )
    return 1 if findings and not args.fix else 0


def verify_server(args: argparse.Namespace, cache_dir: Path, server: Server) -> int:
    if args.fix:
        raise SystemExit("semantic: a server uses the cache dir: stop it first to move files aside (--fix)")
    return verify_direct(args, cache_dir)  # reading files a server renames into place whole


def add_agents_parsers(commands: Any) -> None:
    agents = commands.add_parser("agents", help="list, show, remove, export, import or verify agents")
    verbs = agents.add_subparsers(dest="agents_command", required=True)
    add_verb(verbs, "ls", "list the agents", ls_direct, ls_server, json_flag=True)
    add_verb(verbs, "show", "one agent's files", show_direct, show_server, agent=True)
    add_verb(
        verbs,
        "rm",
        "remove an agent's files (or forget it, through a running server)",
        rm_direct,
        rm_server,
        agent=True,
    )
    export = add_verb(
        verbs, "export", "write an agent's files to one archive", export_direct, export_server, agent=True
    )
    export.add_argument("-o", "--output", type=Path, required=True, help="the archive (a tar) to write")
    imported = add_verb(
        verbs,
        "import",
        "place an exported agent's files",
        import_direct,
        "stop the server first, then import",
    )
    imported.add_argument("archive", type=Path)
    imported.add_argument("--force", action="store_true", help="replace the agent's files if it has some")
    check = add_verb(verbs, "verify", "check every file's checksum and layout", verify_direct, verify_server)
    check.add_argument("--fix", action="store_true", help="move what fails aside, as the server would")
    add_cache_parser(commands)
