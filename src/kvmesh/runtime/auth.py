"""The cluster secret: which processes belong to one kvmesh fleet.

Every process of a fleet is given the same secret (``--cluster-secret-file FILE``,
``KVMESH_CLUSTER_SECRET_FILE``, or the secret itself in ``KVMESH_CLUSTER_SECRET``;
``kvmesh run`` makes a random one for its own processes). With a secret set:

* every internal TCP connection (request plane, NATS call-home, KV transfer) starts
  with a mutual challenge–response :class:`Handshake`; a peer that cannot prove it
  knows the secret is refused before a single frame is read;
* messages on NATS subjects (requests, prefill jobs, event envelopes) and discovery
  records carry an HMAC that receivers check (:meth:`ClusterSecret.sign` /
  :meth:`ClusterSecret.verify`);
* the zmq event plane uses CURVE with key pairs derived from the secret
  (:meth:`ClusterSecret.derive`).

The handshake (``cn``, ``sn``: 16 random bytes chosen by the client and the server for
this connection; ``channel``: what the connection is for, e.g. ``request``)::

    client → server   MAGIC cn
    server → client   MAGIC sn HMAC(secret, "server" channel cn sn)
    client → server   HMAC(secret, "client" channel cn sn)        then frames

Each side proves knowledge of the secret over the other side's fresh nonce, so a
recorded exchange cannot be replayed, a proof cannot be reflected back (the role is
in the MAC) and one channel's proof does not open another. The secret never crosses
the wire. A client whose server's proof is wrong still sends its own proof before it
closes, so both sides log the mismatch; nothing waits longer than the handshake
timeout.

Without a secret nothing changes on the wire (no handshake, no MACs).

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
import logging
import os
import secrets
import ssl
from dataclasses import dataclass
from typing import Final, cast

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
]

log = logging.getLogger("kvmesh.auth")

MAGIC: Final = b"KVM\x01"
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
    """The first bytes from a peer that runs with a cluster secret."""
    return data[: len(MAGIC)] == MAGIC


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
        if not MAGIC.startswith(head):
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
        sn = hello[len(MAGIC) : len(MAGIC) + _NONCE]
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
