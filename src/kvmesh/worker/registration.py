"""How one worker instance becomes routable, and where it runs: the one seam both
modes boot through (:func:`kvmesh.worker.main.serve_one`).

A :class:`Seat` is where an instance lives: its id, its request server, how it
describes itself and through which :class:`Registration` it joins routing.

* :class:`StaticSeat` (``kvmesh run``'s workers, ``kvmesh worker --static``): the id is
  the config's, a TCP server on ``--host``/``--port``; the registration is the READY
  line on stdout (:class:`ParentRegistration`): whoever started the worker registers it
  (``kvmesh run``'s supervisor puts the same signed record in its in-process discovery,
  :mod:`kvmesh.assembly.embedded`; ``--static``: the frontend is given the address).
* :class:`DiscoverySeat` (``kvmesh worker``): the id is the runtime's lease, the runtime's
  request server (TCP or NATS); the instance puts its own record in discovery (memory,
  file or etcd) bound to its lease (:class:`DiscoveryRegistration`); with ``--standby``
  it first offers itself to the planner and registers when ordered to
  (:class:`StandbyRegistration`).

The READY line (:data:`READY_PREFIX` + the instance's card) is written once per
instance in every mode (:class:`ReadyLine`): for a static worker it is the registration,
for the others the sign that it is up (a standby's at its offer).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Protocol, TextIO

import msgspec

from kvmesh.config import WorkerConfig
from kvmesh.errors import KvmeshError
from kvmesh.planner.orders import StandbyLink
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime.distributed import DistributedRuntime, Endpoint
from kvmesh.runtime.event_plane import make_event_plane
from kvmesh.runtime.event_plane.base import EventPlane
from kvmesh.runtime.events import BatchingPublisher, EventPublisher, NullPublisher
from kvmesh.runtime.names import GENERATE, KV_EVENTS_TOPIC, LOAD_TOPIC
from kvmesh.runtime.stream import RequestServer
from kvmesh.runtime.tcp_server import TcpServer

__all__ = [
    "READY_PREFIX",
    "ReadyLine",
    "Registration",
    "ParentRegistration",
    "DiscoveryRegistration",
    "StandbyRegistration",
    "Seat",
    "StaticSeat",
    "DiscoverySeat",
    "seat_for",
    "publisher_on",
    "listen_on_ip",
]

log = logging.getLogger("kvmesh.worker")

READY_PREFIX = "KVMESH_READY "
UNREGISTER_GRACE_S = 0.5
UNREGISTER_TIMEOUT_S = 2.0


class ReadyLine:
    """Writes an instance's READY line once (later calls do nothing) and then calls
    ``on_ready`` (``--replicas``: the next replica may start)."""

    def __init__(self, out: TextIO, on_ready: Callable[[], None] | None = None) -> None:
        self.out = out
        self.on_ready = on_ready
        self.written = False

    def __call__(self, info: InstanceInfo) -> None:
        if not self.written:
            self.written = True
            self.out.write(READY_PREFIX + msgspec.json.encode(info).decode() + "\n")
            self.out.flush()
        if self.on_ready is not None:
            self.on_ready()


class Registration(Protocol):
    """An instance's place in routing. The worker calls, in order: 1. :meth:`register`
    once its service answers; 2. on a stop, :meth:`withdraw` unless :attr:`lost` is set;
    3. :meth:`close` on the way out (always, also after a failed start)."""

    @property
    def lost(self) -> asyncio.Event:
        """Set when the registration was taken away (a revoked lease): the worker steps
        down without withdrawing."""
        ...

    async def register(self, info: InstanceInfo, stop: asyncio.Event) -> bool:
        """Make ``info`` routable; False: stopped before it was (a standby never ordered
        to serve). May set ``stop`` later (a planner's order)."""
        ...

    async def withdraw(self, grace_s: float) -> None:
        """Leave routing before the drain, then serve on while routers notice."""
        ...

    async def close(self) -> None: ...


class ParentRegistration:
    """A static worker's: the READY line, read by the process that started it."""

    def __init__(self, ready: ReadyLine) -> None:
        self.ready = ready
        self._lost = asyncio.Event()  # never set: no lease

    @property
    def lost(self) -> asyncio.Event:
        return self._lost

    async def register(self, info: InstanceInfo, stop: asyncio.Event) -> bool:
        self.ready(info)
        return True

    async def withdraw(self, grace_s: float) -> None:
        """Nothing: the parent takes the record out (before a planned stop, or when the
        process ends)."""

    async def close(self) -> None:
        return None


class DiscoveryRegistration:
    """The instance's own record in discovery, bound to its runtime's lease."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    @property
    def lost(self) -> asyncio.Event:
        return self.endpoint.runtime.lease_lost

    async def register(self, info: InstanceInfo, stop: asyncio.Event) -> bool:
        await self.endpoint.register(info)
        return True

    async def withdraw(self, grace_s: float) -> None:
        """Bounded, since etcd may be out of reach (the record then goes with the lease,
        revoked or expiring, after the drain); routers that have not seen the removal
        yet may still pick this worker: it keeps serving a moment."""
        try:
            await asyncio.wait_for(self.endpoint.unregister(), UNREGISTER_TIMEOUT_S)
        except (KvmeshError, TimeoutError) as exc:
            log.warning("could not unregister before draining (%s); the lease takes the record with it", exc)
        await asyncio.sleep(min(grace_s, UNREGISTER_GRACE_S))

    async def close(self) -> None:
        return None


class StandbyRegistration:
    """A hot spare (``--standby``): offered, checked, registered through ``inner`` only
    once the planner orders it to serve; a serving one drains on the planner's stop."""

    def __init__(self, inner: DiscoveryRegistration, ready: ReadyLine) -> None:
        self.inner = inner
        self.ready = ready
        self.link: StandbyLink | None = None
        self._obey: asyncio.Future[None] | None = None

    @property
    def lost(self) -> asyncio.Event:
        return self.inner.lost

    async def register(self, info: InstanceInfo, stop: asyncio.Event) -> bool:
        runtime = self.inner.endpoint.runtime
        self.ready(info)  # started: waiting for the planner is no part of a start
        self.link = StandbyLink(runtime, info)
        await self.link.offer()
        log.info("worker %x standing by", info.worker_id)
        if not await _ordered_to_serve(self.link, stop, runtime.lease_lost):
            return False
        log.warning("worker %x promoted by the planner", info.worker_id)
        await self.inner.register(info, stop)
        await self.link.withdraw()  # after registering: the planner never sees it in neither place
        self._obey = asyncio.ensure_future(_obey_stop(self.link, stop))
        return True

    async def withdraw(self, grace_s: float) -> None:
        await self.inner.withdraw(grace_s)

    async def close(self) -> None:
        if self._obey is not None:
            self._obey.cancel()
            await asyncio.gather(self._obey, return_exceptions=True)
        if self.link is not None:
            await self.link.close()


async def _ordered_to_serve(link: StandbyLink, stop: asyncio.Event, lost: asyncio.Event) -> bool:
    """Wait for the planner's order: True for ``serve``; False for ``stop``, a signal or
    a lost lease (never served, nothing to drain)."""
    order = asyncio.ensure_future(link.next_order())
    others = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lost.wait())]
    await asyncio.wait([order, *others], return_when=asyncio.FIRST_COMPLETED)
    for w in (order, *others):
        w.cancel()
    if order.cancelled() or not order.done() or order.exception() is not None:
        return False
    return order.result().action == "serve"


