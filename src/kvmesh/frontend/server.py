"""The frontend's HTTP/1.1 server: one asyncio protocol per connection over
httptools' parser, calling :class:`HttpApp` handlers directly (no ASGI layer).

Why its own server: under streaming load, one SSE event per token crossed uvicorn's
ASGI ``send`` (a message dict, header checks) and three Starlette middleware wrappers
before reaching the socket, a listener task per stream watched for disconnects, and
importing uvicorn + Starlette cost ~90 ms of every launch (docs/performance.md). Here
a streamed event is at most one ``transport.write`` (the events a stream writes in one
loop iteration after its first share one: :class:`ResponseStream`) and a disconnect is
a callback.

Per connection (:class:`_Connection`):

1. requests are parsed as bytes arrive; when a head is complete the app's
   ``authorize`` hook (if any) may refuse it before a byte of its body is read; a
   complete request (body read in full, bounded by the app's ``max_body_bytes``) waits
   in a queue; requests are served one at a time in arrival order (pipelining), each
   in its own task; reading pauses while ``max_pipelined`` requests or
   ``max_pipelined_bytes`` of bodies wait;
2. a handler returns a :class:`Response` (written at once with ``content-length``)
   or a streaming response (``await response.send_to(out)``, where ``out`` is the
   connection's :class:`ResponseStream`: chunked transfer coding, a stream's first
   write of a loop iteration sent at once, later ones of that iteration sent together
   at the start of the next);
3. the connection closing (client gone) marks the stream ``disconnected`` and calls
   its ``on_disconnect``; ``pause_writing`` makes the stream's ``drain()`` wait;
4. an idle keep-alive connection is closed after ``keepalive_timeout_s``; one older
   than ``max_connection_age_s`` takes no new request.

Admission: past ``max_connections`` open connections (lowered to what the open-file
limit allows: :func:`plan_descriptors`), or ``max_connections_per_client`` from one
address, a new connection gets a canned 503 and is closed.

:meth:`HttpServer.serve` runs the app's lifespan around listening, and returns after
``should_exit`` (SIGINT/SIGTERM set it): stop listening, close idle connections, give
in-flight requests ``timeout_graceful_shutdown`` seconds, then close the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import ipaddress
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import httptools

from kvmesh.config import HttpLimits

__all__ = [
    "bind_http",
    "plan_descriptors",
    "DescriptorPlan",
    "HttpServer",
    "HttpApp",
    "Request",
    "Response",
    "ResponseStream",
    "StreamingResponse",
    "WriteTicks",
]

log = logging.getLogger("kvmesh.http")

_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"


def bind_http(host: str, port: int) -> socket.socket:
    """Bind and listen; OSError (e.g. address in use) propagates to the caller."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


# ---------------------------------------------------------------------------- values


class Request:
    """One parsed request. ``headers``: lower-case names → last value."""

    __slots__ = ("method", "path", "query", "headers", "body", "body_size", "keep_alive", "http_version",
                 "on_disconnect", "disconnected", "checked", "principal", "tenant")  # fmt: skip

    def __init__(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes, body_size: int,
        keep_alive: bool, http_version: str,
    ) -> None:  # fmt: skip
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.body_size = body_size  # bytes received; > len(body) when over the app's limit
        self.keep_alive = keep_alive
        self.http_version = http_version
        # set by a handler that wants to know when the client goes away mid-request
        # (a non-streamed completion stops its generation)
        self.on_disconnect: Callable[[], None] | None = None
        self.disconnected = False  # the client left while this request was being served
        # set by the app's authorize hook (HttpApp.authorize) when it admitted the request at
        # its head: who the caller is, so that the handler need not check the key again
        self.checked = False
        self.principal: str | None = None
        self.tenant: Any = None  # the caller's TenantPolicy (kvmesh.frontend.tenants), when its key has one

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)


