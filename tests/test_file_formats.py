"""Files across releases: the committed files an earlier release wrote (tests/data/formats/) are
read by this one, through the persistence actor that serves them, and a file of a newer format
than this release reads is set aside whole (not misread, not quarantined as corrupt)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from semantic.engine.model.loading import fingerprint_model
from semantic.storage.agent_id import AgentId
from semantic.storage.agents_folder import NEWER_FORMAT_DIR
from semantic.storage.cache_file import CacheIdentity, read_metadata
from semantic.storage.conversation_file import (
    FORMAT_VERSION,
    ConversationRecord,
    read_conversation,
    write_conversation,
)
from semantic.storage.persistence import PersistenceActor
from tests.data.formats.make_fixtures import AGENT_ID, MICRO_LLAMA
from tests.tiny_models import write_random_model

FORMATS = Path(__file__).parent / "data" / "formats"
MAIN_713A895 = FORMATS / "main-713a895"
# What format 3 states for the micro Llama: one full-attention layer, one KV head of 16.
MICRO_SPEC = {
    "block_size": 256,
    "dtype": "float32",
    "kv_widths": [[1, 16, 16]],
    "layer_kinds": ["full"],
    "layer_windows": [None],
    "num_layers": 1,
    "state_arrays": [],
}


@pytest.fixture(scope="module")
def micro_llama(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        dict(MICRO_LLAMA), tmp_path_factory.mktemp("m") / "micro-llama", default_model_dir
    )


def identity(model_dir: Path) -> CacheIdentity:
    return CacheIdentity(
        model_dir.name, fingerprint_model(model_dir), 256, MICRO_SPEC, MICRO_LLAMA["vocab_size"]
    )


def placed(fixture: Path, cache_dir: Path, ident: CacheIdentity) -> Path:
    """The fixture's agent files copied where a server of `ident`'s model looks for them."""
    folder = cache_dir / "agents" / ident.fingerprint[:16]
    folder.mkdir(parents=True)
    for name in (f"{AGENT_ID}.safetensors", f"{AGENT_ID}.conversation.json"):
        shutil.copy(fixture / name, folder / name)
    return folder


def loaded(cache_dir: Path, ident: CacheIdentity) -> tuple[object, ConversationRecord | None, int]:
    async def run() -> tuple[object, ConversationRecord | None, int]:
        actor = PersistenceActor(cache_dir, ident)
        await actor.start()
        try:
            cache = await actor.load(AgentId(AGENT_ID))
            record = await actor.load_conversation(AgentId(AGENT_ID))
            return cache, record, actor.num_quarantined
        finally:
            await actor.stop()

    return asyncio.run(run())


def test_main_713a895_files_are_read_by_this_release(micro_llama: Path, tmp_path: Path) -> None:
    ident = identity(micro_llama)
    assert read_metadata(MAIN_713A895 / f"{AGENT_ID}.safetensors")["model_fingerprint"] == ident.fingerprint
    stated = json.loads((MAIN_713A895 / f"{AGENT_ID}.conversation.json").read_text())
    assert "format_version" not in stated  # the previous conversation format, read as it is
    placed(MAIN_713A895, tmp_path, ident)

    cache, record, num_quarantined = loaded(tmp_path, ident)

    assert record is not None and record.token_ids == stated["token_ids"] and record.system == "Be brief."
    assert cache is not None and num_quarantined == 0
    assert cache.num_tokens == len(stated["token_ids"])  # type: ignore[attr-defined]
    assert cache.tensors["tokens"].tolist() == stated["token_ids"]  # type: ignore[attr-defined]


def test_a_conversation_is_written_with_its_version_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "a.conversation.json"
    record = ConversationRecord("sys", [1, 2, 3], 2, 5.0)
    write_conversation(path, record)
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION == 2
    assert read_conversation(path, vocab_size=10) == record


def test_files_of_a_newer_format_are_set_aside_not_quarantined(micro_llama: Path, tmp_path: Path) -> None:
    ident = identity(micro_llama)
    folder = placed(MAIN_713A895, tmp_path, ident)
    cache_path, conversation_path = (
        folder / f"{AGENT_ID}.safetensors",
        folder / f"{AGENT_ID}.conversation.json",
    )
    metadata = {**read_metadata(cache_path), "format_version": "4", "checksum": "computed another way"}
    save_file(load_file(str(cache_path)), str(cache_path), metadata=metadata)
    # A later release's record: its version first, and a field of a type this release would refuse.
    conversation_path.write_text(json.dumps({"format_version": FORMAT_VERSION + 1, "token_ids": "elsewhere"}))
    newer = {path.name: path.read_bytes() for path in (cache_path, conversation_path)}

    cache, record, num_quarantined = loaded(tmp_path, ident)

    assert cache is None and record is None and num_quarantined == 0
    assert not (tmp_path / "quarantine").exists()
    set_aside = tmp_path / NEWER_FORMAT_DIR
    assert {path.name: path.read_bytes() for path in set_aside.iterdir()} == newer
