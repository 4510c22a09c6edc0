"""Which worker holds which LoRA adapter, as one model's router sees it. Pure: no I/O,
no clock.

A worker keeps at most ``max_adapters`` adapters resident and unloads the least
recently used one to load another (the engine side, :class:`~kvmesh.engines.base.LoraAdapters`).
The router follows the same rule on its own decisions, so it knows where an adapter is
without asking: a request routed to a worker with an adapter makes it that worker's
most recent one (loaded there if it was not). A worker's own answer (``lora`` endpoint:
list, load, unload; or ``LoadReport.adapters``) replaces the router's guess for it.

Lifecycle (one caller at a time)::

    a.add_worker(w, max_adapters)       a worker joins (0: it cannot load adapters)
    a.observe(w, adapters)              its own list (least recently used first)
    a.holders(name)                     workers holding ``name`` now
    a.routed(w, name)                   a request with ``name`` was sent to ``w``
    a.remove_worker(w)
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["AdapterAffinity"]


class AdapterAffinity:
    """Each worker's resident adapters in LRU order, bounded by its ``max_adapters``."""

    def __init__(self) -> None:
        self._held: dict[int, dict[str, None]] = {}  # worker → its adapters, least recently used first
        self._capacity: dict[int, int] = {}

    def add_worker(self, worker_id: int, max_adapters: int) -> None:
        self._capacity[worker_id] = max(0, max_adapters)
        self._held.setdefault(worker_id, {})

    def remove_worker(self, worker_id: int) -> None:
        self._held.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def capable(self, worker_id: int) -> bool:
        """The worker can hold an adapter at all (``max_adapters`` > 0)."""
        return self._capacity.get(worker_id, 0) > 0

    def observe(self, worker_id: int, adapters: Iterable[str]) -> None:
        """The worker's own list replaces the guess (the last ``max_adapters`` kept)."""
        if worker_id not in self._held:
            return
        names = list(dict.fromkeys(adapters))
        cap = self._capacity[worker_id]
        self._held[worker_id] = dict.fromkeys(names[-cap:] if cap else [])

    def forget(self, name: str) -> None:
        """``name`` was unloaded everywhere (the admin route)."""
        for held in self._held.values():
            held.pop(name, None)

    def holders(self, name: str) -> set[int]:
        return {w for w, held in self._held.items() if name in held}

    def held(self, worker_id: int) -> list[str]:
        return list(self._held.get(worker_id, ()))

    def routed(self, worker_id: int, name: str) -> None:
        """A request naming ``name`` went to ``worker_id``: it is that worker's most
        recently used adapter now, the least recently used one unloaded past capacity."""
        held = self._held.get(worker_id)
        cap = self._capacity.get(worker_id, 0)
        if held is None or cap == 0:
            return
        held.pop(name, None)
        held[name] = None
        while len(held) > cap:
            del held[next(iter(held))]
