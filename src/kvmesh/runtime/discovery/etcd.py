"""etcd v3 discovery over the asyncio client ``aetcd``.

* Endpoints are tried in order: :meth:`EtcdDiscovery.connect` uses the first that
  answers (retrying for ``connect_timeout_s``); a call that finds its endpoint
  unreachable moves on to the next one.
  One ``aetcd.Client`` (one gRPC channel) per endpoint lives from ``connect`` to
  ``close``; gRPC reconnects a channel by itself, with backoff capped at 1 s here.
* A lease is kept alive by a task owned by the discovery, every TTL/3. Unreachable
  etcd is retried (every ``retry_max_s`` at most), however long the outage: losing
  contact is not losing the lease. (etcd itself extends every lease by its TTL when
  it restarts or elects a new leader, so a lease outlives an outage of etcd itself.)
  A keep-alive answered with TTL <= 0 or "lease not found" sets ``lost``, with
  ``expired`` True if no keep-alive had succeeded for a whole TTL before (it may have
  run out while this process was cut off), False otherwise (it was revoked). etcd
  grants at least its minimum TTL (2 s with default settings); ``lease.ttl_s`` is the
  TTL etcd granted.
* A watch reads a snapshot (noting its revision R), yields it as puts, then watches
  from R + 1. On any error it backs off and resumes from the last revision it yielded
  + 1; if that revision was compacted it re-reads the prefix and yields the
  difference from what it had yielded (deletes for vanished keys, puts for new or
  modified ones). Nothing is yielded while etcd is unreachable.
* A prefix is read in pages of keys at one revision, at most ``max_records`` keys
  (the rest counted as refused, never read): one read of many large values would be
  larger than gRPC takes in one message (4 MiB) and fail every time; a page that is
  is read again in halves (one value always fits: etcd caps them at 1.5 MiB). A watch
  that resumes gets the revisions it missed in one response, which may be as large:
  it then re-reads the prefix (in pages) and watches on from there.

Keys are UTF-8 encoded; values are bytes as stored.

Security (:class:`EtcdCredentials`): ``https://`` endpoints (or a CA / client
certificate given) use a TLS gRPC channel, verified against ``ca_file`` (else the
system roots), with ``cert_file``/``key_file`` as the client certificate; ``user`` and
``password`` authenticate with etcd's auth (a token per channel). Passwords are never
put in a message or a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from kvmesh.errors import CannotConnect, InvalidArgument, Unknown
from kvmesh.runtime.discovery.base import Discovery, Lease, LeaseTasks, WatchEvent

__all__ = ["EtcdDiscovery", "EtcdLease", "EtcdCredentials"]

log = logging.getLogger("kvmesh.discovery.etcd")

T = TypeVar("T")

_UNREACHABLE = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError)

# Reconnect quickly after an outage (gRPC's default backoff grows to 120 s), and ping
# during open streams so a silently dead peer ends a watch. etcd refuses pings more
# often than every 5 s, and pings without an open stream. A local subchannel pool
# keeps a new channel from inheriting the failure backoff of an older one to the
# same address (gRPC shares connections process-wide by default).
_CHANNEL_OPTIONS = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}

_PAGE = 256  # keys per read of a prefix (halved while a page is too large for one message)


class _Read:
    """A prefix read: its keys, values and their revisions in key order, and the
    revision it was read at."""

    def __init__(self) -> None:
        self.kvs: list[tuple[str, bytes, int]] = []
        self.revision = 0
        self.last = b""  # the last key read (refused ones too)


@dataclass(frozen=True)
class EtcdCredentials:
    """How to reach a secured etcd (all optional): TLS files and an auth user."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("an etcd client certificate needs both --etcd-cert and --etcd-key")
        if bool(self.user) != bool(self.password):
            raise ValueError("etcd authentication needs both --etcd-user and KVMESH_ETCD_PASSWORD")

    def __repr__(self) -> str:  # never the password
        return f"EtcdCredentials(ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, user={self.user!r})"

    @property
    def tls_files(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


class _TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information (a subclass of Any)
    """``aetcd.Client`` over a TLS channel (aetcd itself opens plain channels only);
    the same stubs, watcher and token authentication as its ``connect``."""

    def __init__(self, *args: Any, channel_credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._is_connecting: bool = self._is_connecting  # set by aetcd; declared for the type checker
        self._channel_credentials = channel_credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            target = f"{self._host}:{self._port}"
            self.channel = aetcd.rpc.secure_channel(target, self._channel_credentials, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                try:
                    resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        raise aetcd.ConnectionFailedError(exc.details()) from None
                    raise aetcd.ClientError(f"etcd authentication failed: {exc.details()}") from None
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdLease(Lease):
    def __init__(self, owner: EtcdDiscovery, lease_id: int, ttl_s: float) -> None:
        super().__init__(lease_id, ttl_s)
        self._owner = owner
        self.out_of_contact = False  # no keep-alive has succeeded for longer than the TTL

    async def revoke(self) -> None:
        await self._owner._revoke(self)


class EtcdDiscovery(Discovery):
    name = "etcd"

    def __init__(
        self,
        endpoints: list[str],
        *,
        request_timeout_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        retry_max_s: float = 1.0,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd discovery needs at least one endpoint")
        super().__init__()
        self._credentials = credentials or EtcdCredentials()
        self._endpoints = [_parse_endpoint(e) for e in endpoints]
        self._timeout = request_timeout_s
        self._connect_timeout = connect_timeout_s
        self._retry_max_s = retry_max_s
        self._clients: list[aetcd.Client] = []
        self._current = 0  # index into _clients of the endpoint in use
        self._keepalives = LeaseTasks("etcd")
        self._closed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Use the first endpoint that answers, retrying for up to ``connect_timeout_s``
        (etcd may be starting too); then raise :class:`CannotConnect`."""
        if self._clients:
            return
        self._clients = [self._make_client(host, port, tls) for host, port, tls in self._endpoints]
        try:
            await self._await_an_endpoint()
        except BaseException:
            await self._close_clients()
            raise

    def _make_client(self, host: str, port: int, tls: bool) -> aetcd.Client:
        c = self._credentials
        auth = {"username": c.user, "password": c.password} if c.user else {}
        if tls or c.tls_files:
            return _TlsClient(host, port, timeout=self._timeout, options=_CHANNEL_OPTIONS,
                              channel_credentials=c.channel_credentials(), **auth)  # fmt: skip
        return aetcd.Client(host, port, timeout=self._timeout, options=_CHANNEL_OPTIONS, **auth)

    async def _await_an_endpoint(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout
        backoff = _Backoff(0.1, self._retry_max_s)
        while (error := await self._pick_endpoint()) is not None:
            delay = backoff.next()
            if loop.time() + delay > deadline:
                raise CannotConnect(f"no etcd endpoint answered ({self._describe()}): {error}") from error
            await asyncio.sleep(delay)

    async def _pick_endpoint(self) -> Exception | None:
        """Make the first endpoint that answers current; the last error if none does."""
        error: Exception | None = None
        for index, client in enumerate(self._clients):
            try:
                await client.status()
            except aetcd.ClientError as exc:
                error = exc
                continue
            self._current = index
            return None
        return error

    async def close(self) -> None:
        """Stop keep-alives and end watches; leases are not revoked (they expire)."""
        if self._closed.is_set():
            return
        self._closed.set()
        await self._keepalives.stop_all()
        await self._close_clients()

    async def _close_clients(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.close()

    # ------------------------------------------------------------------ endpoints
    def _client(self) -> aetcd.Client:
        if self._closed.is_set():
            raise CannotConnect("etcd discovery is closed")
        if not self._clients:
            raise RuntimeError("EtcdDiscovery.connect() was not awaited")
        return self._clients[self._current]

    def _failed(self, client: aetcd.Client) -> None:
        """``client`` found its endpoint unreachable: move on to the next endpoint."""
        if len(self._clients) > 1 and self._clients[self._current] is client:
            self._current = (self._current + 1) % len(self._clients)
            host, port, _ = self._endpoints[self._current]
            log.warning("etcd endpoint unreachable; trying %s:%d", host, port)

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run one request, on each endpoint in turn until one is reachable."""
        error: Exception | None = None
        for _ in range(len(self._clients) or 1):
            client = self._client()
            try:
                return await op(client)
            except _UNREACHABLE as exc:
                error = exc
                self._failed(client)
            except aetcd.ClientError as exc:
                raise _translate(exc) from exc
        raise CannotConnect(f"etcd unreachable ({self._describe()}): {error}") from error

    def _describe(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port, _ in self._endpoints)

    # ------------------------------------------------------------------ leases
    async def grant_lease(self, ttl_s: float) -> Lease:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be > 0, got {ttl_s}")
        granted = await self._call(lambda c: c.lease(max(1, math.ceil(ttl_s))))
        lease = EtcdLease(self, granted.id, float(granted.ttl))
        self._keepalives.start(lease.id, self._keep_alive(lease))
        return lease

    async def _revoke(self, lease: EtcdLease) -> None:
        await self._keepalives.stop(lease.id)
        try:
            await self._call(lambda c: c.revoke_lease(lease.id))
        except InvalidArgument:
            pass  # "lease not found": already revoked or expired
        finally:
            lease.lost.set()

    async def _keep_alive(self, lease: EtcdLease) -> None:
        """Refresh every TTL/3 (every ``retry_max_s`` at most while etcd is unreachable),
        for as long as it takes: an unreachable etcd never ends the lease here. Only
        etcd's own answer that the lease is gone does; see :meth:`_gone`."""
        loop = asyncio.get_running_loop()
        interval = lease.ttl_s / 3
        last_ok = loop.time()  # when the last successful keep-alive was *sent*
        ttl: int | None = 1
        while True:
            await asyncio.sleep(interval if ttl is not None else min(interval, self._retry_max_s))
            sent = loop.time()
            ttl = await self._refresh(lease.id, interval)
            if ttl is None:
                if loop.time() - last_ok > lease.ttl_s and not lease.out_of_contact:
                    lease.out_of_contact = True
                    log.warning("etcd unreachable for longer than lease %x's TTL (%.0f s); still trying", lease.id, lease.ttl_s)
                continue
            if ttl > 0:
                if lease.out_of_contact:
                    log.warning("etcd reachable again; lease %x kept", lease.id)
                last_ok, lease.out_of_contact = sent, False
                continue
            self._gone(lease, loop.time() - last_ok)
            return

    def _gone(self, lease: EtcdLease, since_ok: float) -> None:
        # NOTE: etcd resets a lease's expiry to now + TTL on each keep-alive it handles,
        # which is after we sent it; so if less than a TTL has passed since the last
        # successful one was sent, the lease cannot have expired: it was revoked.
        lease.expired = since_ok >= lease.ttl_s
        how = "expired while etcd was out of reach" if lease.expired else "revoked"
        log.warning("etcd lease %x %s (%.1f s since the last keep-alive)", lease.id, how, since_ok)
        self._keepalives.forget(lease.id)
        lease.lost.set()

    async def _refresh(self, lease_id: int, timeout: float) -> int | None:
        """The TTL etcd answered (<= 0: the lease is gone), or None if unreachable.

        NOTE: bounded by ``timeout`` (TTL/3), well under the request timeout: a member
        that lost its leader holds a keep-alive until it times out, and etcd extends
        leases by only about their TTL when a new leader takes over, so a keep-alive
        must give up early and try again (on the next endpoint) to be in time."""
        client = self._client()
        try:
            reply = await asyncio.wait_for(client.refresh_lease(lease_id), timeout)
        except (*_UNREACHABLE, TimeoutError) as exc:
            log.debug("etcd keep-alive for lease %x: %r", lease_id, exc)
            self._failed(client)
            return None
        except aetcd.ClientError as exc:
            if _lease_not_found(exc):
                return 0
            log.warning("etcd keep-alive for lease %x failed: %s", lease_id, exc)
            self._failed(client)
            return None
        return None if reply is None else int(reply.TTL)

    # ------------------------------------------------------------------ keys
    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        await self._call(lambda c: c.put(key.encode(), bytes(value), lease=lease_id or 0))

    async def delete(self, key: str) -> None:
        await self._call(lambda c: c.delete(key.encode()))

    async def _get_prefix(self, prefix: str) -> dict[str, bytes]:
        start, end = _prefix_range(prefix.encode())
        result = await self._call(lambda c: self._read(c, prefix, start, end))
        return {key: value for key, value, _ in result.kvs}

    async def _read(self, client: aetcd.Client, prefix: str, start: bytes, end: bytes) -> _Read:
        """[start, end) in pages at one revision: at most ``max_records`` keys, values
        over ``max_value_bytes`` refused here (never held past their page)."""
        read, page, key = _Read(), _PAGE, start
        while True:
            want = min(page, max(1, self.max_records - len(read.kvs)))
            try:
                reply = await self._range(client, key, end, want, read.revision)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or want == 1:
                    aetcd.exceptions._handle_exception(exc)  # aetcd's own mapping to its errors
                page = max(1, want // 2)  # more bytes than one message takes: smaller pages
                continue
            read.revision = read.revision or reply.header.revision
            for kv in reply.kvs:
                self._keep(read, kv)
            if not reply.more:
                return read
            if len(read.kvs) >= self.max_records:
                rest = reply.count - len(reply.kvs)
                self.refuse("too_many", f"{prefix}...", f"{prefix} holds more than {self.max_records} keys", rest)
                return read
            key = read.last + b"\0"

    def _keep(self, read: _Read, kv: Any) -> None:
        read.last = kv.key
        name = _key(kv.key)
        if name is None:
            return
        if len(kv.value) > self.max_value_bytes:
            self.refuse("too_large", name, f"{len(kv.value)} bytes (at most {self.max_value_bytes})")
            return
        read.kvs.append((name, kv.value, kv.mod_revision))

    async def _range(self, client: aetcd.Client, key: bytes, end: bytes, limit: int, revision: int) -> Any:
        await client.connect()
        request = aetcd.rpc.RangeRequest(key=key, range_end=end, limit=limit, revision=revision)
        return await client.kvstub.Range(request, timeout=self._timeout, metadata=client.metadata)

    # ------------------------------------------------------------------ watch
    async def _watch_prefix(self, prefix: str) -> AsyncGenerator[WatchEvent, None]:
        start, end = _prefix_range(prefix.encode())
        view = _View()
        backoff = _Backoff(0.05, self._retry_max_s)
        while not self._closed.is_set():
            client = self._client()
            try:
                if view.stale:
                    for event in view.resync(await self._read(client, prefix, start, end)):
                        yield event
                watch = await client.watch(start, range_end=end, start_revision=view.revision + 1)
                backoff.reset()
                try:
                    async for raw in watch:
                        if (change := view.apply(raw)) is not None:
                            yield change
                finally:
                    await self._cancel_watch(watch)
            except aetcd.RevisionCompactedError as exc:
                log.info("etcd watch on %s: %s; re-reading the prefix", prefix, exc)
                view.stale = True
            except aetcd.ClientError as exc:
                if not _too_large(exc):
                    self._watch_failed(client, prefix, exc, backoff)
                    await self._pause(backoff.next())
                    continue
                # the changes missed came in one response, too large for one message: a
                # read of the prefix (in pages) covers them, and the watch goes on from it
                log.warning("etcd watch on %s: %s; re-reading the prefix", prefix, exc)
                view.stale = True
                await self._pause(backoff.next())
            except asyncio.CancelledError:
                # close() cancels the gRPC calls in flight: that ends the watch quietly,
                # but a cancellation of the consumer itself goes on.
                if self._closed.is_set() and not _cancelling():
                    return
                raise

    def _watch_failed(self, client: aetcd.Client, prefix: str, exc: Exception, backoff: _Backoff) -> None:
        if isinstance(exc, _UNREACHABLE):
            self._failed(client)
        # One warning per outage; the retries after it are debug noise.
        (log.warning if backoff.failures == 0 else log.debug)("etcd watch on %s interrupted: %s", prefix, exc)

    async def _cancel_watch(self, watch: aetcd.Watch) -> None:
        # After close() the client and its watcher are gone, and so is the watch.
        if not self._closed.is_set():
            await watch.cancel()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), seconds)


class _View:
    """What one watch has yielded so far, and the revision it has seen up to."""

    def __init__(self) -> None:
        self.known: dict[str, int] = {}  # key -> mod_revision
        self.revision = 0
        self.stale = True  # True: read a snapshot before watching

    def resync(self, snapshot: _Read) -> list[WatchEvent]:
        """Adopt a fresh read of the prefix; return the changes from the old view."""
        fresh = {key: rev for key, _, rev in snapshot.kvs}
        events = [WatchEvent("delete", key) for key in self.known if key not in fresh]
        events += [WatchEvent("put", k, v) for k, v, rev in snapshot.kvs if self.known.get(k, 0) != rev]
        self.known = fresh
        self.revision = snapshot.revision
        self.stale = False
        return events

    def apply(self, raw: aetcd.Event) -> WatchEvent | None:
        self.revision = raw.kv.mod_revision
        key = _key(raw.kv.key)
        if key is None:
            return None
        if raw.kind == aetcd.EventKind.PUT:
            self.known[key] = raw.kv.mod_revision
            return WatchEvent("put", key, raw.kv.value)
        self.known.pop(key, None)
        return WatchEvent("delete", key)


def _key(raw: bytes) -> str | None:
    """A key as text; None (logged) for one that is not UTF-8 (no kvmesh process
    writes one: someone else put it there)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        log.warning("etcd discovery: ignoring key %r: not UTF-8", raw[:200])
        return None


class _Backoff:
    def __init__(self, first_s: float, max_s: float) -> None:
        self._first = first_s
        self._max = max_s
        self._next = first_s
        self.failures = 0

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._max)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self._next = self._first
        self.failures = 0


def _parse_endpoint(endpoint: str) -> tuple[str, int, bool]:
    """``(host, port, tls)`` of ``http://host:port`` or ``https://host:port``."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"etcd endpoint must look like http://host:port or https://host:port, got {endpoint!r}")
    if parts.username or parts.password:
        raise ValueError("put etcd credentials in --etcd-user and KVMESH_ETCD_PASSWORD, not in the endpoint")
    return parts.hostname, parts.port or 2379, parts.scheme == "https"


def _prefix_range(prefix: bytes) -> tuple[bytes, bytes]:
    """[start, end) covering every key that starts with ``prefix`` (etcd convention:
    an end of b"\\0" means "to the end of the key space")."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return (prefix or b"\0"), b"\0"
    end[-1] += 1
    return prefix, bytes(end)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _too_large(exc: Exception) -> bool:
    """Did gRPC refuse a response larger than one message may be (4 MiB)?"""
    cause = exc.__cause__
    if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return True
    return "larger than max" in str(exc)


def _lease_not_found(exc: Exception) -> bool:
    return "lease not found" in str(exc)


def _translate(exc: aetcd.ClientError) -> Exception:
    if _lease_not_found(exc):
        return InvalidArgument(f"etcd: {exc}")
    return Unknown(f"etcd: {exc}")
