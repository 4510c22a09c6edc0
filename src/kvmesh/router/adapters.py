"""Which worker holds which LoRA adapter, as one model's router sees it. Pure: no I/O,
no clock.

A worker keeps at most ``max_adapters`` adapters resident and unloads the least
recently used one to load another (the engine side, :class:`~kvmesh.engines.base.LoraAdapters`).
The router follows the same rule on its own decisions, so it knows where an adapter is
without asking: a request routed to a worker with an adapter makes it that worker's
most recent one (loaded there if it was not). A worker's own answer (``lora`` endpoint:
list, load, unload; or ``LoadReport.adapters``) replaces the router's guess for it.

A worker can load only an adapter whose folder it knows (started with it, or loaded it
once: an unloaded-by-LRU adapter stays known; an admin unload forgets it): ``knows``
are the workers a request for the adapter may go to at all.

Lifecycle (one caller at a time)::

    a.add_worker(w, max_adapters)       a worker joins (0: it cannot load adapters)
    a.observe(w, adapters)              its own list (least recently used first)
    a.holders(name)                     workers holding ``name`` now
    a.knows(name)                       workers that can load it (hold it, or did)
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
        self._known: dict[int, set[str]] = {}  # worker → adapters whose folder it knows (held or not)
        self._capacity: dict[int, int] = {}

    def add_worker(self, worker_id: int, max_adapters: int) -> None:
        self._capacity[worker_id] = max(0, max_adapters)
        self._held.setdefault(worker_id, {})
        self._known.setdefault(worker_id, set())

    def remove_worker(self, worker_id: int) -> None:
        self._held.pop(worker_id, None)
        self._known.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def capable(self, worker_id: int) -> bool:
        """The worker can hold an adapter at all (``max_adapters`` > 0)."""
        return self._capacity.get(worker_id, 0) > 0

    def observe(self, worker_id: int, adapters: Iterable[str], known: Iterable[str] = ()) -> None:
        """The worker's own list replaces the guess (the last ``max_adapters`` kept);
        ``known``: every adapter it can load (its own list, which replaces the guess, when
        it sends one; an engine that sends none keeps what the router learnt)."""
        if worker_id not in self._held:
            return
        names = list(dict.fromkeys(adapters))
        cap = self._capacity[worker_id]
        self._held[worker_id] = dict.fromkeys(names[-cap:] if cap else [])
        told = set(known)
        if told:
            self._known[worker_id] = told | set(self._held[worker_id])
        else:
            self._known[worker_id].update(self._held[worker_id])

    def forget(self, name: str, worker_id: int | None = None) -> None:
        """``name`` was unloaded (the admin route) from ``worker_id``, or everywhere:
        the worker forgot its folder too."""
        for w in (self._held if worker_id is None else (worker_id,)):
            self._held.get(w, {}).pop(name, None)
            self._known.get(w, set()).discard(name)

    def holders(self, name: str) -> set[int]:
        return {w for w, held in self._held.items() if name in held}

    def knows(self, name: str) -> set[int]:
        return {w for w, known in self._known.items() if name in known}

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
        self._known[worker_id].add(name)
        while len(held) > cap:
            del held[next(iter(held))]
