"""The ``hf`` engine's KV tiers: the real K/V of blocks evicted from the device pool.

The batching core decides which block is where (:mod:`kvmesh.engines.batching.tiers`,
:class:`~kvmesh.engines.batching.block_manager.BlockManager`); :class:`HfTiers` is its
:class:`~kvmesh.engines.batching.block_manager.TierSlots` and keeps the tensors in step:

* **G2** (``--hf-host-kv-blocks``): one host tensor of slots, pinned when the pool is on
  a GPU (on the CPU it is a second, separate CPU tensor: same memory, same mechanics).
* **G3** (``--hf-disk-kv-blocks``, ``--hf-disk-kv-path``): a memory-mapped file of slots,
  created under the given folder with its blocks allocated at once (a disk without room
  fails at start, not with a SIGBUS on a later write) and unlinked once mapped, so its
  size is bounded and nothing is left behind by a crash.

A slot holds one block as ``(layers, 2, block_size, kv_heads, head_dim)``
(:meth:`~.kv.KvPool.block_view`'s shape), contiguous. The moves, each told as it happens
(all before the next forward pass; the step loop schedules between passes):

* **write-down** (:meth:`HfTiers.moved`): the block manager evicted G1 blocks and demoted
  their hashes; applied bottom-up (G3 drops freed, G3 filled from G2 or G1, G2 freed,
  G2 filled from G1), so no tier ever holds more than its capacity. The G1 block still
  holds the content: it is reused only by later moves and the next pass.
* **onboarding**: :meth:`HfTiers.taken` copies the blocks out of their tier slots into a
  staging tensor on the pool's device and frees the slots (the same allocation's
  write-down may reuse them), then :meth:`HfTiers.onboarded` copies them into their
  fresh G1 blocks.

On a GPU every copy runs on one side stream, after the work queued so far on the
device's current stream (the last pass wrote what is evicted); the next pass waits for
it (:meth:`HfTiers.before_forward`), so the copies overlap the loop's scheduling, not the
forward. A G2→G3 copy is a host memcpy: it first waits for the side stream.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from kvmesh.engines.batching.tiers import G2, G3, Move
from kvmesh.engines.hf.kv import KvPool
from kvmesh.errors import InvalidArgument, ResourceExhausted

__all__ = ["HfTiers", "TierStore", "disk_slots"]


class TierStore:
    """One lower tier's slots: ``data[slot]`` is one block; ``where`` maps a hash to its slot."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.where: dict[int, int] = {}
        self._free = list(range(data.shape[0] - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return int(self.data.shape[0])

    def claim(self, h: int) -> int:
        if not self._free:
            raise RuntimeError(f"KV tier of {self.capacity} slots is full (out of step with the block manager)")
        slot = self.where[h] = self._free.pop()
        return slot

    def release(self, h: int) -> int:
        slot = self.where.pop(h)
        self._free.append(slot)
        return slot

    def clear(self) -> None:
        self.where.clear()
        self._free = list(range(self.capacity - 1, -1, -1))


def disk_slots(folder: str, slots: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``(slots, *block_shape)`` tensor memory-mapped from a new file under ``folder``
    (created if missing); the file is unlinked once mapped. InvalidArgument when the
    folder cannot hold it."""
    numel = slots
    for n in block_shape:
        numel *= n
    size = numel * torch.empty((), dtype=dtype).element_size()
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kvmesh-kv-", suffix=".g3", dir=folder)
        try:
            os.posix_fallocate(fd, 0, size)  # the blocks reserved now: a full disk fails here, not as SIGBUS later
            flat = torch.from_file(name, shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)
            os.unlink(name)
    except (OSError, RuntimeError) as exc:
        raise InvalidArgument(
            f"--hf-disk-kv-path {folder!r}: cannot create the {size >> 20} MiB disk KV tier file there ({exc}); "
            "name a writable folder with room"
        ) from None
    return flat.view(slots, *block_shape)


def _host_slots(
    slots: int, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool, block_bytes: int
) -> torch.Tensor:
    try:
        return torch.empty((slots, *shape), dtype=dtype, pin_memory=pinned)
    except RuntimeError as exc:  # torch's out-of-memory
        raise ResourceExhausted(
            f"--hf-host-kv-blocks {slots}: cannot allocate {(slots * block_bytes) >> 20} MiB of "
            f"{'pinned ' if pinned else ''}host memory for the host KV tier ({exc}); give fewer blocks"
        ) from None


class HfTiers:
    """G2/G3 tensors of one :class:`~.kv.KvPool` (see the module docstring)."""

    def __init__(self, pool: KvPool, host_blocks: int = 0, disk_blocks: int = 0, disk_path: str = "") -> None:
        self.pool = pool
        device = pool.data.device
        self._cuda = device.type == "cuda"
        shape = tuple(pool.block_view(0).shape)
        dtype = pool.data.dtype
        self.stores: dict[int, TierStore] = {}
        if host_blocks > 0:
            host = _host_slots(host_blocks, shape, dtype, pinned=self._cuda, block_bytes=pool.bytes_per_block)
            self.stores[G2] = TierStore(host)
        if disk_blocks > 0:
            if not disk_path:
                raise InvalidArgument("--hf-disk-kv-blocks needs --hf-disk-kv-path (a folder for the tier's file)")
            self.stores[G3] = TierStore(disk_slots(disk_path, disk_blocks, shape, dtype))
        self._staged: dict[int, torch.Tensor] = {}
        # (torch's stub of Stream is untyped)
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]  # stub
        self.copied = {"down": 0, "up": 0}  # blocks copied out of G1 / into G1

    # ------------------------------------------------------------------ TierSlots

    def moved(self, moves: list[Move], evicted: Mapping[int, int]) -> None:
        final: dict[int, int | None] = {}
        for tier, stored, hashes in moves:
            for h in hashes:
                final[h] = tier if stored else None
        with self._side():
            for t in (G3, G2):  # bottom-up: a tier frees before it fills
                store = self.stores.get(t)
                if store is None:
                    continue
                for h, f in final.items():
                    if f != t and h in store.where:
                        store.release(h)
                for h, f in final.items():
                    if f == t and h not in store.where:
                        self._fill(store, h, evicted)

    def taken(self, moves: list[Move]) -> None:
        with self._side():
            for tier, _stored, hashes in moves:
                store = self.stores[tier]
                for h in hashes:
                    src = store.data[store.release(h)]
                    self._staged[h] = src.to(self.pool.data.device, non_blocking=self._cuda, copy=True)

    def onboarded(self, placed: Mapping[int, int]) -> None:
        with self._side():
            for h, b in placed.items():
                self.pool.block_view(b).copy_(self._staged.pop(h), non_blocking=self._cuda)
                self.copied["up"] += 1

    def cleared(self) -> None:
        for store in self.stores.values():
            store.clear()
        self._staged.clear()

    # ------------------------------------------------------------------ copies

    def _fill(self, store: TierStore, h: int, evicted: Mapping[int, int]) -> None:
        upper = self.stores.get(G2)
        if upper is not None and upper is not store and h in upper.where:  # pushed down G2 -> G3
            if self._stream is not None:
                self._stream.synchronize()  # a host memcpy: the D2H into G2 must be done
            store.data[store.claim(h)].copy_(upper.data[upper.where[h]])
            return
        block = evicted[h]  # written down from G1
        store.data[store.claim(h)].copy_(self.pool.block_view(block), non_blocking=self._cuda and store is upper)
        self.copied["down"] += 1

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        """On a GPU: the side stream, after what the current stream has queued."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.pool.data.device))
        with torch.cuda.stream(self._stream):
            yield

    def before_forward(self) -> None:
        """The forward's stream waits for the copies queued so far (a GPU; else nothing)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.pool.data.device).wait_stream(self._stream)
