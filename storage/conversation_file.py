"""A stateful agent's conversation (system prompt and token ids) as a small JSON file.

The KV cache file can be evicted, quarantined or made for another model; this record is what the
direct agent API continues from, so a lost cache costs a prefill, never the conversation.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from semantic.storage.cache_file import replace_atomically

# 2: the record states its version. 1 (no version stated) holds the same fields: read as it is.
FORMAT_VERSION = 2
PREVIOUS_VERSION = 1


class ConversationFileError(ValueError):
    """The record cannot be used: truncated, not ours, or token ids the model does not have."""


class NewerConversationFileError(ConversationFileError):
    """A record of a format newer than this release reads: set aside for that release, not misread."""


class ConversationRecord(msgspec.Struct):
    system: str | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    num_turns: int = 0
    created_at: float = 0.0


class _StoredRecord(ConversationRecord):
    """The record as a file holds it: with the version of its format."""

    format_version: int = PREVIOUS_VERSION


class _StatedVersion(msgspec.Struct):
    """Only the version, read first: a newer format's other fields may not decode as ours."""

    format_version: int = PREVIOUS_VERSION


_decode = msgspec.json.Decoder(_StoredRecord).decode
_decode_version = msgspec.json.Decoder(_StatedVersion).decode
_encode = msgspec.json.Encoder().encode


def write_conversation(path: Path, record: ConversationRecord) -> None:
    """Worker thread: write through a temp file, fsync, rename (raises OSError on failure)."""
    data = _encode(_StoredRecord(**msgspec.structs.asdict(record), format_version=FORMAT_VERSION))
    replace_atomically(path, lambda tmp: tmp.write_bytes(data))


def read_conversation(path: Path, vocab_size: int = 0) -> ConversationRecord | None:
    """Worker thread: the record, None when there is none; ConversationFileError when it is bad."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        version = _decode_version(data).format_version
        if version > FORMAT_VERSION:
            raise NewerConversationFileError(
                f"format version {version}, newer than this release's {FORMAT_VERSION}"
            )
        stored = _decode(data)
    except msgspec.DecodeError as error:
        raise ConversationFileError(f"unreadable conversation record: {error}") from error
    record = ConversationRecord(stored.system, stored.token_ids, stored.num_turns, stored.created_at)
    if record.token_ids and (
        min(record.token_ids) < 0 or (vocab_size and max(record.token_ids) >= vocab_size)
    ):
        raise ConversationFileError(f"token ids outside the vocabulary (0..{vocab_size - 1})")
    return record
