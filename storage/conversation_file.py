"""A stateful agent's conversation (system prompt and token ids) as a small JSON file.

The KV cache file can be evicted, quarantined or made for another model; this record is what the
direct agent API continues from, so a lost cache costs a prefill, never the conversation.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from semantic.storage.cache_file import replace_atomically


class ConversationRecord(msgspec.Struct):
    system: str | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    num_turns: int = 0
    created_at: float = 0.0


_decode = msgspec.json.Decoder(ConversationRecord).decode
_encode = msgspec.json.Encoder().encode


def write_conversation(path: Path, record: ConversationRecord) -> None:
    data = _encode(record)
    replace_atomically(path, lambda tmp: tmp.write_bytes(data))


def read_conversation(path: Path) -> ConversationRecord | None:
    """The record, or None when there is none or it cannot be read."""
    try:
        return _decode(path.read_bytes())
    except (FileNotFoundError, msgspec.DecodeError):
        return None