class Response:
    """A complete response: status, body, content type and extra headers."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(
        self, body: bytes = b"", status: int = 200, content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers if headers is not None else {}


class StreamingResponse(Protocol):
    async def send_to(self, out: ResponseStream) -> None: ...


Handler = Callable[[Request], Awaitable["Response | StreamingResponse"]]


@contextlib.asynccontextmanager
async def _no_lifespan() -> AsyncIterator[None]:
    yield


@dataclass(eq=False)
class HttpApp:
    """Routes (path → method → handler); what to answer for 404, 405, a handler's
    exception and a request the server refuses (``protocol_error(status, message)``:
    400 unparsable, 413 declared body over ``max_body_bytes``); a lifespan context
    manager run around serving.

    ``authorize(request)``, if set, runs once per request as soon as its head is
    complete, before a byte of its body is read (``request.body`` is still empty): a
    Response refuses the request (it is answered in turn, the body is never buffered,
    the connection closes); None admits it, and the hook may note who the caller is
    (``request.checked``, ``request.principal``) so that the handler does not check
    again. It must be cheap and must not block: it runs inside the parser."""

    routes: dict[str, dict[str, Handler]]
    not_found: Callable[[Request], Response]
    bad_method: Callable[[Request], Response]
    on_error: Callable[[BaseException], Response]
    protocol_error: Callable[[int, str], Response]
    lifespan: Callable[[], contextlib.AbstractAsyncContextManager[None]] = _no_lifespan
    max_body_bytes: int = 4 * 1024 * 1024
    limits: HttpLimits = field(default_factory=HttpLimits)
    authorize: Callable[[Request], Response | None] | None = None

    async def handle(self, request: Request) -> Response | StreamingResponse:
        methods = self.routes.get(request.path)
        if methods is None:
            return self.not_found(request)
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            return self.bad_method(request)
        try:
            return await handler(request)
        except Exception as exc:  # noqa: BLE001 - every error becomes one response
            return self.on_error(exc)


# ---------------------------------------------------------------------------- writing

_status_lines: dict[int, bytes] = {}
_date: list[Any] = [0, b""]  # [second, the date header for it]


def _status_line(status: int) -> bytes:
    line = _status_lines.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _status_lines[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode()
    return line


def _date_header() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0] = now
        _date[1] = time.strftime("date: %a, %d %b %Y %H:%M:%S GMT\r\n", time.gmtime(now)).encode()
    header: bytes = _date[1]
    return header


def _head(status: int, headers: list[tuple[bytes, bytes]], extra: bytes) -> bytes:
    parts = [_status_line(status), _date_header()]
    for name, value in headers:
        if b"\r" in value or b"\n" in value:
            raise ValueError(f"invalid value for header {name!r}")
        parts += (name, b": ", value, b"\r\n")
    parts += (extra, b"\r\n")
    return b"".join(parts)


class WriteTicks:
    """Event-loop iterations, counted on demand, for write coalescing: :meth:`touch`
    returns the current iteration's number and makes sure it advances at the start of
    the next one (one ``call_soon`` per iteration, shared by every stream); streams
    that held bytes back in an iteration (:meth:`hold`) flush them then, before the
    next iteration's I/O callbacks run."""

    __slots__ = ("count", "_scheduled", "_held")

    def __init__(self) -> None:
        self.count = 0
        self._scheduled = False
        self._held: list[ResponseStream] = []

    def touch(self) -> int:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._advance)
        return self.count

    def hold(self, stream: ResponseStream) -> None:
        self._held.append(stream)

    def _advance(self) -> None:
        self._scheduled = False
        self.count += 1
        held, self._held = self._held, []
        for stream in held:
            stream.flush()


