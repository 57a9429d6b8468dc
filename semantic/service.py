"""`semantic service install | uninstall | status | logs`: the server as a login service, a launchd
LaunchAgent on macOS or a systemd user unit on Linux, with the settings `serve` would take."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from semantic import service_logs
from semantic.cli_settings import add_settings_args, load_settings_from
from semantic.protocols.settings import ENV_PREFIX, SECRET_KEYS
from semantic.service_units import (
    CONTROL_CHARACTER,
    FLUSH_MARGIN_S,
    Platform,
    ServiceSpec,
    UnitInfo,
    env_file_path,
    host_platform,
    installed_unit,
    launchd_label,
    render,
    render_env_file,
    unit_path,
)

if TYPE_CHECKING:
    from semantic.protocols.settings import Settings

# Settings holding paths: made absolute, since the service runs in another working directory.
PATH_SETTINGS = {"cache.dir", "model.dir", "server.api_keys_file", "logging.file"}
NOT_RUNNING = 3  # `status` exit code when the service is not up (as systemctl and LSB scripts say)


def _fail(message: str) -> SystemExit:
    return SystemExit(f"semantic service: {message}")


def _usage_error(message: str) -> SystemExit:
    print(f"semantic service: {message}", file=sys.stderr)
    return SystemExit(2)


def _refuse_control_characters(flag: str, value: str) -> None:
    """A newline would start a directive of its own in a systemd unit, and a plist holds none: said
    in one line that names the flag, never the value (it may be a key)."""
    if CONTROL_CHARACTER.search(value):
        raise _usage_error(f"{flag}: a control character (a newline, a tab...) cannot go in a service unit")
    if value.endswith("\\"):  # systemd would join the unit's next line onto this one
        raise _usage_error(f"{flag}: a value ending in a backslash cannot go in a service unit")


def _serve_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    """The settings flags given to `install`, as `serve` takes them (paths made absolute), and the
    secret ones as the SEMANTIC_* variables `serve` also reads, to keep them off its command line."""
    words: list[str] = []
    secret_env: dict[str, str] = {}
    for action in parser._actions:
        if not action.dest.startswith("setting:") or action.dest not in vars(args):
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        key = action.dest.removeprefix("setting:")
        if isinstance(action, argparse._StoreConstAction):
            words.append(flag)
            continue
        if isinstance(value, list):
            texts = [str(item) for item in value]
        else:
            absolute = key in PATH_SETTINGS or (key == "model.name" and Path(value).expanduser().exists())
            texts = [str(Path(value).expanduser().absolute()) if absolute else str(value)]
        for text in texts:
            _refuse_control_characters(flag, text)
            if key in SECRET_KEYS:
                secret_env[ENV_PREFIX + key.replace(".", "_").upper()] = text
            else:
                words += [flag, text]
    return words, secret_env


def _cache_dir(settings: Settings) -> Path:
    from semantic.engine.model.default_model import user_cache_dir

    return (Path(settings.cache.dir).expanduser() if settings.cache.dir else user_cache_dir()).absolute()


def build_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServiceSpec:
    """The unit for these settings, refused here (not in a restart loop) where `serve` would refuse."""
    from semantic import __version__
    from semantic.cli import _check_bind

    settings = load_settings_from(args).settings
    _check_bind(settings)
    cache_dir = _cache_dir(settings)
    logs_dir = cache_dir / "logs"
    log_file = Path(settings.logging.file).expanduser().absolute() if settings.logging.file else None
    log_file = log_file or logs_dir / f"{args.name}.log"
    argv = [sys.executable, "-m", "semantic.cli", "serve"]
    if args.config is not None:
        argv += ["--config", str(args.config.expanduser().absolute())]
    flags, secret_env = _serve_flags(parser, args)
    argv += flags
    if "--cache-dir" not in flags:  # the service's environment has no XDG_CACHE_HOME of ours
        argv += ["--cache-dir", str(cache_dir)]
    if "--log-file" not in flags:
        argv += ["--log-file", str(log_file)]
    for flag, word in itertools.pairwise(argv):  # values from the config file or environment too
        _refuse_control_characters(flag, word)
    info = UnitInfo(
        name=args.name,
        log_file=str(log_file),
        stderr_file=str(logs_dir / f"{args.name}.stderr.log"),
        host=settings.server.host,
        port=settings.server.port,
        version=__version__,
    )
    stop_s = settings.server.shutdown_timeout_s + FLUSH_MARGIN_S
    return ServiceSpec(
        info=info,
        argv=argv,
        working_dir=str(cache_dir),
        stop_timeout_s=stop_s,
        secret_env=secret_env,
        env_file=str(env_file_path(Path.home(), args.name)),
    )


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise _fail(
            f"{cmd[0]} not found: is this a {host_platform()} machine with a service manager?"
        ) from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise _fail(f"`{' '.join(cmd)}` exited with {proc.returncode}: {detail}")
    return proc


def _name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: letters, digits, '.', '_' and '-' only")
    return text


def _gui_domain() -> str:
    return f"gui/{os.getuid()}"


def _write_private(path: Path, text: str, is_secret: bool) -> None:
    """Write `path` whole (a staged file renamed over it), created 0600 so no other user can open it
    at any moment; a secret's folder is made private before any of it is written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if is_secret:
        path.parent.chmod(0o700)
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(staged, path)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise


