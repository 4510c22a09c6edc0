"""The event plane: typed publish/subscribe of KV events, load reports and health state.

The contract is in :mod:`kvmesh.runtime.event_plane.base`; backends: ``memory``
(one process), ``zmq`` (PUB/SUB sockets, the default between processes) and ``nats``
(subjects ``{namespace}.events.{topic}``). :func:`make_event_plane` builds one by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmesh.runtime.event_plane.base import Envelope, EventPlane, GapTracker, Publisher, Subscription
from kvmesh.runtime.event_plane.memory import Inbox, MemoryEventPlane, MemoryHub

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from kvmesh.runtime.event_plane.nats import NatsEventPlane
    from kvmesh.runtime.event_plane.zmq import ZmqEventPlane

__all__ = [
    "Envelope",
    "Publisher",
    "Subscription",
    "EventPlane",
    "GapTracker",
    "Inbox",
    "MemoryHub",
    "MemoryEventPlane",
    "ZmqEventPlane",
    "NatsEventPlane",
    "KINDS",
    "make_event_plane",
]

KINDS = ("memory", "zmq", "nats")

# the backends' client libraries load on first use: a process that never uses NATS
# does not pay nats-py's import (~90 ms) at start-up
_LAZY = {"NatsEventPlane": "kvmesh.runtime.event_plane.nats", "ZmqEventPlane": "kvmesh.runtime.event_plane.zmq"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def make_event_plane(
    kind: str,
    *,
    nats_client: NatsClient | None = None,
    namespace: str = "kvmesh",
    host: str = "127.0.0.1",
    hub: MemoryHub | None = None,
) -> EventPlane:
    """Build the event plane named ``kind`` (one of :data:`KINDS`).

    ``nats`` needs a connected ``nats_client`` (see ``kvmesh.runtime.nats.connect_nats``)
    and uses ``namespace``; ``zmq`` binds its publishers on ``host``; ``memory`` joins
    ``hub`` when given. ValueError for an unknown kind or a missing/misplaced argument.
    """
    if kind == "memory":
        return MemoryEventPlane(hub)
    if hub is not None:
        raise ValueError(f"hub is for the memory event plane, not {kind!r}")
    if kind == "zmq":
        from kvmesh.runtime.event_plane.zmq import ZmqEventPlane

        return ZmqEventPlane(host)
    if kind == "nats":
        if nats_client is None:
            raise ValueError("the nats event plane needs nats_client (a connected nats.aio.client.Client)")
        from kvmesh.runtime.event_plane.nats import NatsEventPlane

        return NatsEventPlane(nats_client, namespace)
    raise ValueError(f"unknown event plane {kind!r}; choose one of {', '.join(KINDS)}")
