"""`semantic agents ...` and `semantic cache ...` with no server (on the files, under the cache
dir's lock) and with one running (through its HTTP API), two writers refused, and an agent
exported, imported into a fresh cache dir and resumed there token for token."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from semantic.cli import main
from semantic.storage.cache_dir_lock import CacheDirLock, LockHolder
from tests.data.formats.make_fixtures import AGENT_ID, MICRO_LLAMA
from tests.server_process import ServerProcess
from tests.test_file_formats import MAIN_713A895, identity, placed
from tests.tiny_models import write_random_model


@pytest.fixture(scope="module")
def micro_llama(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        dict(MICRO_LLAMA), tmp_path_factory.mktemp("m") / "micro-llama", default_model_dir
    )


def semantic(capsys: pytest.CaptureFixture[str], cache_dir: Path, *argv: str) -> tuple[int, str, str]:
    """Run `semantic ARGV --cache-dir CACHE_DIR` in this process: its exit status, stdout, stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--cache-dir", str(cache_dir)])
    out, err = capsys.readouterr()
    code = exited.value.code
    if isinstance(code, str):
        return 1, out, err + code
    return code or 0, out, err


def call(server: ServerProcess, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.base_url}{path}", data, {"Content-Type": "application/json"}, method=method
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_each_command_on_the_files_with_no_server(
    micro_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ident = identity(micro_llama)
    folder = placed(MAIN_713A895, tmp_path, ident)
    damaged = bytearray((folder / f"{AGENT_ID}.safetensors").read_bytes())
    damaged[-1] ^= 0xFF
    (folder / "bad.safetensors").write_bytes(bytes(damaged))

    code, out, _ = semantic(capsys, tmp_path, "agents", "ls", "--json")
    rows = {row["id"]: row for row in json.loads(out)}
    assert code == 0 and set(rows) == {AGENT_ID, "bad"}
    assert rows[AGENT_ID]["cached_tokens"] == 21 and rows[AGENT_ID]["conversation"]
    assert rows[AGENT_ID]["model"] == "micro-llama" and rows[AGENT_ID]["model_folder"] == folder.name
    code, out, _ = semantic(capsys, tmp_path, "agents", "show", AGENT_ID)
    assert code == 0 and json.loads(out)["turns"] == 1

    code, out, _ = semantic(capsys, tmp_path, "agents", "verify")
    assert code == 1 and "would quarantine" in out and "bad.safetensors: checksum mismatch" in out
    assert AGENT_ID not in out and (folder / "bad.safetensors").exists()
    code, out, _ = semantic(capsys, tmp_path, "agents", "verify", "--fix")
    assert code == 0 and not (folder / "bad.safetensors").exists()
    (quarantined,) = (tmp_path / "quarantine").iterdir()
    assert quarantined.name.startswith("bad.safetensors.")

    code, out, _ = semantic(capsys, tmp_path, "cache", "du", "--json")
    sizes = {(row["what"], row["name"]): row["bytes"] for row in json.loads(out)}
    cache_bytes = sum(p.stat().st_size for p in folder.iterdir())
    assert sizes[("model", f"agents/{folder.name}")] == cache_bytes
    assert sizes[("agent", f"agents/{folder.name}/{AGENT_ID}")] == cache_bytes
    assert sizes[("quarantine", "quarantine")] == quarantined.stat().st_size

    stale, fresh = folder / ".old.safetensors.99.tmp", folder / ".new.safetensors.98.tmp"
    stale.write_bytes(b"x" * 10)
    fresh.write_bytes(b"y")
    ten_days_ago = time.time() - 10 * 86400
    os.utime(stale, (ten_days_ago, ten_days_ago))
    code, out, _ = semantic(capsys, tmp_path, "cache", "gc", "--older-than", "5")
    assert code == 0 and "would remove" in out and stale.exists() and quarantined.exists()
    assert str(stale) in out and str(fresh) not in out and str(quarantined) not in out
    code, out, _ = semantic(capsys, tmp_path, "cache", "gc", "--older-than", "0", "--delete")
    assert code == 0 and not stale.exists() and not fresh.exists() and not quarantined.exists()

    code, out, _ = semantic(capsys, tmp_path, "agents", "rm", AGENT_ID)
    assert code == 0 and not list(folder.iterdir())
    code, _, err = semantic(capsys, tmp_path, "agents", "show", AGENT_ID)
    assert code == 1 and f"no agent {AGENT_ID}" in err


def test_a_second_writer_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with CacheDirLock(tmp_path, LockHolder(12345, "command")):
        code, _, err = semantic(capsys, tmp_path, "agents", "rm", "ada")
    assert code == 1 and "in use by a semantic command (pid 12345)" in err


def an_archive(tmp_path: Path, members: dict[str, bytes]) -> Path:
    path = tmp_path / "crafted.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_import_refuses_what_an_archive_must_not_hold(
    micro_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "source"
    placed(MAIN_713A895, source, identity(micro_llama))
    archive = tmp_path / "fixture.tar"
    assert semantic(capsys, source, "agents", "export", AGENT_ID, "-o", str(archive))[0] == 0
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
    manifest = json.loads(members["manifest.json"])
    conversation = f"{AGENT_ID}.conversation.json"

    def refused(crafted: dict[str, bytes], reason: str) -> None:
        code, _, err = semantic(
            capsys, tmp_path / "target", "agents", "import", str(an_archive(tmp_path, crafted))
        )
        assert code == 1 and reason in err, err
        assert not [p for p in (tmp_path / "target").rglob("*") if p.is_file() and p.name != "semantic.lock"]

    refused({**members, "../escape": b"x"}, "'../escape' is not one of the manifest's files")
    refused({**members, conversation: members[conversation].replace(b"Be", b"Go")}, "sha256 differs")
    bad_id = {**manifest, "agent_id": "../up"}
    refused({**members, "manifest.json": json.dumps(bad_id).encode()}, "bad manifest")
    refused({k: v for k, v in members.items() if k != "manifest.json"}, "does not start with a manifest.json")

    target = tmp_path / "target"
    assert semantic(capsys, target, "agents", "import", str(archive))[0] == 0
    code, _, err = semantic(capsys, target, "agents", "import", str(archive))
    assert code == 1 and "already has" in err and "--force" in err
    assert semantic(capsys, target, "agents", "import", str(archive), "--force")[0] == 0


def test_through_a_running_server_and_an_exported_agent_resumes_token_for_token(
    micro_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original_dir, fresh_dir, archive = tmp_path / "original", tmp_path / "fresh", tmp_path / "ada.tar"
    original = ServerProcess(original_dir, "--model", str(micro_llama)).start()
    try:
        call(original, "POST", "/v1/agents", {"id": "ada", "system": "Be brief."})
        call(original, "POST", "/v1/agents/ada/messages", {"content": "Hi", "max_tokens": 5})
        call(original, "POST", "/v1/agents", {"id": "gone"})

        second = ServerProcess(original_dir, "--model", str(micro_llama))
        with pytest.raises(
            RuntimeError, match=f"in use by a semantic server .* on 127.0.0.1:{original.port}"
        ):
            second.start()
        code, out, _ = semantic(capsys, original_dir, "agents", "ls", "--json")
        assert code == 0 and {row["id"] for row in json.loads(out)} >= {"ada", "gone"}
        code, out, _ = semantic(capsys, original_dir, "agents", "show", "ada")
        assert code == 0 and json.loads(out)["id"] == "ada"
        code, out, err = semantic(capsys, original_dir, "agents", "rm", "gone")
        assert code == 0, err
        with pytest.raises(urllib.error.HTTPError, match="404"):
            call(original, "GET", "/v1/agents/gone")
        assert semantic(capsys, original_dir, "agents", "export", "ada", "-o", str(archive))[0] == 0
        code, _, err = semantic(capsys, original_dir, "agents", "import", str(archive))
        assert code == 1 and "stop the server first" in err
        code, _, err = semantic(capsys, original_dir, "cache", "gc")
        assert code == 1 and "stop it first" in err
        assert semantic(capsys, original_dir, "agents", "verify")[0] == 0
        code, _, err = semantic(capsys, original_dir, "agents", "verify", "--fix")
        assert code == 1 and "stop it first" in err
        code, out, _ = semantic(capsys, original_dir, "cache", "du", "--json")
        assert code == 0 and any(row["name"].endswith("/ada") for row in json.loads(out))
        expected = call(
            original,
            "POST",
            "/v1/agents/ada/messages",
            {"content": "Go on", "max_tokens": 5, "temperature": 0},
        )
    finally:
        original.stop()

    assert semantic(capsys, fresh_dir, "agents", "import", str(archive))[0] == 0
    fresh = ServerProcess(fresh_dir, "--model", str(micro_llama)).start()
    try:
        resumed = call(
            fresh, "POST", "/v1/agents/ada/messages", {"content": "Go on", "max_tokens": 5, "temperature": 0}
        )
    finally:
        fresh.stop()
    assert resumed["usage"]["cached_tokens"] > 0 and resumed["usage"]["cache_tier"] == "disk"
    assert resumed["usage"] == expected["usage"]
    assert resumed["content"] == expected["content"]
    shutil.rmtree(fresh_dir)
