"""The distributed runtime: ``DistributedRuntime`` → ``Namespace`` → ``Component`` →
``Endpoint``, and the ``Client`` that keeps the live instance set of an endpoint.

One runtime per process holds one primary lease; every key the process registers is
bound to it, so when the lease goes (revoked with ``etcdctl``, expired, or revoked at
shutdown) the process's instances leave discovery together.

Losing contact with discovery is not losing the lease. While etcd is unreachable the
process keeps serving and its keep-alives keep trying. If, once etcd answers again,
the lease turns out to have expired meanwhile (the process was cut off for longer
than the TTL), the runtime takes a new lease and puts its keys again, under the same
names and with the same records: the process keeps its identity (``lease_id``, the
id of its *first* lease, which names its keys, NATS subjects and KV events), so
watchers see the instance come back, never a second one. Only a revoke (a lease
found gone although a keep-alive succeeded less than a TTL before) is the deliberate
stop signal: ``runtime.lease_lost`` fires and workers shut down gracefully.

Lifecycle::

    rt = DistributedRuntime(config)          # no I/O
    await rt.start()                         # discovery + primary lease (+ NATS)
    ep = rt.namespace("kvmesh").component("backend").endpoint("generate")
    await ep.serve(handler)                  # handler on this process's request server
    await ep.register(info)                  # discovery key bound to the lease
    ...
    await ep.unregister()                    # stop being routed to
    await rt.shutdown()                      # revoke the lease, close planes

Callers: ``client = ep.client(on_added, on_removed); await client.start()``; the
callbacks receive each instance's :class:`~kvmesh.protocol.InstanceInfo` and a
request-plane client for it (TCP or NATS, from the instance's own transport).

Discovery records are data from the network. With a cluster secret each record is
signed by the process that registers it (an HMAC over its key and value) and a record
without a valid signature is skipped and logged. Each new instance is processed in
its own task, bounded by ``record_timeout_s``: a record that cannot be processed in
time (a worker that never answers for its model files) is skipped and logged, and the
watch goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload, runtime_checkable

import msgspec

from kvmesh.config import RuntimeConfig
from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.protocol import InstanceInfo
from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.discovery.base import Discovery, Lease
from kvmesh.runtime.stream import Handler, RequestClient, RequestServer
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer

if TYPE_CHECKING:  # imported when first used: a process without NATS never loads nats-py
    from nats.aio.client import Client as NatsClient

    from kvmesh.runtime.discovery.etcd import EtcdCredentials
    from kvmesh.runtime.nats import CallHomeServer

__all__ = [
    "DistributedRuntime",
    "Namespace",
    "Component",
    "Endpoint",
    "Client",
    "RequestClient",
    "RequestServer",
    "instance_key",
    "endpoint_prefix",
    "call",
    "NIL",
    "sign_record",
    "record_is_signed",
    "sign_struct",
    "struct_is_signed",
    "SharedClients",
]

log = logging.getLogger("kvmesh.runtime")

REVOKE_TIMEOUT_S = 3.0  # how long shutdown tries to revoke the lease

_decode_info = msgspec.json.Decoder(InstanceInfo).decode
_encode = msgspec.json.encode


T = TypeVar("T")


@runtime_checkable
class _Listening(Protocol):
    """A request server with a TCP address (the TCP plane's)."""

    host: str
    port: int


NIL = b"\xc0"  # msgpack nil: the payload of an endpoint that takes no argument


@overload
async def call(client: RequestClient, endpoint: str, payload: bytes = NIL) -> msgspec.Raw | None: ...
@overload
async def call(client: RequestClient, endpoint: str, payload: bytes, decode: Callable[[msgspec.Raw], T]) -> T | None: ...
@overload
async def call(client: RequestClient, endpoint: str, payload: bytes = NIL, *, decode: Callable[[msgspec.Raw], T]) -> T | None: ...
async def call(
    client: RequestClient, endpoint: str, payload: bytes = NIL, decode: Callable[[msgspec.Raw], Any] | None = None
) -> Any:
    """One request, one answer: the last item ``endpoint`` streams back (None if none),
    decoded by ``decode`` (raw msgpack without one). Typed errors propagate as from
    :meth:`RequestClient.stream`."""
    result = None
    ctx = Context(f"call-{endpoint}")
    items = client.stream(endpoint, payload, ctx) if decode is None else client.stream(endpoint, payload, ctx, decode)
    async for item in items:
        result = item
    return result


def endpoint_prefix(namespace: str, component: str, endpoint: str) -> str:
    return f"/services/{namespace}/{component}/{endpoint}-"


def instance_key(namespace: str, component: str, endpoint: str, lease_id: int) -> str:
    return f"{endpoint_prefix(namespace, component, endpoint)}{lease_id:x}"


_Signed = TypeVar("_Signed", bound=msgspec.Struct)


def _struct_mac(secret: ClusterSecret, label: str, key: str, msg: msgspec.Struct) -> str:
    return secret.sign(label, key.encode(), _encode(msgspec.structs.replace(msg, mac=""))).hex()


def sign_struct(secret: ClusterSecret | None, label: str, key: str, msg: _Signed) -> _Signed:
    """``msg`` (a struct with a ``mac`` field, stored at ``key``) with its signature
    for ``label`` (unchanged without a secret): discovery records, planner orders."""
    return msg if secret is None else msgspec.structs.replace(msg, mac=_struct_mac(secret, label, key, msg))


def struct_is_signed(secret: ClusterSecret | None, label: str, key: str, msg: msgspec.Struct) -> bool:
    """Does ``msg``'s ``mac`` field hold its signature for ``label`` and ``key``?"""
    return secret is None or hmac.compare_digest(getattr(msg, "mac"), _struct_mac(secret, label, key, msg))


def sign_record(secret: ClusterSecret | None, key: str, info: InstanceInfo) -> InstanceInfo:
    """``info`` with its signature for ``key`` (unchanged without a secret)."""
    return sign_struct(secret, "discovery", key, info)


def record_is_signed(secret: ClusterSecret | None, key: str, info: InstanceInfo) -> bool:
    return struct_is_signed(secret, "discovery", key, info)


class DistributedRuntime:
    def __init__(
        self,
        config: RuntimeConfig,
        discovery: Discovery | None = None,
        secret: ClusterSecret | None | auth._FromEnv = auth.FROM_ENV,
        *,
        nats: NatsClient | None = None,
        borrowed: bool = False,
    ) -> None:
        """``borrowed``: ``discovery`` and ``nats`` belong to the caller, who shares them
        between several runtimes of one process (:func:`shared_clients`); shutdown then
        revokes this runtime's lease and closes its servers, never those clients."""
        self.config = config
        self.secret = auth.resolve(secret)
        self._discovery = discovery
        self._borrowed = borrowed
        self.lease: Lease | None = None  # the current lease (replaced if it expires)
        self._id: int | None = None  # the first lease's id: this process's identity
        self._leased: dict[str, bytes] = {}  # keys bound to the lease, put again on a new one
        self._revoked = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None
        self.renewals = 0  # leases taken after one expired out of contact
        self.nats: NatsClient | None = nats
        self._servers: dict[str, RequestServer] = {}
        self._callhome: CallHomeServer | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._discovery is None:
            self._discovery = _make_discovery(self.config)
        await self._discovery.connect()
        self.lease = await self._discovery.grant_lease(self.config.lease_ttl_s)
        self._id = self.lease.id
        self._holder = asyncio.get_running_loop().create_task(self._hold_lease(), name="runtime-lease")
        if self.config.needs_nats:
            await self.connect_nats()

    async def connect_nats(self) -> NatsClient:
        """This process's NATS client (connected on first use, closed at shutdown), with
        the configured credentials file and TLS files (if any)."""
        if self.nats is None:
            self.nats = await _connect_nats(self.config)
        return self.nats

    @property
    def discovery(self) -> Discovery:
        if self._discovery is None:
            raise RuntimeError("DistributedRuntime.start() was not awaited")
        return self._discovery

    @property
    def lease_id(self) -> int:
        """This process's identity: the id of its first lease (kept if that lease is
        replaced after an outage)."""
        if self._id is None:
            raise RuntimeError("DistributedRuntime.start() was not awaited")
        return self._id

    @property
    def lease_lost(self) -> asyncio.Event:
        """Set when the lease was revoked (the deliberate stop signal); never merely
        because discovery could not be reached."""
        return self._revoked

    async def put_leased(self, key: str, value: bytes) -> None:
        """Put ``key`` bound to the lease; it is put again if the lease is replaced."""
        assert self.lease is not None
        self._leased[key] = value
        await self.discovery.put(key, value, self.lease.id)

    async def delete_leased(self, key: str) -> None:
        self._leased.pop(key, None)
        await self.discovery.delete(key)

    async def _hold_lease(self) -> None:
        """Replace a lease that expired while out of contact; report a revoked one."""
        while True:
            lease = self.lease
            assert lease is not None
            await lease.lost.wait()
            if self._closed:
                return
            if not lease.expired:
                log.warning("lease %x revoked", lease.id)
                self._revoked.set()
                return
            await self._renew(lease)

    async def _renew(self, old: Lease) -> None:
        """A new lease (retrying until discovery grants one), and every key put again."""
        lease: Lease | None = None
        delay = 0.1
        while not self._closed:
            try:
                if lease is None or lease.lost.is_set():
                    lease = await self.discovery.grant_lease(self.config.lease_ttl_s)
                for key, value in list(self._leased.items()):
                    await self.discovery.put(key, value, lease.id)
            except KvmeshError as exc:
                if isinstance(exc, InvalidArgument):  # "lease not found": it went already; take another
                    lease = None
                log.warning("cannot re-register yet: %s", exc.message)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self.lease = lease
            self.renewals += 1
            log.warning(
                "lease %x expired while out of contact; %d keys of instance %x re-registered under lease %x",
                old.id, len(self._leased), self.lease_id, lease.id,
            )  # fmt: skip
            return

    def add_closer(self, close: Callable[[], Awaitable[None]]) -> None:
        """Something to close at shutdown, before the planes (e.g. an event plane)."""
        self._closers.append(close)

    def namespace(self, name: str | None = None) -> Namespace:
        return Namespace(self, name or self.config.namespace)

    async def shutdown(self) -> None:
        """Revoke the primary lease (its keys vanish), close servers and planes."""
        if self._closed:
            return
        self._closed = True
        if self._holder is not None:
            self._holder.cancel()
            await asyncio.gather(self._holder, return_exceptions=True)
        if self.lease is not None and not self.lease.lost.is_set():
            try:
                # bounded: discovery may be out of reach (then the lease expires)
                await asyncio.wait_for(self.lease.revoke(), REVOKE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the lease will expire on its own
                log.warning("could not revoke lease %x; it will expire", self.lease.id)
        for server in self._servers.values():
            await server.close()
        for close in reversed(self._closers):
            await close()
        if self._callhome is not None:
            await self._callhome.close()
        if self._borrowed:
            return
        if self.nats is not None:
            await self.nats.close()
        if self._discovery is not None:
            await self._discovery.close()

    # ------------------------------------------------------------------ request plane
    async def request_server(self, component: str) -> RequestServer:
        """This process's request server for ``component`` (started on first use)."""
        key = component if self.config.request_plane == "nats" else ""
        server = self._servers.get(key)
        if server is None:
            if self.config.request_plane == "nats":
                from kvmesh.runtime.nats import NatsRequestServer

                nc = await self.connect_nats()
                server = NatsRequestServer(nc, self.config.namespace, component, self.lease_id, secret=self.secret)
            else:
                server = TcpServer(self.config.host, 0, secret=self.secret)
            await server.start()
            self._servers[key] = server
        return server

    async def client_for(
        self, info: InstanceInfo, connect_timeout: float = 5.0, response_timeout: float | None = None
    ) -> RequestClient:
        """A request-plane client that reaches ``info`` over its own transport."""
        if info.transport == "nats":
            nc = await self.connect_nats()
            if self._callhome is None:
                from kvmesh.runtime.nats import CallHomeServer

                self._callhome = CallHomeServer(self.config.host, 0, secret=self.secret)
                await self._callhome.start()
            from kvmesh.runtime.nats import NatsRequestClient

            return NatsRequestClient(
                nc, self._callhome, info.namespace, info.component, info.worker_id,
                connect_timeout=connect_timeout, response_timeout=response_timeout,
            )  # fmt: skip
        return TcpClient(info.address, connect_timeout, response_timeout, secret=self.secret)


def _etcd_credentials(c: RuntimeConfig) -> EtcdCredentials | None:
    if c.discovery != "etcd":
        return None
    from kvmesh.runtime.discovery.etcd import EtcdCredentials

    return EtcdCredentials(c.etcd_ca_file, c.etcd_cert_file, c.etcd_key_file, c.etcd_user, c.etcd_password)


def _make_discovery(c: RuntimeConfig) -> Discovery:
    from kvmesh.runtime.discovery import make_discovery

    return make_discovery(
        c.discovery, etcd_endpoints=list(c.etcd_endpoints), file_dir=c.file_discovery_dir,
        etcd_credentials=_etcd_credentials(c),
    )  # fmt: skip


async def _connect_nats(c: RuntimeConfig) -> NatsClient:
    from kvmesh.runtime.nats import connect_nats, nats_tls_context

    tls = nats_tls_context(c.nats_ca_file, c.nats_cert_file, c.nats_key_file)
    return await connect_nats(c.nats_url, user_credentials=c.nats_creds_file or None, tls=tls)


class SharedClients:
    """One discovery client (one etcd channel: every backend holds many leases) and
    one NATS connection (when the planes need it), shared by several runtimes of one
    process: ``DistributedRuntime(config, clients.discovery, nats=clients.nats,
    borrowed=True)``. Close it after those runtimes shut down."""

    def __init__(self, discovery: Discovery, nats: NatsClient | None) -> None:
        self.discovery = discovery
        self.nats = nats

    @classmethod
    async def connect(cls, config: RuntimeConfig) -> SharedClients:
        discovery = _make_discovery(config)
        await discovery.connect()
        try:
            nats = await _connect_nats(config) if config.needs_nats else None
        except BaseException:
            await discovery.close()
            raise
        return cls(discovery, nats)

    async def close(self) -> None:
        if self.nats is not None:
            await self.nats.close()
        await self.discovery.close()


@dataclass(frozen=True, eq=False)
class Namespace:
    runtime: DistributedRuntime
    name: str

    def component(self, name: str) -> Component:
        return Component(self, name)


@dataclass(frozen=True, eq=False)
class Component:
    namespace: Namespace
    name: str

    def endpoint(self, name: str) -> Endpoint:
        return Endpoint(self, name)


@dataclass(eq=False)
class Endpoint:
    component: Component
    name: str
    _key: str | None = field(default=None, init=False)  # set while registered

    @property
    def runtime(self) -> DistributedRuntime:
        return self.component.namespace.runtime

    @property
    def prefix(self) -> str:
        return endpoint_prefix(self.component.namespace.name, self.component.name, self.name)

    async def serve(self, handler: Handler) -> RequestServer:
        server = await self.runtime.request_server(self.component.name)
        server.register(self.name, handler)
        return server

    def describe(self, server: RequestServer, **card: Any) -> InstanceInfo:
        """The discovery value for this endpoint served by ``server``."""
        rt = self.runtime
        nats = rt.config.request_plane == "nats"
        address = f"{server.host}:{server.port}" if not nats and isinstance(server, _Listening) else ""
        subject = f"{self.component.namespace.name}.{self.component.name}.{self.name}-{rt.lease_id:x}" if nats else ""
        return InstanceInfo(
            worker_id=rt.lease_id,
            address=address,
            namespace=self.component.namespace.name,
            component=self.component.name,
            endpoint=self.name,
            transport="nats" if nats else "tcp",
            subject=subject,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            **card,
        )

    async def register(self, info: InstanceInfo) -> None:
        rt = self.runtime
        self._key = instance_key(self.component.namespace.name, self.component.name, self.name, rt.lease_id)
        await rt.put_leased(self._key, _encode(sign_record(rt.secret, self._key, info)))

    async def unregister(self) -> None:
        if self._key is not None:
            key, self._key = self._key, None
            await self.runtime.delete_leased(key)

    def client(
        self,
        on_added: Callable[[InstanceInfo, RequestClient], Awaitable[None]],
        on_removed: Callable[[int], Awaitable[None]],
        connect_timeout: float = 5.0,
        response_timeout: float | None = None,
        record_timeout_s: float = 30.0,
    ) -> Client:
        return Client(self.runtime, self.prefix, on_added, on_removed, connect_timeout, response_timeout, record_timeout_s)


@dataclass(eq=False, repr=False)
class Client:
    """Watches an endpoint's prefix and reports instances as they come and go.

    An outage of the discovery backend changes nothing here: the watch resumes and
    the instance set stays as it was last seen.
    """

    runtime: DistributedRuntime
    prefix: str
    on_added: Callable[[InstanceInfo, RequestClient], Awaitable[None]]
    on_removed: Callable[[int], Awaitable[None]]
    connect_timeout: float = 5.0
    response_timeout: float | None = None
    record_timeout_s: float = 30.0
    known: dict[int, InstanceInfo] = field(default_factory=dict, init=False)
    skipped: int = field(default=0, init=False)  # records refused (unsigned, undecodable) or not processed in time
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _adding: dict[int, asyncio.Task[None]] = field(default_factory=dict, init=False)  # owned: one per instance being added

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        tasks = [*self._adding.values(), *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._adding.clear()

    async def _watch(self) -> None:
        async for event in self.runtime.discovery.watch_prefix(self.prefix):
            try:
                if event.kind == "put":
                    self._put(event.key, event.value)
                else:
                    await self._delete(event.key)
            except Exception:  # noqa: BLE001 - one bad entry must not end the watch
                log.exception("discovery event %s %s not applied", event.kind, event.key)

    def _put(self, key: str, value: bytes) -> None:
        try:
            info = _decode_info(value)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            self.skipped += 1
            log.warning("skipping discovery record %s: not an instance record: %s", key[:200], exc)
            return
        if not record_is_signed(self.runtime.secret, key, info):
            self.skipped += 1
            log.warning("skipping discovery record %s: not signed with this fleet's cluster secret", key[:200])
            return
        if key[len(self.prefix) :] != f"{info.worker_id:x}":
            self.skipped += 1  # a record in another instance's name
            log.warning("skipping discovery record %s: it names instance %x", key[:200], info.worker_id)
            return
        if info.worker_id in self.known:
            self.known[info.worker_id] = info
            return
        self.known[info.worker_id] = info
        task = asyncio.get_running_loop().create_task(self._add(key, info))
        self._adding[info.worker_id] = task
        task.add_done_callback(lambda t: self._added(info.worker_id, t))

    def _added(self, worker_id: int, task: asyncio.Task[None]) -> None:
        if self._adding.get(worker_id) is task:
            del self._adding[worker_id]

    async def _add(self, key: str, info: InstanceInfo) -> None:
        """Attach one instance, within ``record_timeout_s``; skipped (and logged) otherwise."""
        client: RequestClient | None = None
        try:
            async with asyncio.timeout(self.record_timeout_s):
                client = await self.runtime.client_for(info, self.connect_timeout, self.response_timeout)
                await self.on_added(info, client)
        except TimeoutError:
            if client is not None:
                await client.close()
            self.skipped += 1
            self.known.pop(info.worker_id, None)  # a later put of the record tries again
            log.warning("skipping discovery record %s: not processed within %.0f s", key[:200], self.record_timeout_s)
        except Exception:  # noqa: BLE001 - one bad record must not end anything else
            self.known.pop(info.worker_id, None)
            log.exception("discovery record %s not applied", key[:200])

    async def _delete(self, key: str) -> None:
        suffix = key[len(self.prefix) :]
        try:
            worker_id = int(suffix, 16)
        except ValueError:
            log.warning("ignoring discovery key %s", key)
            return
        adding = self._adding.pop(worker_id, None)
        if adding is not None:  # still being added: stop that first
            adding.cancel()
            await asyncio.gather(adding, return_exceptions=True)
        if self.known.pop(worker_id, None) is not None:
            await self.on_removed(worker_id)
