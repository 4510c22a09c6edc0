"""A process's own Prometheus endpoint (``GET /metrics`` of a distributed worker, of
``kvmesh worker --replicas N``'s process, of ``kvmesh planner``): a small HTTP/1.x
server on the process's event loop, bounded in everything it reads.

* at most :data:`MAX_CONNECTIONS` connections at a time; one past it is closed at once
  (no thread, no buffer per connection: an idle connection costs a socket and a timer);
* a request head of at most :data:`MAX_HEAD_BYTES`, complete within
  :data:`HEAD_TIMEOUT_S` of the connection (else it is closed); the answer, once
  written, gets as long again to leave before the connection is cut;
* ``GET`` (or ``HEAD``) ``/metrics`` only (404 elsewhere, 405 for other methods, 400 for
  a head that is not HTTP/1.x, 431 past the size); one request per connection
  (``Connection: close``: a scraper connects once per scrape);
* with a cluster secret, the fleet's metrics token is required:
  ``Authorization: Bearer <token>`` (401 otherwise), compared in constant time. The
  token is derived from the secret (:func:`metrics_token`, ``kvmesh metrics-token``
  prints it), so a scraper holds a token, never the secret itself.

The body is rendered on the loop (``prometheus_client.generate_latest``) from state the
loop owns. Where it binds (loopback unless ``--metrics-host`` says otherwise) and what
address goes into discovery (:func:`advertised_address`) is the caller's choice.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol, cast

if TYPE_CHECKING:
    from kvmesh.observability.metrics_core import Collector

__all__ = [
    "MetricsServer",
    "serve_registry",
    "metrics_token",
    "advertised_address",
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "HEAD_TIMEOUT_S",
    "TOKEN_LABEL",
]

log = logging.getLogger("kvmesh.metrics")

MAX_CONNECTIONS: Final = 32  # scrapers (an HA pair of Prometheus servers, a person with curl)
MAX_HEAD_BYTES: Final = 8 * 1024
HEAD_TIMEOUT_S: Final = 10.0  # a scraper sends its request head at once (the frontend allows as long)
TOKEN_LABEL: Final = "metrics-token"
_WILDCARDS: Final = ("", "0.0.0.0", "::")
_CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"


class _Secret(Protocol):
    """What is needed of :class:`kvmesh.runtime.auth.ClusterSecret` (not imported: the
    runtime is no lower layer than observability)."""

    def derive(self, label: str) -> bytes: ...


def metrics_token(secret: _Secret) -> str:
    """The fleet's metrics token: 64 hex digits only holders of the secret can compute."""
    return secret.derive(TOKEN_LABEL).hex()


def advertised_address(bound: str, host: str, port: int) -> str:
    """``host:port`` others reach the endpoint at: the bound address, or the process's
    advertised ``host`` when bound to every interface (an IPv6 literal in brackets)."""
    name = host if bound in _WILDCARDS else bound
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


def _answer(status: bytes, body: bytes, *extra: bytes, head_only: bool = False) -> bytes:
    content_type = _CONTENT_TYPE if status.startswith(b"200") else b"text/plain; charset=utf-8"
    lines = [b"HTTP/1.1 " + status, b"Content-Type: " + content_type, b"Content-Length: %d" % len(body)]
    lines += [*extra, b"Connection: close", b"", b""]
    return b"\r\n".join(lines) + (b"" if head_only else body)


def _bad(status: bytes, message: str, *extra: bytes) -> bytes:
    return _answer(status, message.encode() + b"\n", *extra)


_UNAUTHORIZED: Final = _bad(
    b"401 Unauthorized",
    "this fleet has a cluster secret: /metrics needs 'Authorization: Bearer <token>'"
    " (`kvmesh metrics-token --cluster-secret-file FILE` prints the token)",
    b'WWW-Authenticate: Bearer realm="kvmesh metrics"',
)
_NOT_FOUND: Final = _bad(b"404 Not Found", "only /metrics is served here")
_NOT_ALLOWED: Final = _bad(b"405 Method Not Allowed", "only GET /metrics is served here", b"Allow: GET, HEAD")
_TOO_LARGE: Final = _bad(b"431 Request Header Fields Too Large", f"a request head of at most {MAX_HEAD_BYTES} bytes")
_MALFORMED: Final = _bad(b"400 Bad Request", "not an HTTP/1.x request: send 'GET /metrics HTTP/1.1'")
_FAILED: Final = _bad(b"500 Internal Server Error", "the metrics could not be rendered (see the process's log)")


class MetricsServer:
    """``/metrics`` as ``render()`` makes it, on ``host:port`` (see the module
    docstring); ``secret``: the fleet's cluster secret (None: no token asked)."""

    def __init__(self, render: Callable[[], bytes], secret: _Secret | None) -> None:
        self._render = render
        self._token = metrics_token(secret).encode() if secret is not None else None
        self._server: asyncio.Server | None = None
        self.open: set[_Connection] = set()  # the admitted connections

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (``port`` 0: any free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(functools.partial(_Connection, self), host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.open):
            conn.abort()
        await self._server.wait_closed()

    def answer(self, head: bytes) -> bytes:
        """The whole response to one request head (without its blank line)."""
        request_line, _, headers = head.partition(b"\r\n")
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _MALFORMED
        method, target, _version = parts
        if self._token is not None and not self._authorized(headers):
            return _UNAUTHORIZED
        if target.partition(b"?")[0] != b"/metrics":
            return _NOT_FOUND
        if method not in (b"GET", b"HEAD"):
            return _NOT_ALLOWED
        try:
            body = self._render()
        except Exception:  # a collector's fault, not the client's
            log.exception("rendering /metrics failed")
            return _FAILED
        return _answer(b"200 OK", body, head_only=method == b"HEAD")

    def _authorized(self, headers: bytes) -> bool:
        assert self._token is not None
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                scheme, _, credentials = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self._token)
        return False


class _Connection(asyncio.Protocol):
    """One client: a bounded head, one answer, then closed (timer-bounded throughout)."""

    __slots__ = ("_server", "_transport", "_head", "_timer", "_answered")

    def __init__(self, server: MetricsServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's transports are no subclass of it
        if len(self._server.open) >= MAX_CONNECTIONS:
            stream.abort()  # past the cap: closed at once, nothing read
            return
        self._transport = stream
        self._server.open.add(self)
        self._timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self.abort)

    def data_received(self, data: bytes) -> None:
        if self._answered or self._transport is None:
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end > MAX_HEAD_BYTES or (end < 0 and len(self._head) > MAX_HEAD_BYTES + 3):
            self._respond(_TOO_LARGE)
        elif end >= 0:
            self._respond(self._server.answer(bytes(self._head[:end])))

    def eof_received(self) -> bool:
        return False  # a half-closed client has sent all it will: close

    def _respond(self, response: bytes) -> None:
        assert self._transport is not None and self._timer is not None
        self._answered = True
        self._head = bytearray()
        self._transport.pause_reading()
        self._transport.write(response)
        self._transport.close()  # once written; a client that does not read is cut at the timer
        self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self.abort)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server.open.discard(self)


async def serve_registry(
    registry: Collector, host: str, port: int, secret: _Secret | None
) -> tuple[MetricsServer, int]:
    """A started :class:`MetricsServer` for ``registry`` (a ``prometheus_client`` registry
    or a :class:`~kvmesh.observability.metrics_core.MetricsRegistry`) and its bound port."""
    from prometheus_client import generate_latest

    server = MetricsServer(functools.partial(generate_latest, registry), secret)
    return server, await server.start(host, port)