async def _obey_stop(link: StandbyLink, stop: asyncio.Event) -> None:
    """A serving worker that came from standby drains when the planner says stop."""
    while (await link.next_order()).action != "stop":
        pass
    stop.set()


class Seat(Protocol):
    """Where one instance runs (see the module docstring). :meth:`open` first; then
    the rest; :meth:`close` last, always."""

    worker_id: int
    runtime: DistributedRuntime | None  # discovery and NATS, when the seat has them
    ready: ReadyLine  # the instance's READY line
    default_metrics_port: int | None  # without --metrics-port: None (no endpoint) or 0 (any port)

    async def open(self) -> None: ...

    async def events(self, plane: EventPlane | None) -> tuple[EventPublisher, str]:
        """The instance's KV event and load report publisher and the address subscribers
        connect to: on ``plane`` (the process's, shared by its replicas) or on a plane of
        its own (closed with the seat)."""
        ...

    async def request_server(self, component: str) -> RequestServer: ...

    def describe(self, server: RequestServer, component: str, **card: Any) -> InstanceInfo: ...

    def registration(self, component: str) -> Registration: ...

    async def close(self) -> None: ...


class StaticSeat:
    """No discovery: the config's id, a TCP server on ``--host``/``--port``."""

    runtime: DistributedRuntime | None = None
    default_metrics_port: int | None = None

    def __init__(self, cfg: WorkerConfig, ready: ReadyLine) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id
        self.ready = ready
        self._plane: EventPlane | None = None

    async def open(self) -> None:
        return None

    async def events(self, plane: EventPlane | None) -> tuple[EventPublisher, str]:
        if plane is None and not self.cfg.publish_events:
            return NullPublisher(), ""  # kvmesh run whose frontend subscribes to none: no plane, no zmq
        if plane is None:
            plane = self._plane = make_event_plane("zmq", host=self.cfg.host)
        return await publisher_on(plane, self.worker_id)

    async def request_server(self, component: str) -> RequestServer:
        server = TcpServer(self.cfg.host, self.cfg.port)
        sock = listen_on_ip(self.cfg.host, self.cfg.port)
        if sock is not None:
            await server.start(sock)  # listening now; nobody knows the address before the READY line
        return server

    def describe(self, server: RequestServer, component: str, **card: Any) -> InstanceInfo:
        address = server.address if isinstance(server, TcpServer) else ""
        return InstanceInfo(self.worker_id, address, pid=os.getpid(), component=component, endpoint=GENERATE, **card)

    def registration(self, component: str) -> Registration:
        return ParentRegistration(self.ready)

    async def close(self) -> None:
        if self._plane is not None:
            await self._plane.close()


