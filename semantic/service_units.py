"""The service definitions `semantic service install` writes: a launchd LaunchAgent plist (macOS) and
a systemd user unit (Linux), each carrying a marker line so that only units we wrote are replaced."""

from __future__ import annotations

import plistlib
import re
import sys
from pathlib import Path
from typing import Literal

import msgspec

Platform = Literal["macos", "linux"]
MARKER = "semantic-service-unit"
LABEL_PREFIX = "dev.semantic."
# Any of these ends a systemd line early (a directive of its own follows) or is refused by plistlib.
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_ENV_FILE_SPECIAL = re.compile(r'[\\"`$]')  # escaped by a backslash in an EnvironmentFile's "..."
# launchd and systemd kill a service this long after SIGTERM; the server's own shutdown timeout
# (running requests) comes first, then every agent's cache is flushed to disk, which this covers.
FLUSH_MARGIN_S = 60


class UnitInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What `status` and `logs` need later, kept in the unit's marker line."""

    name: str
    log_file: str
    stderr_file: str
    host: str
    port: int
    version: str


class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True):
    info: UnitInfo
    argv: list[str]  # the serve command, absolute interpreter first; never a secret
    working_dir: str
    stop_timeout_s: float
    env_file: str  # where a systemd unit reads secret_env from; a plist holds it itself
    secret_env: dict[str, str] = {}  # SEMANTIC_* variables kept off the command line


def unit_path(platform: Platform, home: Path, name: str) -> Path:
    if platform == "macos":
        return home / "Library" / "LaunchAgents" / f"{launchd_label(name)}.plist"
    return home / ".config" / "systemd" / "user" / f"{name}.service"


def env_file_path(home: Path, name: str) -> Path:
    return home / ".config" / "semantic" / f"{name}.env"


def launchd_label(name: str) -> str:
    """dev.semantic for the default name, dev.semantic.NAME for another one beside it."""
    return LABEL_PREFIX.rstrip(".") if name == "semantic" else LABEL_PREFIX + name


def render(platform: Platform, spec: ServiceSpec) -> str:
    return render_plist(spec) if platform == "macos" else render_systemd(spec)


def _marker_json(info: UnitInfo) -> str:
    # An XML comment may not hold "--": JSON's \u escape spells the second dash another way.
    return msgspec.json.encode(info).decode().replace("--", "-\\u002d")


def render_plist(spec: ServiceSpec) -> str:
    plist = {
        "Label": launchd_label(spec.info.name),
        "ProgramArguments": spec.argv,
        "WorkingDirectory": spec.working_dir,
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": 10,
        "ExitTimeOut": int(spec.stop_timeout_s),
        "ProcessType": "Interactive",  # not throttled to background QoS: it answers interactive tools
        "StandardOutPath": spec.info.stderr_file,
        "StandardErrorPath": spec.info.stderr_file,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1", **spec.secret_env},
    }
    text = plistlib.dumps(plist, sort_keys=False).decode()
    head, sep, body = text.partition("<plist")
    return f"{head}<!-- {MARKER} {_marker_json(spec.info)} -->\n{sep}{body}"


def _checked(value: str) -> str:
    if CONTROL_CHARACTER.search(value) or value.endswith("\\"):
        raise ValueError(
            "a control character or a last backslash reached a unit: the installer refuses these first"
        )
    return value


def _systemd_word(word: str) -> str:
    """One ExecStart argument in systemd's quoting: "..." with \\ and " escaped, % and $ doubled."""
    escaped = _checked(word).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def _systemd_value(value: str) -> str:
    return _checked(value).replace("%", "%%")


def render_env_file(spec: ServiceSpec) -> str:
    """systemd's EnvironmentFile: each value in double quotes, a backslash before " \\ ` and $."""
    lines = []
    for name, value in spec.secret_env.items():
        escaped = _ENV_FILE_SPECIAL.sub(r"\\\g<0>", _checked(value))
        lines.append(f'{name}="{escaped}"\n')
    return "".join(lines)


def render_systemd(spec: ServiceSpec) -> str:
    info = spec.info
    lines = [
        f"# {MARKER} {_marker_json(info)}",
        "# Written by `semantic service install`; `semantic service uninstall` removes it.",
        "[Unit]",
        "Description=semantic: local multi-agent LLM inference daemon",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_systemd_word(word) for word in spec.argv),
        f"WorkingDirectory={_systemd_value(spec.working_dir)}",
        "Environment=PYTHONUNBUFFERED=1",
        *([f"EnvironmentFile={_systemd_value(spec.env_file)}"] if spec.secret_env else []),
        "Restart=on-failure",
        "RestartSec=5",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={int(spec.stop_timeout_s)}",
        f"StandardOutput=append:{_systemd_value(info.stderr_file)}",
        f"StandardError=append:{_systemd_value(info.stderr_file)}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


_MARKER_LINE = re.compile(rf"(?:#|<!--) {MARKER} (\{{.*\}})(?: -->)?\s*$", re.MULTILINE)


def read_marker(text: str) -> UnitInfo | None:
    """The marker of a unit we wrote, or None for anyone else's file."""
    match = _MARKER_LINE.search(text)
    if match is None:
        return None
    try:
        return msgspec.json.decode(match.group(1), type=UnitInfo)
    except msgspec.DecodeError:
        return None


def host_platform() -> Platform:
    return "macos" if sys.platform == "darwin" else "linux"


def installed_unit(path: Path) -> UnitInfo | None:
    """Our marker in the unit at `path`; None where there is no file; refused where it is not ours."""
    if not path.exists():
        return None
    info = read_marker(path.read_text(errors="replace"))
    if info is None:
        raise SystemExit(
            f"semantic service: {path} exists and was not written by `semantic service install`; "
            "leaving it alone"
        )
    return info
