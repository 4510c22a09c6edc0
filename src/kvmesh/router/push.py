"""Push routing: pick one instance of an endpoint for a request.

Selection policies are pure (ids in, id out); :class:`PushRouter` is the glue that
waits for instances and hands back the chosen :class:`~kvmesh.runtime.instances.Instance`.
Modes: ``round_robin`` and ``random``; ``direct`` happens when a request names a
worker id in its routing hints. The KV-aware modes plug in as another policy
(:class:`kvmesh.router.service.KvPolicy`) that also admits requests (they may wait in
a queue), hears of each request's first token and end, and explains its decisions.
Every hook is part of :class:`Policy`; :class:`Stateless` gives the no-op ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvmesh.errors import NoWorkers
from kvmesh.protocol import PreprocessedRequest
from kvmesh.router.core import Decision
from kvmesh.runtime.instances import Instance, InstanceSet

__all__ = ["Policy", "Stateless", "RoundRobin", "Random", "make_policy", "PushRouter"]


class Policy(Protocol):
    """How a :class:`PushRouter` picks a worker, and what it tells the policy."""

    def select(self, ids: Sequence[int], request: PreprocessedRequest, weights: Mapping[int, float] | None = None) -> int:
        """One of ``ids``. ``weights`` (health, in (0, 1]; None: all 1) scale each
        worker's share of the traffic."""
        ...

    async def admit(self, request: PreprocessedRequest) -> None:
        """Return when ``request`` may be routed (a policy may queue it)."""
        ...

    def first_token(self, request_id: str) -> None:
        """The request's first token arrived (its prefill is done)."""
        ...

    def finished(self, request_id: str) -> None:
        """The request ended, however it ended."""
        ...

    def explain(self, request_id: str) -> Decision | None:
        """Why the request went where it went, once, if it asked (``routing.explain``)
        and the policy keeps reasons; else None."""
        ...


class Stateless:
    """The hooks of a policy that keeps no per-request state: admits at once, keeps
    no reasons."""

    async def admit(self, request: PreprocessedRequest) -> None:
        return None

    def first_token(self, request_id: str) -> None:
        return None

    def finished(self, request_id: str) -> None:
        return None

    def explain(self, request_id: str) -> Decision | None:
        return None


class RoundRobin(Stateless):
    """In turn; a worker of weight w < 1 takes its turn with probability w."""

    def __init__(self, seed: int | None = None) -> None:
        self._next = 0
        self._rng = random.Random(seed)

    def select(self, ids: Sequence[int], request: PreprocessedRequest, weights: Mapping[int, float] | None = None) -> int:
        for _ in range(len(ids)):
            worker = ids[self._next % len(ids)]
            self._next += 1
            if weights is None or self._rng.random() < weights.get(worker, 1.0):
                return worker
        return worker


class Random(Stateless):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, ids: Sequence[int], request: PreprocessedRequest, weights: Mapping[int, float] | None = None) -> int:
        if weights is None:
            return ids[self._rng.randrange(len(ids))]
        return self._rng.choices(ids, [weights.get(w, 1.0) for w in ids])[0]


def make_policy(mode: str) -> Policy:
    if mode == "round_robin":
        return RoundRobin()
    if mode == "random":
        return Random()
    raise ValueError(f"unknown router mode {mode!r}")


class PushRouter:
    def __init__(self, instances: InstanceSet, policy: Policy, wait_s: float, what: str) -> None:
        self.instances = instances
        self.policy = policy
        self.wait_s = wait_s
        self.what = what
        # health weights of a list of worker ids (None: all 1); set by the health monitor
        self.weights: Callable[[Sequence[int]], Mapping[int, float] | None] | None = None

    async def pick(self, request: PreprocessedRequest, exclude: frozenset[int] = frozenset()) -> Instance:
        if not self.instances.ids:
            await self.instances.wait_nonempty(self.wait_s, self.what)
        if not exclude:  # a retry elsewhere was admitted already
            await self.policy.admit(request)
        hints = request.routing
        if hints is not None and hints.worker_id is not None:  # direct: that worker or none (a retry too)
            instance = self.instances.get(hints.worker_id) if hints.worker_id not in exclude else None
            if instance is None:
                raise NoWorkers(f"worker {hints.worker_id:x} (pinned) does not serve {self.what}")
            return instance
        ids = self.instances.ids
        if exclude:
            ids = [i for i in ids if i not in exclude]
            if not ids:
                raise NoWorkers(f"no other worker serves {self.what}")
        weights = self.weights(ids) if self.weights is not None else None
        if weights is not None:
            # weight 0 (unhealthy, open circuit) never gets traffic, unless all are 0:
            # an all-unhealthy fleet still serves
            live = [i for i in ids if weights[i] > 0]
            ids = live or ids
        instance = self.instances.get(self.policy.select(ids, request, weights))
        assert instance is not None
        return instance

    def first_token(self, request_id: str) -> None:
        """The request's first token arrived (its prefill is done)."""
        self.policy.first_token(request_id)

    def finished(self, request_id: str) -> None:
        """The request ended, however it ended."""
        self.policy.finished(request_id)
