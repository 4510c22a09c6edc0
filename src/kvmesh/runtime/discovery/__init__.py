"""Discovery backends behind one interface (:mod:`.base`); pick one with
:func:`make_discovery`.

``EtcdDiscovery`` is imported on first use, so processes that never touch etcd do not
load gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.runtime.discovery.base import Discovery, Lease, WatchEvent
from kvmesh.runtime.discovery.file import FileDiscovery
from kvmesh.runtime.discovery.memory import MemoryDiscovery, MemoryStore

if TYPE_CHECKING:
    from kvmesh.runtime.discovery.etcd import EtcdDiscovery

__all__ = [
    "Discovery",
    "Lease",
    "WatchEvent",
    "MemoryDiscovery",
    "MemoryStore",
    "FileDiscovery",
    "EtcdDiscovery",
    "KINDS",
    "make_discovery",
]

KINDS = ("memory", "file", "etcd")


def make_discovery(
    kind: str,
    *,
    etcd_endpoints: list[str] | None = None,
    file_dir: str | None = None,
    store: MemoryStore | None = None,
    etcd_credentials: Any = None,
) -> Discovery:
    """A new, unconnected backend of ``kind``; raises ``ValueError`` for an unknown
    kind or when the option that kind needs is missing."""
    if kind == "memory":
        return MemoryDiscovery(store)
    if kind == "file":
        if not file_dir:
            raise ValueError("file discovery needs file_dir (a directory shared by the processes)")
        return FileDiscovery(file_dir)
    if kind == "etcd":
        if not etcd_endpoints:
            raise ValueError("etcd discovery needs etcd_endpoints, e.g. ['http://127.0.0.1:2379']")
        from kvmesh.runtime.discovery.etcd import EtcdDiscovery

        return EtcdDiscovery(list(etcd_endpoints), credentials=etcd_credentials)
    raise ValueError(f"unknown discovery kind {kind!r}; expected one of {', '.join(KINDS)}")


def __getattr__(name: str) -> Any:
    if name == "EtcdDiscovery":
        from kvmesh.runtime.discovery.etcd import EtcdDiscovery

        return EtcdDiscovery
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
