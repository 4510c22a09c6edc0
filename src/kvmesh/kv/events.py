"""KV cache event wire types: what an engine's block pool publishes and the router's
indexer applies (msgspec structs, tagged union). Re-exported by :mod:`kvmesh.protocol`."""

from __future__ import annotations

from typing import Union

import msgspec

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KvDump", "KvEvent", "KvEventData", "KvEventsSince"]


class BlockStored(msgspec.Struct, tag="stored", omit_defaults=True):
    """Full blocks became cached. ``block_hashes`` are chained sequence hashes
    (see :mod:`kvmesh.kv.hashing`), ``token_hashes`` the matching local hashes;
    ``parent_hash`` is the sequence hash of the block before the first one."""

    block_hashes: list[int]
    token_hashes: list[int] = []
    parent_hash: int | None = None


class BlockRemoved(msgspec.Struct, tag="removed"):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="cleared"):
    pass


KvEventData = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KvEvent(msgspec.Struct):
    """One KV cache event; ``event_id`` increases by one per event per worker."""

    worker_id: int
    event_id: int
    data: KvEventData


class KvDump(msgspec.Struct):
    """A worker's whole cached block set (sequence hashes), consistent with its event
    stream: ``last_event_id`` is the id of the last event already reflected in it
    (-1 when none was published yet)."""

    worker_id: int
    last_event_id: int
    block_hashes: list[int]


class KvEventsSince(msgspec.Struct):
    """Buffered events after an id; ``complete`` False when some already fell out."""

    events: list[KvEvent]
    complete: bool
