"""KV cache event wire types: what an engine's block pool publishes and the router's
indexer applies (msgspec structs, tagged union). Re-exported by :mod:`kvmesh.protocol`.

On the event plane (topic ``kv_events``) an envelope's payload is one of:

* a :class:`KvEventBatch` (msgpack array): the consecutive events of one worker that
  one engine step (one loop tick) produced, ``events[i]`` being event
  ``first_event_id + i``. What workers send.
* a :class:`KvEvent` (msgpack map): one event; the older form, still accepted.

:func:`decode_kv_payload` tells them apart by the first byte and returns a batch
either way. Bounds:

* publisher: a batch holds at most :data:`MAX_BATCH_EVENTS` events and
  :data:`MAX_BATCH_BLOCKS` block hashes in all (it starts a new batch before it would
  pass either; one event alone may hold up to :data:`MAX_EVENT_BLOCKS`), so a payload
  stays under ~1.3 MiB even with 9-byte hashes and token hashes;
* receiver: a payload over :data:`MAX_PAYLOAD_BYTES` is refused without being decoded;
  the decoder refuses a batch of more than :data:`MAX_BATCH_EVENTS` events, or an event
  list of more than :data:`MAX_EVENT_BLOCKS` hashes, from the list's header, before
  allocating it, and checks every hash is an int ``>= 0`` (msgpack has none over u64).
  So a hostile payload costs at most ~10× its bytes, and a decoded one needs no
  further check.

Tiers: ``BlockStored`` and ``BlockRemoved`` carry ``tier`` (:data:`G1` device,
:data:`G2` host memory, :data:`G3` disk; a value outside 1..3 does not decode), G1 by
default and then not encoded: events without the field decode as G1, and G1 events are
byte-for-byte what they were before tiers. A block is in one tier at a time; a move is
a removal from one tier and a store into the other, in that order, in one batch.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from kvmesh.kv.tiers import G1, G2, G3, TIERS

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvDump",
    "KvEvent",
    "KvEventBatch",
    "KvEventBatchView",
    "KvEventData",
    "KvEventView",
    "KvEventsSince",
    "MAX_BATCH_BLOCKS",
    "MAX_BATCH_EVENTS",
    "MAX_EVENT_BLOCKS",
    "MAX_PAYLOAD_BYTES",
    "G1",
    "G2",
    "G3",
    "TIERS",
    "Tier",
    "PayloadTooLarge",
    "StoredHashes",
    "decode_kv_payload",
    "decode_kv_view",
]

# Hashes in one event at most (an engine stores or frees one request's blocks at a time).
MAX_EVENT_BLOCKS = 1 << 16
# Events in one batch at most, and block hashes in all its events at most.
MAX_BATCH_EVENTS = 1024
MAX_BATCH_BLOCKS = 1 << 16
# A kv_events payload's bytes at most: a full batch with token hashes is ~1.3 MiB.
MAX_PAYLOAD_BYTES = 2 * 1024 * 1024

Hash = Annotated[int, msgspec.Meta(ge=0)]
Hashes = Annotated[list[Hash], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]

# KV tiers (kv/tiers.py): G1 the device pool, G2 host memory, G3 local disk. A
# stored/removed event names the tier its blocks entered/left; G1, the default, is left
# off the wire, so an engine without tiers sends the bytes it always sent.
Tier = Annotated[int, msgspec.Meta(ge=G1, le=G3)]


# The event payloads are untracked by the cyclic GC (gc=False: they hold only ints and
# lists of ints, so they cannot be part of a cycle): a router decodes ~100 per envelope,
# and tracked ones would set off a young-generation collection every few envelopes.


class _StoredBlocks(msgspec.Struct, tag="stored", omit_defaults=True, gc=False):
    block_hashes: Hashes


class StoredHashes(_StoredBlocks, tag="stored", omit_defaults=True, kw_only=True):
    """What the router reads of a :class:`BlockStored` (which is one): the chained
    hashes and the tier they entered. Decoded from a ``BlockStored`` on the wire by
    :func:`decode_kv_view`, which skips the other fields instead of building them."""

    tier: Tier = G1


class BlockStored(StoredHashes, tag="stored", omit_defaults=True):
    """Full blocks became cached. ``block_hashes`` are chained sequence hashes
    (see :mod:`kvmesh.kv.hashing`), ``token_hashes`` the matching local hashes;
    ``parent_hash`` is the sequence hash of the block before the first one."""

    token_hashes: Hashes = []
    parent_hash: int | None = None


class _RemovedBlocks(msgspec.Struct, tag="removed", omit_defaults=True, gc=False):
    block_hashes: Hashes


class BlockRemoved(_RemovedBlocks, tag="removed", omit_defaults=True, kw_only=True):
    """Blocks left ``tier`` (evicted from it, or moved to another tier: a move is a
    ``BlockRemoved`` from one tier followed by a ``BlockStored`` into the other)."""

    tier: Tier = G1


class AllBlocksCleared(msgspec.Struct, tag="cleared", gc=False):
    pass


KvEventData = Union[BlockStored, BlockRemoved, AllBlocksCleared]
# what the router applies: an event as :func:`decode_kv_view` gives it (a KvEventData is one)
KvEventView = Union[StoredHashes, BlockRemoved, AllBlocksCleared]


class KvEvent(msgspec.Struct):
    """One KV cache event; ``event_id`` increases by one per event per worker."""

    worker_id: int
    event_id: int
    data: KvEventData


class KvEventBatch(msgspec.Struct, array_like=True):
    """Consecutive KV events of one worker: ``events[i]`` is its event
    ``first_event_id + i`` (bounds: the module docstring)."""

    worker_id: int
    first_event_id: Annotated[int, msgspec.Meta(ge=0)]
    events: Annotated[list[KvEventData], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]


class KvEventBatchView(msgspec.Struct, array_like=True):
    """A :class:`KvEventBatch` as the router reads it (:func:`decode_kv_view`)."""

    worker_id: int
    first_event_id: Annotated[int, msgspec.Meta(ge=0)]
    events: Annotated[list[KvEventView], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]


class PayloadTooLarge(ValueError):
    """A payload refused for its size alone (not decoded)."""


_decode_batch = msgspec.msgpack.Decoder(KvEventBatch).decode
_decode_view = msgspec.msgpack.Decoder(KvEventBatchView).decode
_decode_event = msgspec.msgpack.Decoder(KvEvent).decode


def _is_single(payload: bytes) -> bool:
    """Whether ``payload`` (under the size bound) is one :class:`KvEvent`: a msgpack map."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(f"KV event payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    first = payload[0] if payload else 0
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def decode_kv_payload(payload: bytes) -> KvEventBatch:
    """A ``kv_events`` payload as a batch (a single event: a batch of one). Raises
    ``ValueError`` for anything else: :class:`PayloadTooLarge` over
    :data:`MAX_PAYLOAD_BYTES`, ``msgspec.DecodeError``/``ValidationError`` (both
    ``ValueError``) for what does not decode or breaks a bound."""
    if _is_single(payload):  # the older form
        event = _decode_event(payload)
        return KvEventBatch(event.worker_id, event.event_id, [event.data])
    return _decode_batch(payload)


def decode_kv_view(payload: bytes) -> KvEventBatchView:
    """:func:`decode_kv_payload` for the router: a batch's stored events come as
    :class:`StoredHashes` (their token hashes and parent hash skipped, not built, nor
    checked: the router does not use them); the same bounds and errors otherwise."""
    if _is_single(payload):
        event = _decode_event(payload)
        return KvEventBatchView(event.worker_id, event.event_id, [event.data])
    return _decode_view(payload)


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