class ResponseStream:
    """Where a streaming response writes: ``start`` (status and headers), ``write``
    (one chunk per call), ``end`` (optionally with a last chunk, in the same write).
    The head goes out with the first chunk (one write, not two). ``disconnected``
    turns true, and ``on_disconnect`` runs, when the client goes away;
    ``paused``/``drain()`` give the socket's flow control.

    Writes are coalesced per loop iteration: a stream's first write in an iteration
    goes out at once (a first token, or a token after a quiet spell, is never
    delayed); what it writes after that in the same iteration is held and sent as one
    write at the start of the next iteration (``ticks``), or with ``end``'s tail."""

    __slots__ = ("_transport", "_chunked", "_keep_alive", "_head", "ended", "disconnected",
                 "on_disconnect", "paused", "_drained", "_ticks", "_tick", "_held", "writes")  # fmt: skip

    def __init__(self, conn: _Connection, chunked: bool, keep_alive: bool, ticks: WriteTicks | None = None) -> None:
        if conn.transport is None:  # a response starts only on a connection that delivered its request
            raise RuntimeError("a response needs a connected transport")
        self._transport: asyncio.Transport = conn.transport
        self._chunked = chunked
        self._keep_alive = keep_alive
        self._head: bytes | None = None  # set by start(), written with the first chunk
        self.ended = False
        self.disconnected = False
        self.on_disconnect: Callable[[], None] | None = None
        self.paused = False
        self._drained: asyncio.Future[None] | None = None
        self._ticks = ticks if ticks is not None else WriteTicks()
        self._tick = -1  # the iteration of the last write that went out at once
        self._held: list[bytes] | None = None  # written since, in that iteration
        self.writes = 0  # transport writes (observability, tests)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        extra = (_CHUNKED if self._chunked else b"") + (b"" if self._keep_alive else _CLOSE)
        self._head = _head(status, headers, extra)

    @property
    def head_pending(self) -> bool:
        """Nothing of the response went out yet (``start`` or not)."""
        return self._head != b""

    def write(self, data: bytes) -> None:
        if self.disconnected or self.ended or not data:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        held = self._held
        if held is not None:
            held.append(data)
            return
        ticks = self._ticks
        if self._tick == ticks.count and not self._head:  # wrote at once in this iteration already
            self._held = [data]
            ticks.hold(self)
            return
        if self._head:
            data = self._head + data
            self._head = b""
        self._tick = ticks.touch()
        self.writes += 1
        self._transport.write(data)

    def flush(self) -> None:
        """Send what was held back (called by ``ticks`` at the next iteration)."""
        held, self._held = self._held, None
        if held and not self.disconnected and not self.ended:
            self.writes += 1
            self._transport.write(b"".join(held))

    def end(self, data: bytes = b"") -> None:
        if self.ended:
            return
        self.ended = True
        held, self._held = self._held, None
        if self.disconnected:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        if held:
            data = b"".join(held) + data
        if self._head:
            data = self._head + data
            self._head = b""
        if data:
            self.writes += 1
            self._transport.write(data)

    async def drain(self) -> None:
        while self.paused and not self.disconnected:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    # -- called by the connection
    def _lost(self) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        self._held = None
        self._wake()
        if self.on_disconnect is not None and not self.ended:
            self.on_disconnect()

    def _pause(self, paused: bool) -> None:
        self.paused = paused
        if not paused:
            self._wake()

    def _wake(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


# ---------------------------------------------------------------------------- connection


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class _Refused(Exception):
    """The app's authorize hook refused a request at its head."""

    def __init__(self, response: Response) -> None:
        self.response = response


class _Connection(asyncio.Protocol):
    """One client connection. Limits (``HttpLimits``) are enforced as bytes arrive:
    the URL and each header as httptools reports them, an unfinished head by the raw
    bytes fed since its first chunk, the body by its declared length (or the running
    total of its chunks). Timeouts are deadlines the server's sweeper checks:
    ``request_since`` (the whole request being read), ``head_since`` (a head in
    progress), ``body_since`` (last piece of a body) and ``body_began`` (its average
    rate), ``write_since`` (the client stopped reading), ``idle_since`` (between
    requests), ``opened`` (the connection's age). Reading pauses while responses cannot
    be written or too many requests (or bytes of bodies) wait; the read deadlines do
    not run while the server itself does not read."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.limits = server.config.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.queued_bytes = 0  # bodies of the requests in ``queue``
        self.task: asyncio.Task[None] | None = None
        self.out: ResponseStream | None = None
        self.current: Request | None = None  # the request being served
        self.closing = False  # no new request will be served
        self.retiring = False  # past max_connection_age: requests parsed from now on are the last
        self.discarding = False  # refused: input is dropped until the connection closes
        self.refusal: Response | None = None  # a refusal answered after the requests before it
        self.client: str | None = None  # the address counted in server.clients (None: not counted)
        self.reading_paused = False
        self.paused_at = 0.0  # when the server paused reading (its read deadlines stand still)
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        # deadlines (loop time; None: not in that phase)
        now = self.loop.time()
        self.opened = now
        self.head_since: float | None = now  # the first request's head must come within header_timeout
        self.request_since: float | None = None
        self.body_since: float | None = None
        self.body_began: float | None = None
        self.write_since: float | None = None
        self.idle_since: float | None = None
        # the request being parsed
        self._request: Request | None = None  # made when its head is complete
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0  # URL + completed headers, as httptools reports them
        self._head_raw = 0  # bytes fed while the head spans several chunks
        self._begun_here = False  # the current message began in the chunk being fed
        self._header_count = 0
        self._body: list[bytes] = []
        self._size = 0
        self._limit = self.app.max_body_bytes

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._over_capacity(_OVER_CAPACITY)
            return
        client = _client_of(transport.get_extra_info("peername"))
        held = server.clients.get(client, 0)
        if held >= self.limits.max_connections_per_client:
            self._over_capacity(_CLIENT_OVER_CAPACITY)
            return
        server.clients[client] = held + 1
        self.client = client
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # SSE events leave as soon as they are written
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        server.connections.add(self)

    def _over_capacity(self, answer: bytes) -> None:
        """Past ``max_connections`` (or the client's share): one canned 503 and close, nothing parsed."""
        self.closing = self.discarding = True
        self.head_since = None
        self.server.refused += 1
        assert self.transport is not None
        self.transport.write(answer)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        server = self.server
        server.connections.discard(self)
        client, self.client = self.client, None
        if client is not None:
            left = server.clients[client] - 1
            if left:
                server.clients[client] = left
            else:
                del server.clients[client]
        self.closing = True
        self.queue.clear()
        self.refusal = None
        self.head_since = self.request_since = self.body_since = self.write_since = self.idle_since = None
        self._wake_writable()
        if self.out is not None:
            self.out._lost()
        current = self.current
        if current is not None:
            current.disconnected = True
            callback, current.on_disconnect = current.on_disconnect, None
            if callback is not None:
                callback()

    def eof_received(self) -> bool | None:
        return None  # close our side too: the client is gone

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_since = self.loop.time()
        self._update_reading()
        if self.out is not None:
            self.out._pause(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        self.write_since = None
        self._update_reading()
        self._wake_writable()
        if self.out is not None:
            self.out._pause(False)

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        self._begun_here = False
        try:
            self.parser.feed_data(data)
            if self.head_since is not None and not self._begun_here and self._size == 0:
                self._count_raw_head(len(data))
        except _BadRequest as exc:
            self._refuse(exc.status, exc.message)
        except _Refused as exc:
            self._refuse_with(exc.response)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _BadRequest):
                self._refuse(cause.status, cause.message)
            elif isinstance(cause, _Refused):
                self._refuse_with(cause.response)
            else:
                self._refuse(400, f"invalid HTTP request: {exc}")

    def _count_raw_head(self, n: int) -> None:
        """A head still unfinished after a whole chunk: every byte of it is head (an
        endless header value is buffered inside httptools, with no callback)."""
        if not self._url and not self._header_count and self.idle_since is not None:
            return  # between requests: nothing of a new one was seen
        self._head_raw += n
        if self._head_raw > self.limits.max_header_bytes:
            raise _BadRequest(431, f"the request head exceeds {self.limits.max_header_bytes} bytes")

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.idle_since = None
        if self.head_since is None:
            self.head_since = self.loop.time()
        self.request_since = self.head_since  # the whole request must come within request_read_timeout
        self._begun_here = True
        self._url = b""
        self._headers = {}
        self._head_bytes = self._head_raw = self._header_count = 0
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_url_bytes:
            raise _BadRequest(414, f"the URL exceeds {self.limits.max_url_bytes} bytes")
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._header_count += 1
        limits = self.limits
        if self._head_bytes > limits.max_header_bytes:
            raise _BadRequest(431, f"the request head exceeds {limits.max_header_bytes} bytes")
        if self._header_count > limits.max_headers:
            raise _BadRequest(431, f"the request has more than {limits.max_headers} headers")
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_since = None
        headers = self._headers
        path, _, query = self._url.decode("latin-1").partition("?")
        method = self.parser.get_method().decode("ascii", "replace")
        request = self._request = Request(method, path, query, headers, b"", 0, False, self.parser.get_http_version())
        authorize = self.app.authorize
        if authorize is not None:
            refusal = authorize(request)
            if refusal is not None:  # before the body: not a byte of it is read
                raise _Refused(refusal)
        declared = headers.get("content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self._limit:  # answer before the body comes
                raise _BadRequest(413, f"the request body has {declared} bytes; the limit is {self._limit} bytes")
            if declared != "0":
                self.body_since = self.body_began = self.loop.time()
        elif "transfer-encoding" in headers:
            self.body_since = self.body_began = self.loop.time()
        if headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._limit:  # a chunked body past the limit: stop here
            raise _BadRequest(413, f"the request body exceeds the limit of {self._limit} bytes")
        self._body.append(body)
        self.body_since = self.loop.time()

    def on_message_complete(self) -> None:
        self.request_since = self.body_since = self.body_began = None
        request, self._request = self._request, None
        assert request is not None  # httptools calls on_headers_complete first
        request.body = body = b"".join(self._body)
        request.body_size = self._size
        request.keep_alive = self.parser.should_keep_alive() and not (self.closing or self.retiring)
        self._body = []
        self.queue.append(request)
        self.queued_bytes += len(body)
        self._update_reading()
        self._next()

    # -- flow control
    def _update_reading(self) -> None:
        """Read while fewer than ``max_pipelined`` requests (and ``max_pipelined_bytes``
        of their bodies) wait and responses can be written."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        queued = len(self.queue)
        limits = self.limits
        if self.reading_paused:
            if not self.write_paused and queued <= limits.max_pipelined // 2 and self.queued_bytes < limits.max_pipelined_bytes:
                self.reading_paused = False
                self._postpone_read_deadlines(self.loop.time() - self.paused_at)
                transport.resume_reading()
        elif self.write_paused or queued >= limits.max_pipelined or self.queued_bytes >= limits.max_pipelined_bytes:
            self.reading_paused = True
            self.paused_at = self.loop.time()
            transport.pause_reading()

    def _postpone_read_deadlines(self, paused: float) -> None:
        """Reading resumes after ``paused`` s: the time the server did not read is not
        the client's (its silence starts over)."""
        if self.request_since is not None:
            self.request_since += paused
        if self.head_since is not None:
            self.head_since += paused
        if self.body_began is not None:
            self.body_began += paused
        if self.body_since is not None:
            self.body_since = self.loop.time()

    async def _wait_writable(self) -> None:
        while self.write_paused and not self.closing:
            if self._writable is None:
                self._writable = self.loop.create_future()
            await self._writable

    def _wake_writable(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- serving
    def _next(self) -> None:
        if self.task is not None or not self.queue or self.transport is None:
            return
        request = self.queue.popleft()
        self.queued_bytes -= len(request.body)
        self._update_reading()
        self.task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        keep_alive = request.keep_alive
        self.current = request
        try:
            response = await self.app.handle(request)
            request.on_disconnect = None
            keep_alive = keep_alive and not self.server.exiting
            if isinstance(response, Response):
                self._write_response(response, request, keep_alive)
            else:
                keep_alive = await self._stream(response, request, keep_alive)
            if self.write_paused:  # the client is not reading: serve nothing more until it does
                await self._wait_writable()
        except Exception:  # noqa: BLE001 - e.g. a header value the app should not have set
            log.exception("answering %s %s failed", request.method, request.path)
            keep_alive = False
        finally:
            self.task = None
            self.current = None
            self._after(keep_alive)

    def _after(self, keep_alive: bool) -> None:
        """A response is out: serve the next request, answer a refusal that waited for
        the requests before it, or go idle (or close)."""
        if not keep_alive or (self.closing and self.refusal is None):
            self.closing = True
            if self.transport is not None:
                self.transport.close()
        elif self.queue:
            self._next()
        elif self.refusal is not None:
            self._answer_and_linger(self.refusal)
        elif self.head_since is None and self.body_since is None:
            self.idle_since = self.loop.time()

    async def _stream(self, response: StreamingResponse, request: Request, keep_alive: bool) -> bool:
        """Run a streaming response; False when the connection must close after it."""
        chunked = request.http_version != "1.0"
        self.out = out = ResponseStream(self, chunked, keep_alive and chunked, self.server.write_ticks)
        if self.transport is None or self.transport.is_closing():
            out._lost()
        elif self.write_paused:
            out._pause(True)
        try:
            await response.send_to(out)
            out.end()
            return keep_alive and chunked
        except Exception as exc:  # noqa: BLE001 - a broken stream ends the connection, not the server
            if out.head_pending:  # nothing sent yet: a plain error response
                self._write_response(self.app.on_error(exc), request, False)
            else:
                log.exception("stream for %s %s failed", request.method, request.path)
            return False
        finally:
            self.out = None

    def _write_response(self, response: Response, request: Request, keep_alive: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        headers = [(b"content-type", response.content_type.encode("latin-1"))]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
        body = response.body
        extra = b"content-length: %d\r\n" % len(body) + (b"" if keep_alive else _CLOSE)
        head = _head(response.status, headers, extra)
        self.transport.write(head if request.method == "HEAD" else head + body)

    def _refuse(self, status: int, message: str) -> None:
        self._refuse_with(self.app.protocol_error(status, message))

    def _refuse_with(self, response: Response) -> None:
        """A request we cannot parse or will not take: stop reading it, answer it after
        the requests before it (if any), and close once the answer is out. Input that
        keeps coming is dropped, never buffered (a lingering close: the client gets to
        read the answer instead of a reset)."""
        self.closing = self.discarding = True
        self.head_since = self.request_since = self.body_since = self.body_began = self.idle_since = None
        self._body = []
        self._request = None
        if self.transport is None:
            return
        if self.task is not None or self.queue:
            self.refusal = response  # answered in turn (_after)
            return
        self._answer_and_linger(response)

    def _answer_and_linger(self, response: Response) -> None:
        self.refusal = None
        self.queue.clear()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._write_response(response, _NO_REQUEST, False)
        if transport.can_write_eof():
            transport.write_eof()
            self.linger_until = self.loop.time() + _LINGER_S
        else:
            transport.close()

    def shutdown(self) -> None:
        """Server exiting: close now if idle, else after the response in flight."""
        self.closing = True
        self.refusal = None
        if self.task is None and self.transport is not None:
            self.transport.close()

    linger_until: float | None = None

    def check(self, now: float) -> None:
        """The sweeper's look at this connection's deadlines."""
        limits = self.limits
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.linger_until is not None:
            if now >= self.linger_until:
                transport.close()
            return
        overdue = None if self.reading_paused else self._read_overdue(now)  # a pause of ours is not the client's
        if overdue is not None:
            self._timed_out(overdue)
        elif self.write_since is not None and now - self.write_since > limits.send_timeout_s:
            log.info("closing a connection whose client stopped reading")
            transport.abort()  # the buffered response will never be read
        elif self.idle_since is not None and self.task is None and now - self.idle_since > limits.keepalive_timeout_s:
            transport.close()
        elif not self.retiring and now - self.opened > limits.max_connection_age_s:
            self.retiring = True  # requests parsed from now on get "connection: close"

    def _read_overdue(self, now: float) -> str | None:
        """Why the request being read is late, if it is."""
        limits = self.limits
        if self.request_since is not None and now - self.request_since > limits.request_read_timeout_s:
            return f"the request was not read in full within {limits.request_read_timeout_s:g} s"
        if self.head_since is not None and now - self.head_since > limits.header_timeout_s:
            return "the request head did not arrive in time"
        if self.body_since is None:
            return None
        if now - self.body_since > limits.body_timeout_s:
            return "the request body stalled"
        spent = now - cast(float, self.body_began)
        if spent > limits.body_rate_grace_s and self._size < limits.min_body_rate * spent:
            return f"the request body arrived at {self._size / spent:.0f} bytes/s; at least {limits.min_body_rate} bytes/s is needed"
        return None

    def _timed_out(self, why: str) -> None:
        self.server.timed_out += 1
        if self.task is None and (self._url or self._header_count or self._size):
            self._refuse(408, why)
        else:  # nothing said yet, or a response in flight: just close
            self.closing = self.discarding = True
            self.head_since = self.request_since = self.body_since = self.body_began = None
            if self.transport is not None:
                self.transport.close()


def _client_of(peer: object) -> str:
    """What ``max_connections_per_client`` counts a connection against: its IP address;
    an IPv6 address by its /64 (a single host is commonly given a whole /64)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return ""  # e.g. a Unix socket
    host = peer[0]
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return address.packed[:8].hex() + "::/64"


_NO_REQUEST = Request("GET", "", "", {}, b"", 0, False, "1.1")
_LINGER_S = 2.0


def _unavailable(message: str) -> bytes:
    """A canned 503 (written before anything is parsed: no app involved)."""
    body = b'{"error":{"message":"%s","type":"resource_exhausted","param":null,"code":503}}' % message.encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )


_OVER_CAPACITY = _unavailable("too many open connections; retry later")
_CLIENT_OVER_CAPACITY = _unavailable(
    "too many open connections from your address; close idle ones or retry later (--max-connections-per-client)"
)


# ---------------------------------------------------------------------------- descriptors

_FD_RESERVE = 256  # kept from client connections: worker connections, discovery/event planes, files, pipes


@dataclass(frozen=True)
class DescriptorPlan:
    """What :func:`plan_descriptors` decided: the soft open-file limit to set, how many
    client connections fit under it, and the descriptors kept for everything else."""

    soft: int | None  # None: unlimited
    connections: int
    reserve: int


def plan_descriptors(wanted: int, soft: int | None, hard: int | None, open_now: int) -> DescriptorPlan:
    """``wanted`` client connections (``--max-connections``) under the open-file limit
    ``soft`` (``hard``: the most it may be raised to; None: unlimited), with ``open_now``
    descriptors open already. The soft limit is raised toward the hard one, far enough
    for ``wanted`` plus a reserve (:data:`_FD_RESERVE` and what is open now, never more
    than half the limit); the connections are what the limit then allows less the
    reserve, at most ``wanted``: past it a client gets a 503 rather than the frontend an
    ``EMFILE`` on its next worker connection, file or accept."""
    need = wanted + _FD_RESERVE + open_now
    if soft is not None and soft < need:
        soft = need if hard is None else max(soft, min(need, hard))
    if soft is None:
        return DescriptorPlan(None, wanted, _FD_RESERVE + open_now)
    reserve = min(_FD_RESERVE + open_now, soft // 2)
    return DescriptorPlan(soft, max(1, min(wanted, soft - reserve)), reserve)


def _apply_descriptor_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE as :func:`plan_descriptors` says (where allowed) and
    return the effective connection cap; logged once (a warning when below ``wanted``)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    known = None if soft == resource.RLIM_INFINITY else soft
    plan = plan_descriptors(wanted, known, None if hard == resource.RLIM_INFINITY else hard, _open_descriptors())
    if plan.soft != known and plan.soft is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (plan.soft, hard))
            log.info("open-file limit (RLIMIT_NOFILE) raised from %d to %d for --max-connections %d", soft, plan.soft, wanted)
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, plan.soft, exc)
            plan = plan_descriptors(wanted, known, known, _open_descriptors())
    if plan.connections < wanted:
        log.warning(
            "HTTP connections capped at %d (--max-connections %d): the open-file limit is %s (hard %s), %d of it "
            "kept for workers and files; raise it (ulimit -n) to serve more", plan.connections, wanted, plan.soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard, plan.reserve,
        )  # fmt: skip
    else:
        log.info("HTTP connections capped at %d (open-file limit %s)", plan.connections, plan.soft or "unlimited")
    return plan.connections


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume a few
        return 16


# ---------------------------------------------------------------------------- server


@dataclass
class ServerConfig:
    limits: HttpLimits = field(default_factory=HttpLimits)
    timeout_graceful_shutdown: float | None = None  # None: wait for in-flight requests


class ExitFlag:
    """``should_exit``, as a server's owner sets it (once) to make ``serve`` return."""

    _exit: asyncio.Event

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()


class HttpServer(ExitFlag):
    """Serves an :class:`HttpApp` on sockets bound beforehand (see module docstring)."""

    def __init__(self, app: HttpApp, config: ServerConfig | None = None) -> None:
        self.app = app
        self.config = config or ServerConfig()
        self.connections: set[_Connection] = set()
        self.servers: list[asyncio.Server] = []
        self.started = False
        self.exiting = False
        self.refused = 0  # connections turned away past max_connections (or a client's share)
        # the effective cap: max_connections, lowered in serve() to what the open-file limit allows
        self.max_connections = self.config.limits.max_connections
        self.clients: dict[str, int] = {}  # open connections per client address (_client_of)
        self.timed_out = 0  # connections closed by a header/body timeout
        self.write_ticks = WriteTicks()  # streamed writes coalesce per loop iteration
        self._exit = asyncio.Event()
        self._force = False

    def _on_signal(self) -> None:
        if self._exit.is_set():
            self._force = True  # a second signal: do not wait for in-flight requests
        self._exit.set()

    async def serve(self, sockets: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        previous = _install_signals(loop, self._on_signal)
        sweeper = None
        try:
            self.max_connections = _apply_descriptor_limit(self.config.limits.max_connections)
            async with self.app.lifespan():
                for sock in sockets:
                    self.servers.append(await loop.create_server(lambda: _Connection(self), sock=sock, backlog=2048))
                self.started = True
                sweeper = loop.create_task(self._sweep())
                await self._exit.wait()
                await self._shutdown()
        finally:
            if sweeper is not None:
                sweeper.cancel()
                await asyncio.gather(sweeper, return_exceptions=True)
            _restore_signals(loop, previous)

    async def _sweep(self) -> None:
        """Checks every connection's deadlines a few times per shortest timeout."""
        limits = self.config.limits
        shortest = min(
            limits.header_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s, limits.send_timeout_s,
            limits.request_read_timeout_s, limits.body_rate_grace_s, limits.max_connection_age_s,
        )  # fmt: skip
        tick = min(max(shortest / 4, 0.02), 1.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for conn in list(self.connections):
                conn.check(now)

    async def _shutdown(self) -> None:
        self.exiting = True
        for server in self.servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()
        timeout = self.config.timeout_graceful_shutdown
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while not self._force and any(c.task is not None for c in self.connections):
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.05)
        cut = [f"{c.current.method} {c.current.path}" for c in self.connections if c.task is not None and c.current]
        if cut:
            log.warning("shutting down: %d request(s) still in flight cut off: %s", len(cut), ", ".join(cut[:8]))
        tasks = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for server in self.servers:
            await server.wait_closed()


def _install_signals(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> dict[int, Any]:
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, callback)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
            previous.pop(sig, None)
    return previous


def _restore_signals(loop: asyncio.AbstractEventLoop, previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        loop.remove_signal_handler(sig)
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
