"""The two parts an engine plays in a group: rank 0 leads each tick, every other rank follows it.

`Leader.share` runs on rank 0's engine thread at the start of each tick, before the tick's
messages are applied; `Follower.receive` is the other ranks' matching call. Both then run the
same tick (`engine/loop/engine_loop.py`). While rank 0 idles it still shares an empty tick every
`heartbeat_s`, so a follower that hears nothing for the rank timeout knows rank 0 is gone.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any, Protocol

from semantic.engine.cache_store.cache_tensors import SerializedCache
from semantic.engine.group import group_tick
from semantic.engine.group.distributed import Collectives, GroupLayout
from semantic.engine.group.group_tick import GroupTick, Tick
from semantic.engine.loop.commands import Message
from semantic.engine.loop.config import EngineConfig
from semantic.engine.model.loading import LoadedModel

DIGEST_MODULUS = (1 << 61) - 1  # a Mersenne prime: the running token digest stays an int64


class GroupDivergedError(RuntimeError):
    """A follower generated other tokens than rank 0: its shards no longer match; it must stop."""


def next_digest(digest: int, token: int) -> int:
    return (digest * 1_000_003 + token + 1) % DIGEST_MODULUS


def clock_now() -> float:
    """Rank 0's clock as it travels: whole microseconds, so every rank computes the same float."""
    return round(time.monotonic() * 1_000_000) / 1_000_000


class ShardFiles(Protocol):
    """A follower's own cache files (its shard of each agent's cache): `semantic.storage.shard_files`."""

    def save(self, caches: list[SerializedCache], loaded: LoadedModel) -> None: ...

    def holds(self, agent_id: str, loaded: LoadedModel) -> bool: ...

    def load(self, agent_id: str, loaded: LoadedModel) -> SerializedCache | None: ...

    def delete(self, agent_id: str, loaded: LoadedModel) -> None: ...

    def close(self) -> None: ...


class _Rank:
    """What both parts share: the group's collectives, this rank's layout, the idle heartbeat."""

    def __init__(self, collectives: Collectives, layout: GroupLayout, heartbeat_s: float) -> None:
        self.collectives = collectives
        self.layout = layout
        self.heartbeat_s = heartbeat_s

    def agree(self, ok: bool, what: str) -> bool:
        return self.collectives.agree(ok, what)


class Leader(_Rank):
    def __init__(self, collectives: Collectives, layout: GroupLayout, heartbeat_s: float) -> None:
        super().__init__(collectives, layout, heartbeat_s)
        self._shared_config: EngineConfig | None = None

    def share(
        self,
        messages: list[Message],
        now: float,
        chunk: int,
        token_digest: int,
        fail_reason: str | None,
        config: EngineConfig,
        timeout_s: float | None = None,
    ) -> None:
        """Tell the other ranks what this tick does; raises GroupLostError if one is gone."""
        ops = [op for op in map(group_tick.op_for, messages) if op is not None]
        plan = GroupTick(ops, fail_reason, config_dict(config) if config is not self._shared_config else None)
        self._shared_config = config
        data = b"" if group_tick.is_empty(plan) else group_tick.encode(plan)
        header = [len(data), chunk, round(now * 1_000_000), token_digest]
        self.collectives.share_header(header, group_tick.HEADER_LENGTH, timeout_s)
        if data:
            self.collectives.share_bytes(data, len(data))


class Follower(_Rank):
    def __init__(
        self, collectives: Collectives, layout: GroupLayout, files: ShardFiles, heartbeat_s: float
    ) -> None:
        super().__init__(collectives, layout, heartbeat_s)
        self.files = files

    def receive(self, timeout_s: float | None = None) -> Tick:
        num_bytes, chunk, now_us, digest = self.collectives.share_header(
            None, group_tick.HEADER_LENGTH, timeout_s
        )
        plan = group_tick.decode(self.collectives.share_bytes(None, num_bytes)) if num_bytes else GroupTick()
        return Tick(now=now_us / 1_000_000, chunk=chunk, token_digest=digest, plan=plan)


# Each rank keeps its own paths and group settings; the rest must match for the ranks to agree.
# Each rank's own (paths, group settings), and what each works out from the rest (its profile).
_LOCAL_FIELDS = {"models_dir", "pipeline", "rank_timeout_s", "profile"}


def config_dict(config: EngineConfig) -> dict[str, Any]:
    return {k: v for k, v in asdict(config).items() if k not in _LOCAL_FIELDS}


def config_from(values: dict[str, Any], own: EngineConfig) -> EngineConfig:
    """Rank 0's settings, on this rank's own paths and group settings."""
    known = set(config_dict(own))
    return replace(own, **{k: v for k, v in values.items() if k in known})


Lockstep = Leader | Follower
