"""The live instance set of one endpoint: who serves it right now.

Fed by whoever knows (the embedded supervisor now; discovery watchers later); read by
routers. Waiting for a non-empty set is bounded: past the timeout a :class:`NoWorkers`
error (HTTP 503) is raised, never a hang.
"""

from __future__ import annotations

import asyncio

from kvmesh.errors import NoWorkers
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import RequestClient

__all__ = ["Instance", "InstanceSet"]


class Instance:
    """One worker instance and the request-plane client that reaches it."""

    __slots__ = ("info", "client")

    def __init__(self, info: InstanceInfo, client: RequestClient) -> None:
        self.info = info
        self.client = client

    @property
    def worker_id(self) -> int:
        return self.info.worker_id

    def __repr__(self) -> str:
        return f"Instance({self.info.worker_id}, {self.info.address})"


class InstanceSet:
    def __init__(self) -> None:
        self._by_id: dict[int, Instance] = {}
        self.ids: list[int] = []  # sorted; rebuilt on change, read on every routing decision
        self._nonempty = asyncio.Event()

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, worker_id: int) -> Instance | None:
        return self._by_id.get(worker_id)

    def all(self) -> list[Instance]:
        return [self._by_id[i] for i in self.ids]

    def add(self, instance: Instance) -> None:
        self._by_id[instance.worker_id] = instance
        self._changed()

    def remove(self, worker_id: int) -> Instance | None:
        instance = self._by_id.pop(worker_id, None)
        if instance is not None:
            self._changed()
        return instance

    def _changed(self) -> None:
        self.ids = sorted(self._by_id)
        if self._by_id:
            self._nonempty.set()
        else:
            self._nonempty.clear()

    async def wait_nonempty(self, timeout: float, what: str) -> None:
        if self._by_id:
            return
        try:
            await asyncio.wait_for(self._nonempty.wait(), timeout)
        except TimeoutError:
            raise NoWorkers(f"no worker serves {what} (waited {timeout:g} s); start a worker or retry later") from None
