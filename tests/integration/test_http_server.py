"""The frontend's HTTP/1.1 server on loopback, with a small app of its own: ordering of
pipelined requests, 100-continue and the body limit, HEAD, bad requests, streams (one
write per chunk, head with the first chunk, the client leaving), graceful exit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvmesh.frontend.server import HttpApp, HttpServer, Request, Response, ResponseStream, bind_http

LIMIT = 1000


class _Stream:
    """Writes ``count`` chunks, ``pause`` seconds apart; records how it ended."""

    def __init__(self, count: int, pause: float, log: list[str]) -> None:
        self.count = count
        self.pause = pause
        self.log = log

    async def send_to(self, out: ResponseStream) -> None:
        out.on_disconnect = lambda: self.log.append("disconnected")
        out.start(200, [(b"content-type", b"text/event-stream")])
        for i in range(self.count):
            if out.disconnected:
                return
            await asyncio.sleep(self.pause)
            out.write(b"data: %d\n\n" % i)
        out.end(b"data: [DONE]\n\n")
        self.log.append("ended")


class _Burst:
    """Writes ``count`` events in one loop iteration, then one more after yielding;
    logs how many transport writes the stream made."""

    def __init__(self, count: int, log: list[str]) -> None:
        self.count = count
        self.log = log

    async def send_to(self, out: ResponseStream) -> None:
        out.start(200, [(b"content-type", b"text/event-stream")])
        for i in range(self.count):
            out.write(b"data: %d\n\n" % i)
        await asyncio.sleep(0.01)
        out.write(b"data: late\n\n")
        out.end(b"data: [DONE]\n\n")
        self.log.append(f"writes {out.writes}")


def _app(log: list[str]) -> HttpApp:
    async def echo(request: Request) -> Response:
        return Response(request.method.encode() + b" " + request.path.encode() + b" " + request.body, content_type="text/plain")

    async def stream(request: Request) -> _Stream:
        return _Stream(int(request.query.partition("=")[2] or 3), 0.01, log)

    async def burst(request: Request) -> _Burst:
        return _Burst(int(request.query.partition("=")[2] or 3), log)

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        log.append("startup")
        yield
        log.append("shutdown")

    return HttpApp(
        {"/echo": {"GET": echo, "POST": echo}, "/stream": {"GET": stream}, "/burst": {"GET": burst}},
        not_found=lambda r: Response(b"no", 404),
        bad_method=lambda r: Response(b"method", 405),
        on_error=lambda exc: Response(repr(exc).encode(), 500),
        protocol_error=lambda status, message: Response(message.encode(), status),
        lifespan=lifespan,
        max_body_bytes=LIMIT,
    )


@contextlib.asynccontextmanager
async def _serving(log: list[str]) -> AsyncIterator[int]:
    sock = bind_http("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = HttpServer(_app(log))
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    while not server.started:
        await asyncio.sleep(0.005)
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 5)


async def _exchange(port: int, data: bytes, timeout: float = 0.3) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), timeout):
            out += chunk
    except TimeoutError:
        pass
    writer.close()
    return out


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n%b\r\n%b" % (path.encode(), len(body), extra, body)


async def test_pipelined_requests_are_answered_in_order_on_one_connection():
    async with _serving([]) as port:
        out = await _exchange(port, _post("/echo", b"one") + _post("/echo", b"two") + b"GET /echo?x=1 HTTP/1.1\r\nhost: t\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.index(b"POST /echo one") < out.index(b"POST /echo two") < out.index(b"GET /echo ")


async def test_expect_continue_and_the_body_limit():
    async with _serving([]) as port:
        ok = await _exchange(port, _post("/echo", b"x" * 10, b"expect: 100-continue\r\n"))
        too_big = await _exchange(port, b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\nexpect: 100-continue\r\n\r\n")
        counted = await _exchange(port, _post("/echo", b"y" * (LIMIT + 1)))
    assert ok.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert too_big.startswith(b"HTTP/1.1 413") and b"5000" in too_big  # answered without the body
    # a declared length over the limit is refused from the head, before any body byte is read
    assert counted.startswith(b"HTTP/1.1 413") and b"connection: close" in counted


async def test_head_bad_request_and_unknown_routes():
    async with _serving([]) as port:
        head = await _exchange(port, b"HEAD /echo HTTP/1.1\r\nhost: t\r\n\r\n")
        bad = await _exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
        missing = await _exchange(port, b"GET /nowhere HTTP/1.1\r\nhost: t\r\n\r\n")
        method = await _exchange(port, b"DELETE /echo HTTP/1.1\r\nhost: t\r\n\r\n")
    # "HEAD /echo " is 11 bytes; HEAD sends the length, not the body
    assert head.startswith(b"HTTP/1.1 200") and b"content-length: 11\r\n" in head and head.endswith(b"\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400") and b"connection: close" in bad
    assert missing.startswith(b"HTTP/1.1 404") and method.startswith(b"HTTP/1.1 405")


async def test_a_stream_is_chunked_with_the_head_in_its_first_write():
    log: list[str] = []
    async with _serving(log) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream?n=3 HTTP/1.1\r\nhost: t\r\n\r\n")
        first = await asyncio.wait_for(reader.read(65536), 1)
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await asyncio.wait_for(reader.read(65536), 1)
        writer.close()
    assert first.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in first
    assert first.endswith(b"data: 0\n\n\r\n")  # head and first chunk arrived together
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert log == ["startup", "ended", "shutdown"]


async def test_the_client_leaving_mid_stream_is_reported_once():
    log: list[str] = []
    async with _serving(log) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream?n=1000 HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.wait_for(reader.read(65536), 1)
        writer.transport.abort()
        for _ in range(100):
            if "disconnected" in log:
                break
            await asyncio.sleep(0.01)
    assert log.count("disconnected") == 1 and "ended" not in log


async def test_events_written_in_one_loop_iteration_share_a_write():
    log: list[str] = []
    async with _serving(log) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /burst?n=5 HTTP/1.1\r\nhost: t\r\n\r\n")
        body = b""
        while not body.endswith(b"0\r\n\r\n"):
            body += await asyncio.wait_for(reader.read(65536), 1)
        writer.close()
    # head + event 0 at once, events 1-4 together next iteration, then "late" at once
    # (a later iteration's first write) and the end: 4 writes for 7 events
    assert log == ["startup", "writes 4", "shutdown"]
    events = [line for line in body.split(b"\r\n") if line.startswith(b"data:")]
    assert events == [b"data: %d\n\n" % i for i in range(5)] + [b"data: late\n\n", b"data: [DONE]\n\n"]


async def test_a_bounded_graceful_exit_cuts_a_stream_still_in_flight_and_says_which(caplog):
    log: list[str] = []
    sock = bind_http("127.0.0.1", 0)
    server = HttpServer(_app(log))
    server.config.timeout_graceful_shutdown = 0.2  # as `kvmesh frontend` sets it (GRACEFUL_SHUTDOWN_S)
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    while not server.started:
        await asyncio.sleep(0.005)
    reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
    writer.write(b"GET /stream?n=100000 HTTP/1.1\r\nhost: t\r\n\r\n")  # ~17 min of events
    assert b"data: 0" in await asyncio.wait_for(reader.readuntil(b"data: 0"), 5)
    with caplog.at_level("WARNING", logger="kvmesh.http"):
        server.should_exit = True
        await asyncio.wait_for(task, 10)  # not the stream's 17 minutes
    writer.close()
    assert "ended" not in log and log[-1] == "shutdown"
    assert "1 request(s) still in flight cut off: GET /stream" in caplog.text
