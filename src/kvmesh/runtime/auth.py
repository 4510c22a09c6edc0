"""The cluster secret: which processes belong to one kvmesh fleet.

Every process of a fleet is given the same secret (``--cluster-secret-file FILE``,
``KVMESH_CLUSTER_SECRET_FILE``, or the secret itself in ``KVMESH_CLUSTER_SECRET``;
``kvmesh run`` makes a random one for its own processes). With a secret set:

* every internal TCP connection (request plane, NATS call-home, KV transfer) starts
  with a mutual challenge–response :class:`Handshake`; a peer that cannot prove it
  knows the secret is refused before a single frame is read;
* NATS requests and prefill jobs are sealed (encrypted, authenticated, fresh:
  :mod:`kvmesh.runtime.seal`); NATS replies, event envelopes, the prefill queue's
  depth counter and discovery records carry an HMAC that receivers check
  (:meth:`ClusterSecret.sign` / :meth:`ClusterSecret.verify`);
* the zmq event plane uses CURVE with key pairs derived from the secret
  (:meth:`ClusterSecret.derive`).

The handshake (``cn``, ``sn``: 16 random bytes chosen by the client and the server for
this connection; ``channel``: what the connection is for, e.g. ``request``)::

    client → server   MAGIC cn
    server → client   MAGIC sn HMAC(secret, "server" channel cn sn)
    client → server   HMAC(secret, "client" channel cn sn)        then records (below)

Each side proves knowledge of the secret over the other side's fresh nonce, so a
recorded exchange cannot be replayed, a proof cannot be reflected back (the role is
in the MAC) and one channel's proof does not open another. The secret never crosses
the wire. A client whose server's proof is wrong still sends its own proof before it
closes, so both sides log the mismatch; nothing waits longer than the handshake
timeout.

After the handshake every byte each way is authenticated (unless the connection is
TLS, which authenticates its bytes itself) under this direction's key, derived from the
secret and both nonces (``MAC(secret, "frames", direction, channel, cn, sn)``: fresh per
connection, one per direction). The MAC state is never reset: each tag is the MAC of
*the whole stream so far* (this direction's bytes, in order), so it also covers its
position, an implicit sequence number. Data altered, injected, replayed, reordered or
dropped fails its tag (or the next one's); the receiver acts on nothing before its tag
has checked, logs one line and closes the connection.

* Request plane and call-home (:mod:`kvmesh.runtime.frames`): the tag travels in the
  frame stream itself. Each write of frames ends with a *tag frame*, a length prefix no
  frame can have (``0x3FFFFFFF``) and the 16-byte tag (keyed BLAKE2b: one keyed state per
  direction, one ``update`` and one ``digest`` per write) over the frames and that prefix.
  No second framing layer: the frame reader parses, checks and decodes in one pass.
* KV transfer (:class:`SealedStream`): bulk payloads in **records**::

      u32 big-endian length n (at most MAX_RECORD) | n bytes | 16-byte tag

  HMAC-SHA256 over each record's length and bytes (:data:`BULK`), whose chunks of up to
  ``MAX_RECORD`` bytes it hashes about twice as fast as BLAKE2b where the CPU has SHA
  instructions.

Without a secret nothing changes on the wire (no handshake, no MACs, no records).

Exposure (:func:`check_exposure`): ``kvmesh frontend|worker|planner`` refuse to listen on
anything but loopback without a secret or TLS unless ``--insecure`` (then
:func:`warn_insecure` logs it at start and every minute).

TLS (optional, :class:`TlsContexts`): ``--tls-cert/--tls-key/--tls-ca`` (or
``KVMESH_TLS_CERT``/``KVMESH_TLS_KEY``/``KVMESH_TLS_CA``) put every internal TCP
connection (request plane, call-home, KV transfer) inside mutual TLS: each side shows
a certificate signed by the fleet's CA and checks the other's against it. Peers are
identified by the CA, not by host names (workers advertise addresses, often IPs).
The cluster-secret handshake then runs inside TLS, so both can be used together.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol, cast

from kvmesh.errors import InvalidArgument

__all__ = [
    "ClusterSecret",
    "Handshake",
    "AuthError",
    "FROM_ENV",
    "MAGIC",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "process_secret",
    "resolve",
    "new_secret_hex",
    "looks_like_handshake",
    "handshake_streams",
    "HANDSHAKE_TIMEOUT_S",
    "ProtocolHandshake",
    "TlsContexts",
    "process_tls",
    "resolve_tls",
    "looks_like_tls",
    "TLS_ENV",
    "Sealer",
    "Opener",
    "SealedStream",
    "SMALL",
    "Keyed",
    "BULK",
    "AUTH_FAILED",
    "MAX_RECORD",
    "is_loopback",
    "check_exposure",
    "warn_insecure",
]

log = logging.getLogger("kvmesh.auth")

MAGIC: Final = b"KVM\x02"  # version 2: records after the handshake (version 1 had none)
_FAMILY = MAGIC[:3]
_NONCE = 16
_MAC = 32
SECRET_ENV: Final = "KVMESH_CLUSTER_SECRET"
SECRET_FILE_ENV: Final = "KVMESH_CLUSTER_SECRET_FILE"
HANDSHAKE_TIMEOUT_S = 10.0
_MIN_SECRET = 16
_MAX_SECRET_FILE = 64 * 1024


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Final = _FromEnv()  # a constructor default: use the process's secret


class AuthError(InvalidArgument):
    """A peer failed (or did not attempt) the cluster-secret handshake."""


class ClusterSecret:
    """The shared key. ``sign``/``verify`` bind a MAC to a ``label`` (what is signed)."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        if len(key) < _MIN_SECRET:
            raise ValueError(f"a cluster secret needs at least {_MIN_SECRET} bytes, got {len(key)}")
        # Keyed once: HMAC over a derived key keeps the raw secret out of every MAC. Each
        # MAC starts from a copy of this keyed state (no key schedule, no digest lookup
        # per message: about 30 % fewer instructions than a fresh hmac.new).
        self._keyed = hmac.new(hashlib.sha256(b"kvmesh-cluster-secret\0" + key).digest(), digestmod=hashlib.sha256)

    def mac(self, *parts: bytes) -> bytes:
        h = self._keyed.copy()
        # length-prefixed, so parts cannot slide into each other; one update
        h.update(b"".join([len(part).to_bytes(8, "little") + part for part in parts]))
        return h.digest()

    def sign(self, label: str, *parts: bytes) -> bytes:
        return self.mac(label.encode(), *parts)

    def verify(self, mac: bytes, label: str, *parts: bytes) -> bool:
        return hmac.compare_digest(mac, self.sign(label, *parts))

    def frame_keys(self, channel: bytes, cn: bytes, sn: bytes) -> tuple[bytes, bytes]:
        """The two record keys of one connection: (client → server, server → client)."""
        return (self.mac(b"frames", b"client->server", channel, cn, sn), self.mac(b"frames", b"server->client", channel, cn, sn))

    def derive(self, label: str) -> bytes:
        """32 bytes for ``label`` that only holders of the secret can compute (e.g. the
        event plane's CURVE keys)."""
        return self.sign("derive", label.encode())

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"


