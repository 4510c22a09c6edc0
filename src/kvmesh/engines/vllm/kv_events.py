"""Convert vLLM's native KV events (its ZMQ publisher's msgpack) into kvmesh events.

vLLM publishes each batch as a ZMQ multipart ``(topic, seq as 8-byte big-endian,
payload)``; this module handles ``payload``. Its shape, as written by vLLM's
``msgspec`` structs in ``vllm/distributed/kv_events.py``:

* the batch: ``[ts, [event, ...], dp_rank]`` (``dp_rank`` may be absent), or the
  same fields as a map ``{"ts", "events", "data_parallel_rank"}``;
* each event: a tagged array ``["BlockStored", field, ...]`` (vLLM up to the
  array-to-map switch), or a map ``{"type": "BlockStored", field: ...}`` (later
  versions). Fields, in array order (later versions append at the end, and a
  trailing field left at its default may be omitted):

  - ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, lora_name, extra_keys, group_idx, ...``
  - ``BlockRemoved``: ``block_hashes, medium, group_idx, ...``
  - ``AllBlocksCleared``: no fields.

  Unknown trailing fields and unknown event types are ignored.

vLLM's block hashes are its own (sha256 or builtin hash over its own chaining; ints
or bytes), not ours. So a stored block's kvmesh hash is recomputed from the event's
``token_ids`` (the tokens of exactly the stored blocks) chained after the kvmesh
hash of ``parent_block_hash``; the converter keeps, per vLLM publisher, a map from
vLLM hash to kvmesh hash to translate the parent of later stores and the hashes of
``BlockRemoved``. Use one converter per publisher (per worker and DP rank).

Limits, all of which make the converter leave blocks out rather than index them
wrongly (a left-out block only costs a missed cache hit):

* a store whose parent the converter never saw (it subscribed mid-stream or lost a
  batch) cannot be chained, so it and every block chained after it are left out
  until the parent is stored again; a lost batch should be repaired with a fresh
  start (``AllBlocksCleared``) or a restart of the converter and the worker's index;
* blocks whose vLLM hash has extra keys (LoRA adapter, multimodal inputs, cache
  salt: ``lora_id``/``lora_name``/``extra_keys``) are keyed differently by vLLM than
  by their tokens alone; kvmesh hashes only tokens, so they (and their descendants)
  are left out. Older vLLM versions that do not send ``extra_keys`` cannot signal
  multimodal blocks, and those would be indexed by their placeholder tokens;
* only GPU blocks (``medium`` absent or ``"GPU"``) of one KV cache group
  (``group_idx`` absent or equal to the converter's ``group_idx``) are indexed;
* events whose ``block_size`` differs from the converter's are left out;
* vLLM may cache the same content twice (two requests computing it at once) and then
  stores and removes that hash twice; a count per hash makes the kvmesh removal
  happen only when the last copy goes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import msgspec

from kvmesh.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KvEventData
from kvmesh.kv.hashing import chain_hashes, local_block_hashes

__all__ = ["VllmEventConverter", "decode_batch"]

_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_GPU = "GPU"
_decoder = msgspec.msgpack.Decoder()


def _named(event: Any) -> tuple[str, dict[str, Any]] | None:
    """``(type, fields by name)`` of one decoded event, array or map form; None if unknown."""
    if isinstance(event, Mapping):
        kind = event.get("type")
        return (kind, dict(event)) if isinstance(kind, str) and kind in _FIELDS else None
    if isinstance(event, list) and event and isinstance(event[0], str) and event[0] in _FIELDS:
        kind = event[0]
        return kind, dict(zip(_FIELDS[kind], event[1:]))
    return None


def decode_batch(payload: bytes) -> tuple[float, list[tuple[str, dict[str, Any]]], int | None]:
    """``(ts, [(event type, fields)], dp_rank)`` of one payload; unknown events dropped."""
    batch = _decoder.decode(payload)
    if isinstance(batch, Mapping):
        ts, events, dp_rank = (batch.get(k) for k in _BATCH_FIELDS)
    elif isinstance(batch, Sequence) and len(batch) >= 2:
        ts, events, dp_rank = (list(batch) + [None])[:3]
    else:
        raise ValueError(f"not a vLLM KV event batch: {type(batch).__name__}")
    if not isinstance(events, list):
        raise ValueError("vLLM KV event batch without an event list")
    named = [n for n in map(_named, events) if n is not None]
    return float(ts or 0.0), named, dp_rank


class VllmEventConverter:
    """Turns one vLLM publisher's payloads into :data:`KvEventData` (module docstring)."""

    def __init__(self, block_size: int, *, group_idx: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.group_idx = group_idx
        self._ours: dict[Hashable, int] = {}  # vLLM hash -> kvmesh sequence hash
        self._copies: dict[Hashable, int] = {}  # vLLM hash -> extra copies (> 0 only)
        self.skipped_blocks = 0  # stored blocks left out (see the limits above)
        self.last_ts: float | None = None
        self.last_dp_rank: int | None = None

    @property
    def tracked_blocks(self) -> int:
        """vLLM hashes currently translated (held by the worker, as far as we know)."""
        return len(self._ours)

    def convert(self, payload: bytes) -> list[KvEventData]:
        """kvmesh events for one msgpack payload, in order (maybe fewer or none)."""
        self.last_ts, events, self.last_dp_rank = decode_batch(payload)
        out: list[KvEventData] = []
        for kind, fields in events:
            data = self._convert_one(kind, fields)
            if data is not None:
                out.append(data)
        return out

    def _convert_one(self, kind: str, fields: dict[str, Any]) -> KvEventData | None:
        if kind == "AllBlocksCleared":
            self._ours.clear()
            self._copies.clear()
            return AllBlocksCleared()
        if not self._in_scope(fields):
            if kind == "BlockStored":
                self.skipped_blocks += len(fields.get("block_hashes") or ())
            return None
        if kind == "BlockStored":
            return self._stored(fields)
        return self._removed(fields.get("block_hashes") or ())

    def _in_scope(self, fields: dict[str, Any]) -> bool:
        medium = fields.get("medium")
        group = fields.get("group_idx")
        return (medium is None or medium == _GPU) and (group is None or group == self.group_idx)

    def _stored(self, fields: dict[str, Any]) -> BlockStored | None:
        vhashes = list(fields.get("block_hashes") or ())
        n = self._chainable(fields, vhashes)
        self.skipped_blocks += len(vhashes) - n
        if n == 0:
            return None
        vparent = fields.get("parent_block_hash")
        parent = None if vparent is None else self._ours[vparent]
        bs = self.block_size
        local = local_block_hashes(fields["token_ids"][: n * bs], bs)
        ours = chain_hashes(local, parent)
        for vh, h in zip(vhashes[:n], ours):
            if vh in self._ours:
                self._copies[vh] = self._copies.get(vh, 0) + 1
            else:
                self._ours[vh] = h
        return BlockStored(block_hashes=ours, token_hashes=local, parent_hash=parent)

    def _chainable(self, fields: dict[str, Any], vhashes: list[Any]) -> int:
        """How many leading blocks of a store can be given a kvmesh hash."""
        if fields.get("block_size") != self.block_size:
            return 0
        if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
            return 0
        vparent = fields.get("parent_block_hash")
        if vparent is not None and vparent not in self._ours:
            return 0
        n = min(len(vhashes), len(fields.get("token_ids") or ()) // self.block_size)
        extra = fields.get("extra_keys")
        if extra:
            # A block with extra keys breaks the chain: it and all after it are out.
            n = next((i for i, keys in enumerate(extra[:n]) if keys is not None), n)
        return n

    def _removed(self, vhashes: Sequence[Any]) -> BlockRemoved | None:
        gone = []
        for vh in vhashes:
            copies = self._copies.get(vh)
            if copies:
                if copies == 1:
                    del self._copies[vh]
                else:
                    self._copies[vh] = copies - 1
                continue
            h = self._ours.pop(vh, None)
            if h is not None:
                gone.append(h)
        return BlockRemoved(block_hashes=gone) if gone else None
