"""Routing policies a replay compares, behind one small interface.

A replay (virtual or real clock) calls, for each request and in time order::

    i = policy.route(request, now_ms)          index of the worker it goes to
    policy.on_kv_event(event)                  every KV event of every worker, as it happens
    policy.on_first_token(request_id, now_ms)
    policy.on_finished(request_id, now_ms)

Workers are ``0 .. n-1`` (their index is their worker id). ``kv`` and ``kv-approx``
wrap :class:`~kvmesh.router.core.KvRouterCore` (its clock in seconds); ``kv-approx``
ignores KV events, learning from its own decisions.
"""

from __future__ import annotations

import random
from typing import Protocol

from kvmesh.protocol import KvEvent, PreprocessedRequest
from kvmesh.router.core import KvRouterCore, RouterSettings

__all__ = ["POLICIES", "KvPolicy", "RandomPolicy", "ReplayPolicy", "RoundRobinPolicy", "make_policy"]

POLICIES = ("round_robin", "random", "kv", "kv-approx")


class ReplayPolicy(Protocol):
    name: str

    def route(self, request: PreprocessedRequest, now_ms: float) -> int: ...

    def on_kv_event(self, event: KvEvent) -> None: ...

    def on_first_token(self, request_id: str, now_ms: float) -> None: ...

    def on_finished(self, request_id: str, now_ms: float) -> None: ...


class _Blind:
    """Base of the policies that ignore feedback."""

    name = ""

    def on_kv_event(self, event: KvEvent) -> None:
        pass

    def on_first_token(self, request_id: str, now_ms: float) -> None:
        pass

    def on_finished(self, request_id: str, now_ms: float) -> None:
        pass


class RoundRobinPolicy(_Blind):
    name = "round_robin"

    def __init__(self, workers: int) -> None:
        self._n = workers
        self._next = 0

    def route(self, request: PreprocessedRequest, now_ms: float) -> int:
        i = self._next
        self._next = (i + 1) % self._n
        return i


class RandomPolicy(_Blind):
    name = "random"

    def __init__(self, workers: int, seed: int | None) -> None:
        self._n = workers
        self._rng = random.Random(seed)

    def route(self, request: PreprocessedRequest, now_ms: float) -> int:
        return self._rng.randrange(self._n)


class KvPolicy:
    """``kv`` / ``kv-approx``: the router core over workers ``0 .. n-1``."""

    def __init__(self, workers: int, settings: RouterSettings) -> None:
        self.name = settings.mode
        self.core = KvRouterCore(settings)
        self._events = settings.mode == "kv"
        for w in range(workers):
            self.core.add_worker(w)

    def route(self, request: PreprocessedRequest, now_ms: float) -> int:
        return self.core.route(request.request_id, request.token_ids, now_ms / 1000.0).worker_id

    def on_kv_event(self, event: KvEvent) -> None:
        if self._events:
            # events come straight from the workers, in order: never a gap to repair
            self.core.apply_event(event)

    def on_first_token(self, request_id: str, now_ms: float) -> None:
        self.core.first_token(request_id, now_ms / 1000.0)

    def on_finished(self, request_id: str, now_ms: float) -> None:
        self.core.finished(request_id, now_ms / 1000.0)


def make_policy(
    name: str,
    workers: int,
    *,
    block_size: int,
    overlap_weight: float = 1.0,
    temperature: float = 0.0,
    seed: int | None = 0,
) -> ReplayPolicy:
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if name == "round_robin":
        return RoundRobinPolicy(workers)
    if name == "random":
        return RandomPolicy(workers, seed)
    if name in ("kv", "kv-approx"):
        settings = RouterSettings(
            block_size=block_size, mode=name, overlap_weight=overlap_weight, temperature=temperature, seed=seed
        )
        return KvPolicy(workers, settings)
    raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
