"""`semantic service`: the launchd plist and systemd unit it renders, checked field by field; install,
status, logs and uninstall in a temporary home; a real `systemd --user` round trip where one runs; and
the rotated log file the service's `serve` writes."""

from __future__ import annotations

import argparse
import configparser
import json
import os
import plistlib
import shlex
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from semantic.service import NOT_RUNNING, add_service_parser
from semantic.service_units import MARKER, read_marker
from tests.server_process import ROOT, ServerProcess, free_port
from tests.waiting import wait_until


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("HOME", str(path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return path


def service(*argv: str) -> int:
    """`semantic service ARGV...` in this process (the CLI's parser, no re-exec); its exit code."""
    parser = argparse.ArgumentParser(prog="semantic")
    add_service_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["service", *argv])
    try:
        args.run(args)
    except SystemExit as stop:
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)  # as the interpreter does with a message
        return 1
    return 0


def test_plist_renders_every_field_launchd_needs(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "semantic.toml"
    config.write_text("[server]\nshutdown_timeout_s = 10\n")
    cache = tmp_path / "cache"
    # in the order `serve --help` lists them, which is how the unit writes them back
    argv = ["--config", str(config), "--cache-dir", str(cache), "--port", "8123", "--log-level", "debug"]
    assert service("install", "--dry-run", "--platform", "macos", *argv) == 0
    out = capsys.readouterr()
    plist = plistlib.loads(out.out.encode())
    logs = cache / "logs"
    log_flag = ["--log-file", str(logs / "semantic.log")]
    assert plist == {
        "Label": "dev.semantic",
        "ProgramArguments": [sys.executable, "-m", "semantic.cli", "serve", *argv, *log_flag],
        "WorkingDirectory": str(cache),
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": 10,
        "ExitTimeOut": 70,  # the config file's shutdown timeout and a minute to flush caches
        "ProcessType": "Interactive",
        "StandardOutPath": str(logs / "semantic.stderr.log"),
        "StandardErrorPath": str(logs / "semantic.stderr.log"),
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
    }
    info = read_marker(out.out)
    assert info is not None and (info.port, info.host, info.name) == (8123, "127.0.0.1", "semantic")
    assert str(home / "Library/LaunchAgents/dev.semantic.plist") in out.err
    assert _serve_settings(plist["ProgramArguments"][4:])["server.port"] == 8123


def _serve_settings(serve_flags: list[str]) -> dict[str, object]:
    """The settings `serve` would run with, given these flags: `semantic config` reads them the same way."""
    proc = subprocess.run(
        [sys.executable, "-m", "semantic.cli", "config", *serve_flags],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    settings = (
        line for line in proc.stdout.splitlines() if not line.startswith("#")
    )  # the last: the profile
    pairs = (line.split("  # ")[0].split(" = ", 1) for line in settings)
    return {key: eval(value) for key, value in pairs}  # values are printed as Python reprs


def _systemd_unit(text: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read_string(text)
    return unit


def test_systemd_unit_quotes_paths_and_restarts_on_failure(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / 'odd "cache" 100%'
    assert service("install", "--dry-run", "--platform", "linux", "--cache-dir", str(cache)) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"# {MARKER} ")
    unit = _systemd_unit(out.out)
    assert unit.sections() == ["Unit", "Service", "Install"]
    serv = unit["Service"]
    exec_start = [word.replace("%%", "%") for word in shlex.split(serv["ExecStart"])]
    assert exec_start == [
        sys.executable, "-m", "semantic.cli", "serve", "--cache-dir", str(cache),
        "--log-file", str(cache / "logs/semantic.log"),
    ]  # fmt: skip
    assert serv["Restart"] == "on-failure" and serv["Type"] == "simple"
    assert serv["TimeoutStopSec"] == "90"  # the default 30 s shutdown timeout and a minute to flush
    assert serv["WorkingDirectory"] == str(cache).replace("%", "%%")
    assert serv["StandardError"] == "append:" + str(cache / "logs/semantic.stderr.log").replace("%", "%%")
    assert unit["Install"]["WantedBy"] == "default.target"
    assert str(home / ".config/systemd/user/semantic.service") in out.err
    assert _serve_settings(exec_start[4:])["cache.dir"] == str(cache)


def test_dry_run_writes_nothing(home: Path, capsys: pytest.CaptureFixture) -> None:
    for platform in ("linux", "macos"):
        assert service("install", "--dry-run", "--platform", platform) == 0
    assert list(home.rglob("*")) == []
    assert capsys.readouterr().out


def test_install_refuses_a_unit_it_did_not_write(home: Path, capsys: pytest.CaptureFixture) -> None:
    path = home / ".config/systemd/user/semantic.service"
    path.parent.mkdir(parents=True)
    foreign = "[Service]\nExecStart=/usr/bin/someone-elses-daemon\n"
    path.write_text(foreign)
    for argv in (["install", "--no-start"], ["uninstall", "--file-only"], ["status"]):
        assert service(*argv, "--platform", "linux") != 0, argv
        assert "not written by `semantic service install`" in capsys.readouterr().err + str(argv)
        assert path.read_text() == foreign


INJECTED = "\nExecStartPre=/bin/touch /tmp/semantic-injected"


@pytest.mark.parametrize("platform", ["linux", "macos"])
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--api-key", "key" + INJECTED),
        ("--log-file", "/tmp/semantic.log" + INJECTED),
        ("--alias", "claude*=" + INJECTED),
        ("--cache-dir", "/tmp/cache" + INJECTED),
        ("--log-file", "/tmp/bell\x07.log"),
    ],
)
def test_a_control_character_in_a_flag_is_refused_in_one_line(
    home: Path, platform: str, flag: str, value: str, capsys: pytest.CaptureFixture
) -> None:
    for mode in ("--dry-run", "--no-start"):
        assert service("install", mode, "--platform", platform, flag, value) == 2  # a usage error
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1, out.err
        assert flag in out.err and "control character" in out.err
        assert "ExecStartPre" not in out.err  # the value, which may be a key, is not echoed
    assert list(home.rglob("*")) == []


def test_a_value_ending_in_a_backslash_is_refused(home: Path, capsys: pytest.CaptureFixture) -> None:
    """systemd joins a line that ends in a backslash with the next: a directive of the value's choosing."""
    assert service("install", "--no-start", "--platform", "linux", "--cache-dir", "/tmp/cache\\") == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "--cache-dir" in out.err and "backslash" in out.err, out.err
    assert list(home.rglob("*")) == []


@pytest.mark.parametrize(
    "platform, holding_key",
    [("linux", ".config/semantic/semantic.env"), ("macos", "Library/LaunchAgents/dev.semantic.plist")],
)
def test_the_file_holding_the_key_and_its_folder_are_private(
    home: Path, tmp_path: Path, platform: str, holding_key: str
) -> None:
    umask = os.umask(0)  # what reaches the disk is what the installer asked for, nothing narrower
    try:
        argv = ["--platform", platform, "--cache-dir", str(tmp_path / "cache"), "--api-key", "k"]
        assert service("install", "--no-start", *argv) == 0
    finally:
        os.umask(umask)
    path = home / holding_key
    assert "SEMANTIC_SERVER_API_KEY" in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # nothing staged left


@pytest.mark.parametrize("platform", ["linux", "macos"])
def test_the_api_key_reaches_the_service_by_a_private_file_not_its_command_line(
    home: Path, tmp_path: Path, platform: str, capsys: pytest.CaptureFixture
) -> None:
    key = 'k"$%\\e y'
    argv = ["--platform", platform, "--cache-dir", str(tmp_path / "cache")]
    assert service("install", "--no-start", *argv, "--api-key", key) == 0
    if platform == "macos":
        unit = home / "Library/LaunchAgents/dev.semantic.plist"
        plist = plistlib.loads(unit.read_bytes())
        assert key not in plist["ProgramArguments"] and "--api-key" not in plist["ProgramArguments"]
        assert plist["EnvironmentVariables"]["SEMANTIC_SERVER_API_KEY"] == key
        secret_file = unit
    else:
        unit = home / ".config/systemd/user/semantic.service"
        serv = _systemd_unit(unit.read_text())["Service"]
        assert "--api-key" not in serv["ExecStart"] and "e y" not in unit.read_text()
        secret_file = home / ".config/semantic/semantic.env"
        assert serv["EnvironmentFile"] == str(secret_file)
        # systemd's double quotes: \ before " \ ` and $, the rest as written
        assert secret_file.read_text() == 'SEMANTIC_SERVER_API_KEY="k\\"\\$%\\\\e y"\n'
    assert secret_file.stat().st_mode & 0o777 == 0o600

    assert service("install", "--no-start", *argv) == 0  # without a key: none left behind
    assert "SEMANTIC_SERVER_API_KEY" not in unit.read_text() and "EnvironmentFile" not in unit.read_text()
    assert not (home / ".config/semantic/semantic.env").exists()
    assert service("install", "--no-start", *argv, "--api-key", key) == 0
    assert service("uninstall", "--file-only", "--platform", platform) == 0
    assert not unit.exists() and not (home / ".config/semantic/semantic.env").exists()
    capsys.readouterr()


def test_install_status_logs_uninstall_in_a_temporary_home(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cache, port = tmp_path / "cache", free_port()
    argv = ["--platform", "linux", "--cache-dir", str(cache), "--port", str(port), "--api-key", "k"]
    assert service("install", "--no-start", *argv) == 0
    path = home / ".config/systemd/user/semantic.service"
    assert path.stat().st_mode & 0o777 == 0o600
    assert service("install", "--no-start", *argv[:-2]) == 0  # ours: replaced
    assert "--api-key" not in path.read_text()
    capsys.readouterr()

    assert service("status", "--platform", "linux") == NOT_RUNNING  # nothing listens on the port
    status = capsys.readouterr().out
    assert str(path) in status and f"127.0.0.1:{port}/health/ready: no answer" in status

    log = cache / "logs/semantic.log"
    assert service("logs", "--platform", "linux") != 0  # nothing logged yet, said so
    assert "does not exist yet" in capsys.readouterr().err
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    assert service("logs", "--platform", "linux", "-n", "3") == 0
    assert capsys.readouterr().out == "line 7\nline 8\nline 9\n"

    assert service("uninstall", "--platform", "linux", "--file-only") == 0
    assert not path.exists() and log.exists()  # the logs stay
    assert service("status", "--platform", "linux") == NOT_RUNNING


def test_logs_follow_carries_on_across_a_rotation(home: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert service("install", "--no-start", "--platform", "linux", "--cache-dir", str(cache)) == 0
    log, seen = cache / "logs/semantic.log", tmp_path / "followed.txt"
    log.write_text("before\n")
    cmd = [sys.executable, "-m", "semantic.cli", "service", "logs", "-f", "--platform", "linux"]
    with seen.open("wb") as out:
        follower = subprocess.Popen(cmd, stdout=out, cwd=ROOT, env={**os.environ, "HOME": str(home)})
    try:
        wait_until(lambda: seen.read_text() == "before\n", "the last lines")
        with log.open("a") as file:
            file.write("appended\n")
        wait_until(lambda: seen.read_text().endswith("appended\n"), "an appended line")
        log.rename(log.with_name("semantic.1.log"))  # as loguru rotates: a new file in its place
        log.write_text("rotated\n")
        wait_until(lambda: seen.read_text() == "before\nappended\nrotated\n", "the new file's lines")
    finally:
        follower.terminate()
        follower.wait()


def test_log_file_rotates_and_keeps_the_newest_files(tmp_path: Path) -> None:
    log = tmp_path / "logs/semantic.log"
    script = f"""
from loguru import logger
from semantic.protocols.settings import LoggingSection
from semantic.logs import configure_logging
configure_logging(LoggingSection(file={str(log)!r}, rotate_mb=0.002, keep_files=2, format="json"))
for i in range(400):
    logger.info("line {{}} of the rotation test", i)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "rotation test" not in proc.stderr  # with a file, stderr keeps warnings only
    files = sorted(log.parent.iterdir())
    assert len(files) == 3, files  # the live file and the two newest rotated ones
    assert all(path.stat().st_size <= 4096 for path in files)
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["message"] == "line 399 of the rotation test" and last["level"] == "INFO"


def _systemd_user_usable() -> str | None:
    """None where a `systemd --user` manager answers, else why not."""
    try:
        proc = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True, text=True)
    except FileNotFoundError:
        return "no systemctl on this machine"
    if proc.returncode != 0:
        return f"no systemd --user manager here: {proc.stderr.strip() or proc.returncode}"
    return None


@pytest.mark.skipif(_systemd_user_usable() is not None, reason=str(_systemd_user_usable()))
def test_real_systemd_user_service_serves_restarts_and_uninstalls(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """The user manager reads units from the real home only, so the unit goes there under a name of
    its own; the cache, logs and model are temporary."""
    name, port = f"semantic-test-{uuid.uuid4().hex[:8]}", free_port()
    cache = tmp_path / "cache"
    argv = ["--name", name, "--platform", "linux"]
    flags = ["--cache-dir", str(cache), "--port", str(port), "--model", str(default_model_dir)]
    try:
        assert service("install", *argv, *flags) == 0
        wait_until(lambda: _ready(port), "the service to serve", interval_s=0.5)
        pid = _main_pid(name)
        assert service("status", *argv) == 0
        subprocess.run(["systemctl", "--user", "restart", f"{name}.service"], check=True)
        wait_until(lambda: _main_pid(name) not in ("0", pid) and _ready(port), "a restart", interval_s=0.5)
        assert (cache / "logs" / f"{name}.log").read_text().count(" INFO ") > 0
    finally:
        service("uninstall", *argv)
    assert not _ready(port)
    assert not (Path.home() / f".config/systemd/user/{name}.service").exists()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _main_pid(name: str) -> str:
    show = ["systemctl", "--user", "show", "-p", "MainPID", "--value", f"{name}.service"]
    return subprocess.run(show, capture_output=True, text=True, check=True).stdout.strip()


def test_serve_logs_to_its_file_and_warns_of_a_key_on_its_command_line(
    server_factory: Callable[..., ServerProcess], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "served.log"
    argv = ["--model", str(tiny_llama_dir), "--log-file", str(log), "--api-key", "k"]
    server = server_factory(*argv).start()
    with urllib.request.urlopen(f"{server.base_url}/health/ready", timeout=10) as reply:
        assert reply.status == 200
    assert server.stop() == 0
    assert " INFO " in log.read_text()
    assert " INFO " not in server.log()  # stderr: warnings only
    assert "--api-key" in server.log() and "SEMANTIC_SERVER_API_KEY" in server.log()
