"""The frontend's own HTTP server under attack, on a real ``kvmesh run``: every limit
holds as bytes arrive (414 / 431 / 413 without reading the rest), slow or silent
sockets are closed within their timeout while normal requests keep succeeding, a
client that pipelines and never reads cannot grow the frontend's memory, too many
connections are refused quickly, and malformed HTTP gets a 400 and a closed
connection."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import kvmesh_run
from tests.security._edge import (
    assert_still_serving,
    connect,
    exchange,
    peak_mib,
    read_all,
    reset_peak,
    rss_mib,
    status_of,
    wait_for,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

TIMEOUT_S = 1.0
# a timed-out socket is closed within TIMEOUT_S + MARGIN_S (the server's sweep runs every
# TIMEOUT_S / 4; the rest is slack for a loaded machine), and not before TIMEOUT_S - EARLY_S
MARGIN_S = 2.0
EARLY_S = 0.05
ARGS = (
    "--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--keepalive-timeout", str(TIMEOUT_S),
    "--send-timeout", "3", "--canary-interval", "0",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvmesh_run(tmp_path_factory.mktemp("edge"), *ARGS, workers=1) as srv:
        yield srv


def _send_in_background(sock: socket.socket, head: bytes, piece: bytes, count: int) -> threading.Thread:
    """Send ``head`` then ``piece`` × ``count`` until the server stops taking it."""

    def run() -> None:
        try:
            sock.sendall(head)
            for _ in range(count):
                sock.sendall(piece)
        except OSError:
            pass  # the server closed: what the test expects

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _flood(server, head: bytes, piece: bytes, count: int) -> tuple[int, bool, float]:
    """(status, closed, RSS growth in MiB) for a request whose head/body never ends."""
    before = rss_mib(server)
    with connect(server) as sock:
        thread = _send_in_background(sock, head, piece, count)
        out, closed = read_all(sock, timeout=20)
        thread.join(20)
    grown = rss_mib(server) - before
    return status_of(out), closed, grown


def test_a_10_mb_url_gets_414_and_rss_stays_flat(server):
    status, closed, grown = _flood(server, b"GET /" , b"a" * 65536, 160)  # 10 MiB of URL
    assert (status, closed) == (414, True)
    assert grown < 16, f"RSS grew by {grown:.0f} MiB"
    assert_still_serving(server)


def test_an_endless_header_gets_431_and_rss_stays_flat(server):
    status, closed, grown = _flood(server, b"GET /live HTTP/1.1\r\nhost: x\r\nx-long: ", b"b" * 65536, 160)
    assert (status, closed) == (431, True)
    assert grown < 16, f"RSS grew by {grown:.0f} MiB"
    assert_still_serving(server)


def test_too_many_headers_get_431(server):
    head = b"GET /live HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(500)) + b"\r\n"
    out, closed = exchange(server, head)
    assert (status_of(out), closed) == (431, True)


def test_a_declared_body_over_the_limit_gets_413_before_any_body_byte(server):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 104857600\r\n\r\n"
    out, closed = exchange(server, head)  # the body is never sent: the answer comes from the head alone
    assert (status_of(out), closed) == (413, True)
    assert b"104857600" in out


def test_a_chunked_body_over_the_limit_gets_413_without_reading_the_rest(server):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    piece = b"10000\r\n" + b"c" * 0x10000 + b"\r\n"
    status, closed, grown = _flood(server, head, piece, 1600)  # 100 MiB offered
    assert (status, closed) == (413, True)
    assert grown < 16, f"RSS grew by {grown:.0f} MiB"
    assert_still_serving(server)


def test_slowloris_sockets_are_closed_within_the_timeout_while_normal_requests_succeed(server):
    socks, connecting = [], []
    for _ in range(200):
        connecting.append(time.monotonic())  # before the server starts this socket's header clock
        socks.append(connect(server))
    try:
        for sock in socks:
            sock.sendall(b"G")
        with ThreadPoolExecutor(1) as pool:
            closing = pool.submit(_closing_times, socks, timeout=TIMEOUT_S * 10 + 5)
            started = time.monotonic()
            served = 0
            while time.monotonic() - started < TIMEOUT_S:
                assert_still_serving(server)  # normal traffic flows while the slow sockets hang
                served += 1
            assert served >= 1
            closed_at = closing.result()
        assert len(closed_at) == len(socks), f"{len(socks) - len(closed_at)} slow sockets still open"
        held = [closed_at[i] - connecting[i] for i in range(len(socks))]
        assert TIMEOUT_S - EARLY_S <= min(held) and max(held) <= TIMEOUT_S + MARGIN_S, (
            f"slow sockets closed after {min(held):.2f}-{max(held):.2f} s; the header timeout is {TIMEOUT_S} s"
        )
    finally:
        for sock in socks:
            sock.close()
    assert_still_serving(server)


def test_silent_connections_are_closed_by_the_header_timeout(server):
    connecting = time.monotonic()
    with connect(server) as sock:
        out, closed = read_all(sock, timeout=TIMEOUT_S * 10)
    held = time.monotonic() - connecting
    assert closed and out == b""
    assert TIMEOUT_S - EARLY_S <= held <= TIMEOUT_S + MARGIN_S, f"closed after {held:.2f} s; the header timeout is {TIMEOUT_S} s"


def test_a_stalled_body_is_closed_by_the_body_timeout(server):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"mo"
    sending = time.monotonic()  # the body's last piece leaves with the head: the body clock starts after this
    out, closed = exchange(server, head, timeout=TIMEOUT_S * 10)
    held = time.monotonic() - sending
    assert closed
    assert status_of(out) == 408
    assert TIMEOUT_S - EARLY_S <= held <= TIMEOUT_S + MARGIN_S, f"closed after {held:.2f} s; the body timeout is {TIMEOUT_S} s"


def test_an_idle_keep_alive_connection_is_closed(server):
    with connect(server) as sock:
        asking = time.monotonic()  # the connection goes idle once the answer is written, after this
        sock.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
        out, closed = read_all(sock, timeout=TIMEOUT_S * 10)
        held = time.monotonic() - asking
    assert status_of(out) == 200 and closed
    assert TIMEOUT_S - EARLY_S <= held <= TIMEOUT_S + MARGIN_S, (
        f"closed after {held:.2f} s; the keep-alive timeout is {TIMEOUT_S} s"
    )


def test_pipelined_requests_without_reading_keep_rss_bounded(server):
    """A client that pipelines GET /metrics (13 KB each) and never reads: the server
    stops reading while it cannot write, so the answers cannot pile up in its memory,
    and drops the client after the send timeout."""
    before = reset_peak(server)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.settimeout(5)
        request = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"
        try:
            for _ in range(30):
                sock.sendall(request * 1000)
        except OSError:
            pass  # the server stopped reading (timeout), or dropped us
        time.sleep(8)  # what it read, it would answer into its own memory meanwhile
        grown = peak_mib(server) - before
        assert grown < 8, f"peak RSS grew by {grown:.0f} MiB"
    finally:
        sock.close()
    assert_still_serving(server)


RAW_CASES = {
    "content-length and transfer-encoding": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "duplicate content-length": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\nabc",
    "bad chunk size": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "chunk size overflow": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffffff\r\nabc\r\n0\r\n\r\n",
    "bare LF": b"GET /live HTTP/1.1\nhost: x\n\n",
    "bare LF in a header": b"GET /live HTTP/1.1\r\nhost: x\nx-a: b\r\n\r\n",
    "obsolete line folding": b"GET /live HTTP/1.1\r\nhost: x\r\nx-a: b\r\n c\r\n\r\n",
    "unknown transfer-encoding": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\nabc",
}


@pytest.mark.parametrize("name", list(RAW_CASES))
def test_malformed_http_gets_400_and_a_closed_connection(server, name):
    out, closed = exchange(server, RAW_CASES[name])
    assert status_of(out) == 400, out
    assert closed


def test_past_max_connections_new_connections_are_refused_quickly(tmp_path):
    with kvmesh_run(tmp_path, "--max-connections", "20", "--keepalive-timeout", "60", "--header-timeout", "60",
                    "--canary-interval", "0", workers=1) as srv:  # fmt: skip
        held = [connect(srv) for _ in range(20)]
        try:
            wait_for(lambda: _refused(srv), timeout=20, what="the 21st connection refused")
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: _served(srv), timeout=20, what="service after the held connections closed")


def _closing_times(socks: list[socket.socket], timeout: float) -> dict[int, float]:
    """When (monotonic) the server closed each of ``socks``, by index, watched for at most
    ``timeout`` s; what it wrote before closing is read and dropped."""
    closed_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for i, sock in enumerate(socks):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        while len(closed_at) < len(socks) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                sock = socks[key.data]
                try:
                    if sock.recv(65536):
                        continue
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    pass
                closed_at[key.data] = time.monotonic()
                selector.unregister(sock)
    return closed_at


def _refused(srv) -> bool:  # type: ignore[no-untyped-def]
    out, closed = exchange(srv, b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n", timeout=5)
    return closed and out.startswith(b"HTTP/1.1 503")


def _served(srv) -> bool:  # type: ignore[no-untyped-def]
    try:
        assert_still_serving(srv)
        return True
    except Exception:  # noqa: BLE001
        return False
