"""LoRA adapters of a step-loop engine (mocker, hf): the :class:`~kvmesh.engines.base.LoraAdapters`
capability on top of :class:`~kvmesh.engines.lora.AdapterTable`.

Lifecycle: the engine builds one :class:`AdapterHost` with its :class:`AdapterLoader`
(what a load and an unload do to the engine: the mocker sleeps its modelled load time,
the hf engine reads and installs the weights), then

1. ``await host.open()`` at start: the ``--lora`` adapters load, up to the capacity;
2. ``await host.prepare(request)`` before a request naming an adapter is admitted (the
   step loop's ``generate``): a resident adapter is touched (LRU), a known one loads
   (evicting the least recently used adapter no live sequence uses), an unknown one is
   :class:`~kvmesh.errors.ModelNotFound`; the caller admits the request in the same
   synchronous run of the event loop, so its adapter is in use before anything can evict it;
3. ``load`` / ``unload`` / ``state``: the worker's ``lora`` endpoint.

Loads are serialised by one lock (a slot is chosen and filled by one load at a time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from kvmesh.engines.lora import AdapterFiles, AdapterTable, check_name, read_adapter
from kvmesh.errors import InvalidArgument
from kvmesh.protocol import LoraState, PreprocessedRequest

__all__ = ["AdapterLoader", "AdapterHost"]


class AdapterLoader(Protocol):
    """What loading into and clearing a slot means to one engine (event loop; may await threads)."""

    def check(self, files: AdapterFiles) -> None:
        """InvalidArgument when ``files`` does not fit the engine's model."""
        ...

    async def read(self, files: AdapterFiles) -> object:
        """Read (and check) the adapter's weights, touching no slot: a load that fails
        here evicts nothing. Returns what :meth:`install` takes."""
        ...

    async def install(self, slot: int, files: AdapterFiles, weights: object) -> None:
        """Make ``slot`` hold the adapter of ``files`` (replacing whatever it held)."""
        ...

    def clear(self, slot: int) -> None:
        """``slot`` holds nothing any more."""
        ...


class AdapterHost:
    """One engine's adapters (see the module docstring). ``in_use``: the adapters live
    sequences of the engine name now; ``changed``: called after every load and unload
    (the engine publishes its load report, which lists the resident adapters)."""

    def __init__(
        self,
        capacity: int,
        known: dict[str, str],
        loader: AdapterLoader,
        in_use: Callable[[], set[str]],
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.table = AdapterTable(capacity, known)
        self._loader, self._in_use, self._changed = loader, in_use, changed
        self._lock = asyncio.Lock()
        self.loads = 0  # adapters loaded since start, and the milliseconds they took
        self.load_ms = 0.0

    async def open(self) -> None:
        """Load the adapters the engine was started with (``--lora``), up to the capacity
        (on a restart: the adapters it knew, the slots being new)."""
        self.table.clear_resident()
        for name in list(self.table.known)[: self.table.capacity]:
            await self.load(name, None)

    def state(self) -> LoraState:
        return self.table.state()

    def slot(self, name: str) -> int:
        """The slot of resident ``name`` (after :meth:`prepare`)."""
        slot = self.table.slot(name)
        if slot is None:
            raise InvalidArgument(f"LoRA adapter {name!r} is not resident")
        return slot

    async def prepare(self, request: PreprocessedRequest) -> None:
        name = request.adapter
        if name is not None and self.table.slot(name) is None:
            await self.load(name, None)

    async def load(self, name: str, path: str | None) -> LoraState:
        check_name(name)
        async with self._lock:
            same = path is None or path == self.table.known.get(name)
            if same and self.table.slot(name) is not None:
                return self.table.state()  # resident already: nothing to do
            if name in self._in_use() and self.table.slot(name) is not None:
                raise InvalidArgument(f"LoRA adapter {name!r} is in use by running requests; cannot reload it now")
            where = path if path is not None else self.table.path_of(name)
            t0 = time.perf_counter()
            files = await asyncio.to_thread(read_adapter, where)
            self._loader.check(files)
            weights = await self._loader.read(files)
            slot, _evicted = self.table.place(name, self._in_use())
            try:
                await self._loader.install(slot, files, weights)
            except BaseException:
                self._loader.clear(slot)  # the slot is free again (place took it out)
                raise
            self.table.put(name, slot, where)
            ms = (time.perf_counter() - t0) * 1000.0
        self.loads += 1
        self.load_ms += ms
        self._changed()
        return self.table.state(ms)

    def unload(self, name: str) -> LoraState:
        slot = self.table.remove(name, self._in_use())
        if slot:
            self._loader.clear(slot)
        self._changed()
        return self.table.state()