def install(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    platform: Platform = args.platform or host_platform()
    spec = build_spec(parser, args)
    text = render(platform, spec)
    path = unit_path(platform, Path.home(), args.name)
    env_file = Path(spec.env_file)
    uses_env_file = platform == "linux" and bool(spec.secret_env)
    if args.dry_run:
        print(f"# would write {path}", file=sys.stderr)
        if uses_env_file:
            print(f"# and {env_file} (mode 0600: the API key)", file=sys.stderr)
        sys.stdout.write(text)
        return
    if platform != host_platform() and not args.no_start:
        raise _fail(f"--platform {platform} is not this machine's: use --dry-run or --no-start")
    installed_unit(path)  # refuses a unit someone else wrote
    Path(spec.info.log_file).parent.mkdir(parents=True, exist_ok=True)
    Path(spec.info.stderr_file).parent.mkdir(parents=True, exist_ok=True)
    if uses_env_file:
        _write_private(env_file, render_env_file(spec), is_secret=True)
    else:
        env_file.unlink(missing_ok=True)  # a key an earlier install kept there
    _write_private(path, text, is_secret=platform == "macos" and bool(spec.secret_env))
    print(f"wrote {path}")
    if args.no_start:
        return
    if platform == "macos":
        target = f"{_gui_domain()}/{launchd_label(args.name)}"
        _run("launchctl", "bootout", target, check=False)  # an older version of ours, if loaded
        _run("launchctl", "enable", target)
        _run("launchctl", "bootstrap", _gui_domain(), str(path))
    else:
        unit = f"{args.name}.service"
        _run("systemctl", "--user", "daemon-reload")
        _run("systemctl", "--user", "enable", unit)
        _run("systemctl", "--user", "restart", unit)  # starts it, or restarts an older version
    print(f"started; `semantic service status` shows when it is ready, logs in {spec.info.log_file}")


def uninstall(args: argparse.Namespace) -> None:
    platform: Platform = args.platform or host_platform()
    path = unit_path(platform, Path.home(), args.name)
    info = installed_unit(path)
    if info is None:
        print(f"not installed ({path} does not exist)")
        return
    if platform == host_platform() and not args.file_only:
        if platform == "macos":
            _run("launchctl", "bootout", f"{_gui_domain()}/{launchd_label(args.name)}", check=False)
        else:
            _run("systemctl", "--user", "disable", "--now", f"{args.name}.service")
    path.unlink()
    env_file_path(Path.home(), args.name).unlink(missing_ok=True)
    if platform == "linux" and platform == host_platform() and not args.file_only:
        _run("systemctl", "--user", "daemon-reload")
    print(f"removed {path}; logs kept in {Path(info.log_file).parent}")


def _manager_state(platform: Platform, name: str) -> str:
    if platform != host_platform():
        return "not this machine's platform"
    if platform == "macos":
        proc = _run("launchctl", "print", f"{_gui_domain()}/{launchd_label(name)}", check=False)
        if proc.returncode != 0:
            return "not loaded"
        states = [line.split("=", 1)[1].strip() for line in proc.stdout.splitlines() if "state =" in line]
        return f"loaded, {states[0] if states else 'state unknown'}"
    proc = _run("systemctl", "--user", "is-active", f"{name}.service", check=False)
    return (proc.stdout.strip() or proc.stderr.strip()) or f"unknown (exit {proc.returncode})"


def probe_ready(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """'ready', '503: reason' or another answer from /health/ready; None where nothing answers."""
    address = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/health/ready", timeout=timeout_s) as reply:
            return "ready" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read(200).decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError):
        return None


def status(args: argparse.Namespace) -> None:
    platform: Platform = args.platform or host_platform()
    path = unit_path(platform, Path.home(), args.name)
    info = installed_unit(path)
    if info is None:
        print(f"unit: {path} (not installed)")
        raise SystemExit(NOT_RUNNING)
    answer = probe_ready(info.host, info.port)
    print(f"unit: {path} (installed by semantic {info.version})")
    try:
        state = _manager_state(platform, args.name)
    except SystemExit as missing:  # no launchctl or systemctl here: the HTTP answer still tells
        state = str(missing.code)
    print(f"service manager: {state}")
    print(f"http://{info.host}:{info.port}/health/ready: {answer or 'no answer'}")
    print(f"log: {info.log_file}\nstderr: {info.stderr_file}")
    if answer != "ready":
        raise SystemExit(NOT_RUNNING)


def add_service_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    service = commands.add_parser("service", help="run the server as a login service (launchd, systemd)")
    actions = service.add_subparsers(dest="action", required=True)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--platform", choices=["macos", "linux"], default=None, help="default: this one")
        sub.add_argument(
            "--name", type=_name, default="semantic", help="the service's name (several may coexist)"
        )

    install_parser = actions.add_parser("install", help="write the unit and start it (settings as `serve`)")
    add_settings_args(install_parser, server=True)
    common(install_parser)
    install_parser.add_argument("--dry-run", action="store_true", help="print the unit, write nothing")
    install_parser.add_argument("--no-start", action="store_true", help="write the unit, start nothing")
    install_parser.set_defaults(run=lambda args: install(install_parser, args))

    uninstall_parser = actions.add_parser("uninstall", help="stop the service and remove its unit")
    common(uninstall_parser)
    uninstall_parser.add_argument(
        "--file-only", action="store_true", help="remove the file, leave the service manager alone"
    )
    uninstall_parser.set_defaults(run=uninstall)

    status_parser = actions.add_parser("status", help="installed? running? ready? (exit 3 when not)")
    common(status_parser)
    status_parser.set_defaults(run=status)

    logs_parser = actions.add_parser("logs", help="print the service's log file")
    common(logs_parser)
    logs_parser.add_argument("-n", "--lines", type=int, default=50, help="last lines to print")
    logs_parser.add_argument("-f", "--follow", action="store_true", help="keep printing what is added")
    logs_parser.add_argument("--stderr", action="store_true", help="the stderr file (crashes) instead")
    logs_parser.set_defaults(run=service_logs.logs)