def _read_secret_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SECRET_FILE + 1)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as exc:
        raise ValueError(f"cannot read the cluster secret file {path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        log.warning("the cluster secret file %s can be read by other users (mode %o); chmod 600 it", path, mode & 0o777)
    if len(data) > _MAX_SECRET_FILE:
        raise ValueError(f"the cluster secret file {path} is over {_MAX_SECRET_FILE} bytes")
    data = data.strip()
    if not data:
        raise ValueError(f"the cluster secret file {path} is empty")
    return data


_cache: dict[tuple[str, str], ClusterSecret | None] = {}


def process_secret() -> ClusterSecret | None:
    """This process's secret, from ``KVMESH_CLUSTER_SECRET_FILE`` (wins) or
    ``KVMESH_CLUSTER_SECRET``; None when neither is set. ValueError for a bad one."""
    path = os.environ.get(SECRET_FILE_ENV, "")
    raw = os.environ.get(SECRET_ENV, "")
    key = (path, raw)
    if key not in _cache:
        if path:
            _cache[key] = ClusterSecret(_read_secret_file(path))
        elif raw:
            _cache[key] = ClusterSecret(raw.encode())
        else:
            _cache[key] = None
    return _cache[key]


def resolve(secret: ClusterSecret | None | _FromEnv) -> ClusterSecret | None:
    return process_secret() if isinstance(secret, _FromEnv) else secret


def new_secret_hex() -> str:
    """A fresh random secret (256 bits, hex) for ``kvmesh run``'s own processes."""
    return secrets.token_hex(32)


TLS_ENV: Final = {"cert": "KVMESH_TLS_CERT", "key": "KVMESH_TLS_KEY", "ca": "KVMESH_TLS_CA"}


@dataclass(frozen=True)
class TlsContexts:
    """The two ends of mutual TLS for internal connections: ``server`` for listeners,
    ``client`` for dialers; both present ``cert`` and require a peer signed by ``ca``."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str) -> TlsContexts:
        if not (cert and key and ca):
            raise ValueError("TLS for internal connections needs --tls-cert, --tls-key and --tls-ca together")
        try:
            server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
            server.load_cert_chain(cert, key)
            server.verify_mode = ssl.CERT_REQUIRED
            client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
            client.check_hostname = False  # the fleet CA identifies members; see the module docstring
            client.verify_mode = ssl.CERT_REQUIRED
            client.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS files ({cert}, {key}, {ca}): {exc}") from None
        return cls(server, client)


_tls_cache: dict[tuple[str, str, str], TlsContexts | None] = {}


def process_tls() -> TlsContexts | None:
    """This process's TLS contexts from ``KVMESH_TLS_*`` (None when unset)."""
    key = (os.environ.get(TLS_ENV["cert"], ""), os.environ.get(TLS_ENV["key"], ""), os.environ.get(TLS_ENV["ca"], ""))
    if key not in _tls_cache:
        _tls_cache[key] = TlsContexts.from_files(*key) if any(key) else None
    return _tls_cache[key]


def resolve_tls(tls: TlsContexts | None | _FromEnv) -> TlsContexts | None:
    return process_tls() if isinstance(tls, _FromEnv) else tls


def looks_like_tls(data: bytes) -> bool:
    """A TLS ClientHello (record type 22, version 3.x)."""
    return len(data) >= 2 and data[0] == 0x16 and data[1] == 0x03


def looks_like_handshake(data: bytes) -> bool:
    """The first bytes from a peer that runs with a cluster secret (any version)."""
    return data[: len(_FAMILY)] == _FAMILY


class Handshake:
    """One side of the handshake, without I/O: ``start()`` is what to send first;
    ``feed(data)`` → ``(to_send, rest)``, ``rest`` None until the handshake is done,
    then the bytes that followed it. Raises :class:`AuthError` on failure (after which
    ``to_send_on_error`` may still hold the client's proof, so the server can log)."""

    __slots__ = ("_secret", "_channel", "client", "_mine", "_theirs", "_buf", "_state", "to_send_on_error", "peer")

    def __init__(self, secret: ClusterSecret, channel: str, client: bool, peer: str = "?") -> None:
        self._secret = secret
        self._channel = channel.encode()
        self.client = client
        self._mine = secrets.token_bytes(_NONCE)
        self._theirs = b""
        self._buf = bytearray()
        self._state = "hello" if not client else "proof"
        self.to_send_on_error = b""
        self.peer = peer

    @property
    def done(self) -> bool:
        return self._state == "done"

    def keys(self) -> tuple[bytes, bytes]:
        """Once done: this side's record keys, (to send with, to check the peer's with)."""
        if not self.done:
            raise AuthError("the cluster-secret handshake has not finished")
        cn, sn = (self._mine, self._theirs) if self.client else (self._theirs, self._mine)
        up, down = self._secret.frame_keys(self._channel, cn, sn)
        return (up, down) if self.client else (down, up)

    def start(self) -> bytes:
        return MAGIC + self._mine if self.client else b""

    def need(self) -> int:
        """Bytes still missing for the next step (so a stream reader never reads past it)."""
        if self.client:
            return len(MAGIC) + _NONCE + _MAC - len(self._buf)
        if self._state == "hello":
            return len(MAGIC) + _NONCE - len(self._buf)
        return _MAC - len(self._buf)

    def _proof(self, role: bytes, cn: bytes, sn: bytes) -> bytes:
        return self._secret.mac(role, self._channel, cn, sn)

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        self._buf += data
        if self.client:
            return self._client_step()
        return self._server_step()

    def _take(self, n: int) -> bytes | None:
        if len(self._buf) < n:
            return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _check_magic(self, what: str) -> None:
        head = bytes(self._buf[: len(MAGIC)])
        if MAGIC.startswith(head):
            return
        if len(head) == len(MAGIC) and head.startswith(_FAMILY):
            raise AuthError(f"{self.peer} speaks version {head[-1]} of the cluster-secret handshake, this process"
                            f" version {MAGIC[-1]}: run one kvmesh version across the fleet")  # fmt: skip
        raise AuthError(f"{self.peer} {what} (does it run without the cluster secret?)")

    def _server_step(self) -> tuple[bytes, bytes | None]:
        if self._state == "hello":
            self._check_magic("did not start the cluster-secret handshake")
            hello = self._take(len(MAGIC) + _NONCE)
            if hello is None:
                return b"", None
            self._theirs = hello[len(MAGIC) :]
            self._state = "proof"
            reply = MAGIC + self._mine + self._proof(b"server", self._theirs, self._mine)
            out, rest = self._server_step()
            return reply + out, rest
        proof = self._take(_MAC)
        if proof is None:
            return b"", None
        if not hmac.compare_digest(proof, self._proof(b"client", self._theirs, self._mine)):
            raise AuthError(f"cluster secret mismatch: {self.peer} could not prove it has this fleet's secret")
        self._state = "done"
        return b"", self._rest()

    def _client_step(self) -> tuple[bytes, bytes | None]:
        self._check_magic("did not answer the cluster-secret handshake")
        hello = self._take(len(MAGIC) + _NONCE + _MAC)
        if hello is None:
            return b"", None
        sn = self._theirs = hello[len(MAGIC) : len(MAGIC) + _NONCE]
        mine = self._proof(b"client", self._mine, sn)
        if not hmac.compare_digest(hello[len(MAGIC) + _NONCE :], self._proof(b"server", self._mine, sn)):
            self.to_send_on_error = mine  # let the server see (and log) the mismatch too
            raise AuthError(f"cluster secret mismatch: {self.peer} could not prove it has this fleet's secret")
        self._state = "done"
        return mine, self._rest()

    def _rest(self) -> bytes:
        rest = bytes(self._buf)
        self._buf.clear()
        return rest


async def handshake_streams(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    hs: Handshake,
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> bytes:
    """Run ``hs`` over an asyncio stream pair, reading nothing past it (returns b"").

    Raises :class:`AuthError` (mismatch, or the peer closed or stalled mid-way); the
    caller logs it and closes the connection."""

    async def run() -> bytes:
        first = hs.start()
        if first:
            writer.write(first)
        while True:
            data = await reader.read(max(1, hs.need()))  # never past the handshake
            if not data:
                raise AuthError(f"{hs.peer} closed the connection during the cluster-secret handshake")
            try:
                out, rest = hs.feed(data)
            except AuthError:
                if hs.to_send_on_error:
                    writer.write(hs.to_send_on_error)
                    await writer.drain()
                raise
            if out:
                writer.write(out)
                await writer.drain()
            if rest is not None:
                return rest

    try:
        return await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        raise AuthError(f"{hs.peer} did not finish the cluster-secret handshake within {timeout} s") from None
    except ConnectionError as exc:
        raise AuthError(f"{hs.peer} dropped the connection during the cluster-secret handshake: {exc}") from None


class ProtocolHandshake:
    """Runs a :class:`Handshake` inside an ``asyncio.Protocol``: create it in
    ``connection_made``, pass every ``data_received`` through :meth:`admit` until it
    opens (the gate below), call :meth:`lost` from ``connection_lost``::

        if self.auth is not None:
            data, self.auth = self.auth.admit(data)
            if not data:
                return

    ``ready`` resolves when the peer has proven itself (or fails with
    :class:`AuthError`). A failure, a stall past ``timeout`` or a close mid-way
    logs one line and closes the transport."""

    __slots__ = ("_hs", "_transport", "ready", "_timer")

    def __init__(self, hs: Handshake, transport: asyncio.BaseTransport, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        loop = asyncio.get_running_loop()
        self._hs = hs
        self._transport = cast(asyncio.Transport, transport)  # a stream connection's transport
        self.ready: asyncio.Future[None] = loop.create_future()
        self.ready.add_done_callback(_retrieve)
        first = hs.start()
        if first:
            self._transport.write(first)
        self._timer: asyncio.TimerHandle | None = loop.call_later(timeout, self._timed_out, timeout)

    def admit(self, data: bytes) -> tuple[bytes, ProtocolHandshake | None]:
        """The gate of a protocol's ``data_received``: ``data`` from the peer → (the bytes
        that may pass, the gate still to go through). While the handshake runs, or after
        it failed: (b"", self). The read that completes it: (the bytes after the
        handshake, possibly b"", None); the caller drops the gate and reads frames."""
        rest = self.feed(data)
        if rest is None:
            return b"", self
        return rest, None

    def feed(self, data: bytes) -> bytes | None:
        if self.ready.done():
            return None
        try:
            out, rest = self._hs.feed(data)
        except AuthError as exc:
            if self._hs.to_send_on_error:
                self._transport.write(self._hs.to_send_on_error)
            self._fail(exc)
            return None
        if out:
            self._transport.write(out)
        if rest is not None:
            self._cancel_timer()
            self.ready.set_result(None)
        return rest

    def keys(self) -> tuple[bytes, bytes]:
        """The record keys once the handshake is done (see :meth:`Handshake.keys`)."""
        return self._hs.keys()

    def lost(self) -> None:
        if not self.ready.done():
            self._fail(AuthError(f"{self._hs.peer} closed the connection during the cluster-secret handshake"))

    def _timed_out(self, timeout: float) -> None:
        self._timer = None
        self._fail(AuthError(f"{self._hs.peer} did not finish the cluster-secret handshake within {timeout} s"))

    def _fail(self, exc: AuthError) -> None:
        self._cancel_timer()
        if self.ready.done():
            return
        log.warning("%s: %s", "cannot connect" if self._hs.client else "refusing connection", exc.message)
        self.ready.set_exception(exc)
        self._transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


# ---------------------------------------------------------------------- records
# What follows the handshake (see the module docstring): tags over the whole stream so
# far, an implicit per-direction sequence number. The request plane's tag frames are in
# kvmesh.runtime.frames; the records below are the KV transfer's.

MAX_RECORD: Final = 1024 * 1024  # a record's body; a sender splits bigger writes
_TAG = 16
_REC = struct.Struct(">I")
AUTH_FAILED: Final = "frame authentication failed: data was altered, injected, replayed or reordered on the way"


class Keyed(Protocol):
    """A keyed MAC state (``hashlib.blake2b``, ``hmac.HMAC``), one per direction."""

    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


Mac = Callable[[bytes], Keyed]


def _blake2b(key: bytes) -> Keyed:
    return hashlib.blake2b(key=key, digest_size=_TAG)  # digest() is the tag: no slicing


def _hmac_sha256(key: bytes) -> Keyed:
    return hmac.new(key, digestmod=hashlib.sha256)


SMALL: Final[Mac] = _blake2b  # many small writes: the cheapest call (under 1 µs for 200 bytes)
BULK: Final[Mac] = _hmac_sha256  # KV chunks: OpenSSL's SHA-256 (SHA-NI) hashes ~2x faster than BLAKE2b


class Sealer:
    """One direction's sending side of records (see the module docstring).

    The MAC state absorbs every record's length and body in order and is never reset:
    a record's tag is the MAC of the whole stream up to its end, so it also covers the
    record's position (an implicit sequence number) and everything sent before it.
    ``digest()`` leaves the state as it is; no copy per record."""

    __slots__ = ("_mac",)

    def __init__(self, key: bytes, mac: Mac = BULK) -> None:
        self._mac = mac(key)

    def _tag(self, head: bytes, body: bytes | memoryview) -> bytes:
        h = self._mac
        h.update(head)
        h.update(body)
        return h.digest()[:_TAG]

    def records(self, data: bytes | memoryview) -> Iterator[bytes | memoryview]:
        """``data`` as records, piece by piece (length, a view of the body, tag): to
        write one by one, so a large payload is not copied to be sealed."""
        view = memoryview(data)
        for start in range(0, len(view), MAX_RECORD):
            body = view[start : start + MAX_RECORD]
            head = _REC.pack(len(body))
            yield head
            yield body
            yield self._tag(head, body)


class Opener:
    """One direction's receiving side of records: :meth:`size` reads a record's length
    (refused past :data:`MAX_RECORD` before anything of the record is buffered),
    :meth:`check` its tag (:class:`AuthError` on a mismatch: the connection is then
    closed, nothing after it can be trusted, and the MAC state is spent)."""

    __slots__ = ("_mac",)

    def __init__(self, key: bytes, mac: Mac = BULK) -> None:
        self._mac = mac(key)  # absorbs the stream as the Sealer's did (see Sealer)

    @staticmethod
    def size(head: bytes | memoryview) -> int:
        """A record's body length from its first bytes; AuthError past :data:`MAX_RECORD`."""
        (n,) = _REC.unpack_from(head)
        if n > MAX_RECORD:
            raise AuthError(f"frame authentication failed: a record of {n} bytes, over the limit of {MAX_RECORD}")
        return int(n)

    def check(self, tag: bytes | memoryview, *record: bytes | memoryview) -> None:
        """Raise :class:`AuthError` unless ``tag`` is the next record's (``record``: its
        length and body as they came, in one piece or more)."""
        h = self._mac
        for piece in record:
            h.update(piece)
        if not hmac.compare_digest(h.digest()[:_TAG], tag):
            raise AuthError(AUTH_FAILED)


class SealedStream:
    """An asyncio stream pair carrying records (the KV transfer's connections after the
    handshake): ``readexactly`` and ``write`` as on the plain pair. A record is read
    only when its bytes are asked for, and checked before any of them is handed out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keys: tuple[bytes, bytes], mac: Mac = BULK) -> None:
        self._reader = reader
        self._writer = writer
        self._sealer = Sealer(keys[0], mac)
        self._opener = Opener(keys[1], mac)
        self._bodies: deque[memoryview] = deque()  # checked bytes not yet read
        self._have = 0

    def write(self, *parts: bytes) -> None:
        """Each part as its own records, written piece by piece (never copied to seal)."""
        for part in parts:
            if part:
                for piece in self._sealer.records(part):
                    self._writer.write(piece)

    async def readexactly(self, n: int) -> bytes:
        while self._have < n:
            await self._record()
        return self._take(n)

    async def _record(self) -> None:
        head = await self._reader.readexactly(_REC.size)
        size = Opener.size(head)
        record = memoryview(await self._reader.readexactly(size + _TAG))
        self._opener.check(record[size:], head, record[:size])
        if size:
            self._bodies.append(record[:size])
            self._have += size

    def _take(self, n: int) -> bytes:
        bodies = self._bodies
        self._have -= n
        first = bodies[0]
        if len(first) > n:
            bodies[0] = first[n:]
            return bytes(first[:n])
        parts = []
        while n:
            body = bodies.popleft()
            if len(body) > n:
                bodies.appendleft(body[n:])
                body = body[:n]
            parts.append(body)
            n -= len(body)
        return b"".join(parts)


# ---------------------------------------------------------------------- exposure

INSECURE_WARNING_S = 60.0


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a listener on this machine: a loopback address, or
    a name that resolves to loopback addresses only. ``""`` and wildcards are not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False  # the bind fails later, with its own message
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_exposure(listeners: dict[str, str], insecure: bool) -> list[str]:
    """Before a distributed command binds its internal listeners (``{flag: host}``):
    ValueError (one line that says what to do) when one is reachable from other
    machines and this process has neither a cluster secret nor TLS, unless
    ``insecure``. Returns the listeners that run open that way (``["--host 0.0.0.0"]``;
    empty when nothing is exposed): the caller then warns with :func:`warn_insecure`."""
    exposed = [f"{flag} {host or '(every address)'}" for flag, host in listeners.items() if not is_loopback(host)]
    if not exposed or process_secret() is not None or process_tls() is not None:
        return []
    if insecure:
        return exposed
    raise ValueError(
        f"{exposed[0]} is reachable from other machines, and without cluster credentials anyone who reaches it could"
        " join this fleet: give the fleet's secret (--cluster-secret-file FILE or KVMESH_CLUSTER_SECRET_FILE), or"
        " mutual TLS (--tls-cert/--tls-key/--tls-ca), or --insecure (KVMESH_INSECURE=1) to run open anyway"
    )


def _insecure_line(where: str) -> str:
    return (f"--insecure: listening on {where} without cluster credentials: anyone who can reach it can join this"
            " fleet, read its requests and use its workers (give --cluster-secret-file)")  # fmt: skip


def warn_insecure(where: str, interval_s: float = INSECURE_WARNING_S) -> threading.Event:
    """Log the exposure now and every ``interval_s`` until the process ends (or the
    returned event is set). A daemon thread that only logs: it shares nothing with the
    event loop, and needs none (the commands own theirs)."""
    log.warning(_insecure_line(where))
    stop = threading.Event()

    def nag() -> None:
        while not stop.wait(interval_s):
            log.warning(_insecure_line(where))

    threading.Thread(target=nag, name="kvmesh-insecure-warning", daemon=True).start()
    return stop