class DiscoverySeat:
    """A distributed runtime's: its lease names the instance, its request server."""

    default_metrics_port: int | None = 0  # distributed workers always serve metrics

    def __init__(self, cfg: WorkerConfig, runtime: DistributedRuntime, ready: ReadyLine) -> None:
        self.cfg = cfg
        self.runtime: DistributedRuntime | None = runtime
        self._runtime = runtime
        self.ready = ready
        self.worker_id = 0
        self._endpoints: dict[str, Endpoint] = {}

    async def open(self) -> None:
        await self._runtime.start()
        self.worker_id = self._runtime.lease_id  # KV events name the worker by it, as the routers know it

    async def events(self, plane: EventPlane | None) -> tuple[EventPublisher, str]:
        rt = self._runtime
        if plane is None:
            rc = rt.config
            plane = make_event_plane(rc.event_plane, nats_client=rt.nats, namespace=rc.namespace, host=rc.host)
            rt.add_closer(plane.close)
        return await publisher_on(plane, self.worker_id)

    async def request_server(self, component: str) -> RequestServer:
        return await self._runtime.request_server(component)

    def describe(self, server: RequestServer, component: str, **card: Any) -> InstanceInfo:
        return self._endpoint(component).describe(server, **card)

    def registration(self, component: str) -> Registration:
        inner = DiscoveryRegistration(self._endpoint(component))
        return StandbyRegistration(inner, self.ready) if self.cfg.standby else inner

    def _endpoint(self, component: str) -> Endpoint:
        if component not in self._endpoints:
            self._endpoints[component] = self._runtime.namespace().component(component).endpoint(GENERATE)
        return self._endpoints[component]

    async def close(self) -> None:
        await self._runtime.shutdown()


def listen_on_ip(host: str, port: int) -> socket.socket | None:
    """A listening socket on ``host:port`` when ``host`` is an IP address (None: a name,
    left to the loop to resolve): uvloop resolves even an IP address through the idna
    codec, whose import (``encodings.idna``, ``stringprep``, ``unicodedata``) was ~5 ms
    of a static worker's start. Binds as ``create_server`` does (SO_REUSEADDR, backlog
    100); OSError (e.g. the port is in use) propagates."""
    family = next((f for f in (socket.AF_INET, socket.AF_INET6) if _is_address(f, host)), None)
    if family is None:
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(100)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _is_address(family: socket.AddressFamily, host: str) -> bool:
    try:
        socket.inet_pton(family, host)
    except OSError:
        return False
    return True


def seat_for(
    cfg: WorkerConfig, runtime: DistributedRuntime | None, ready: ReadyLine
) -> StaticSeat | DiscoverySeat:
    """The seat ``cfg``'s instance runs in: static without a runtime, else the runtime's."""
    return StaticSeat(cfg, ready) if runtime is None else DiscoverySeat(cfg, runtime, ready)


async def publisher_on(plane: EventPlane, publisher_id: int) -> tuple[EventPublisher, str]:
    """A worker's own KV event and load report publishers on ``plane``; returns the
    engine-facing publisher and the address subscribers connect to."""
    kv = await plane.publisher(KV_EVENTS_TOPIC, publisher_id)
    load = await plane.publisher(LOAD_TOPIC, publisher_id)
    # the KV events of one engine step (one turn of the loop) leave in one envelope
    publisher = BatchingPublisher(kv.publish, load.publish, asyncio.get_running_loop().call_soon)
    return publisher, kv.address
