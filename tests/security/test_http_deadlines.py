"""The frontend's HTTP server bounded by time and bytes (issue 29): a request body
drip-fed to dodge the silence timeout is cut by the whole-request deadline or the
minimum body rate; a keep-alive socket kept busy by a cheap request every few seconds
is retired by its age; one address cannot hold every connection; an unauthenticated
request gets its 401 from its head, before a byte of its body is buffered; pipelined
bodies past a byte budget are not read until the earlier ones are served; the
connection cap follows the open-file limit.

Servers run in this process (a thread with its own loop) with small limits, so that
each attack shows in a few seconds; clients are raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.config import FrontendConfig, HttpLimits, SecurityConfig
from kvmesh.frontend.server import HttpApp, HttpServer, Request, Response, ServerConfig, bind_http, plan_descriptors
from tests.security._edge import read_all, status_of, wait_for

pytestmark = pytest.mark.timeout(120)

KEY = "sk-edge-test-key"
BIG = 4_000_000  # a body the client declares and never sends in full


# ---------------------------------------------------------------------------- an in-process server


class EdgeServer:
    """An :class:`HttpServer` on 127.0.0.1 in a thread of its own (own event loop), so
    that blocking sockets can talk to it; ``inspect(fn)`` runs ``fn`` on its loop."""

    def __init__(self, make_app: Callable[[], HttpApp], limits: HttpLimits) -> None:
        self._make_app = make_app
        self._limits = limits
        self.server: HttpServer
        self.loop: asyncio.AbstractEventLoop
        self.port = 0

    def __enter__(self) -> EdgeServer:
        sock = bind_http("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        ready = threading.Event()

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.server = HttpServer(self._make_app(), ServerConfig(limits=self._limits))
            task = asyncio.ensure_future(self.server.serve([sock]))
            while not self.server.started and not task.done():
                await asyncio.sleep(0.01)
            ready.set()
            await task

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self._thread.start()
        assert ready.wait(30), "the server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(setattr, self.server, "should_exit", True)
        self._thread.join(30)

    def inspect(self, fn: Callable[[HttpServer], Any]) -> Any:
        async def call() -> Any:
            return fn(self.server)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        sock = socket.socket()
        sock.settimeout(10)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", self.port))
        return sock


def _small_app(hold: asyncio.Event | None = None) -> HttpApp:
    """GET /live; POST /echo answers the body's length; POST /hold waits for ``hold``."""

    async def live(request: Request) -> Response:
        return Response(b'{"status":"live"}')

    async def echo(request: Request) -> Response:
        return Response(b"%d" % len(request.body), content_type="text/plain")

    async def held(request: Request) -> Response:
        if hold is not None:
            await hold.wait()
        return Response(b"held", content_type="text/plain")

    return HttpApp(
        {"/live": {"GET": live}, "/echo": {"POST": echo}, "/hold": {"POST": held}},
        not_found=lambda r: Response(b"no", 404),
        bad_method=lambda r: Response(b"method", 405),
        on_error=lambda exc: Response(repr(exc).encode(), 500),
        protocol_error=lambda status, message: Response(message.encode(), status),
    )


def _limits(**changes: Any) -> HttpLimits:
    return HttpLimits(**changes)


def _post_head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n{extra}\r\n").encode()  # fmt: skip


def _drip(sock: socket.socket, every_s: float, stop: threading.Event, limit: int = 400) -> threading.Thread:
    """One body byte every ``every_s`` (each resets the server's silence timer) until the
    server closes, ``stop`` is set or ``limit`` bytes went."""

    def run() -> None:
        for _ in range(limit):
            if stop.wait(every_s):
                return
            try:
                sock.send(b"x")
            except OSError:
                return  # the server closed: what the test expects

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _dripping(srv: EdgeServer, every_s: float) -> Iterator[socket.socket]:
    stop = threading.Event()
    with srv.connect() as sock:
        sock.sendall(_post_head("/echo", BIG))
        thread = _drip(sock, every_s, stop)
        try:
            yield sock
        finally:
            stop.set()
            thread.join(10)


def _read_response(rfile: Any) -> tuple[int, dict[str, str], bytes] | None:
    """One response (content-length framed) from ``sock.makefile("rb")``; None at EOF."""
    status = rfile.readline()
    if not status:
        return None
    headers = {}
    while (line := rfile.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status.split(b" ", 2)[1]), headers, rfile.read(int(headers.get("content-length", "0")))


# ---------------------------------------------------------------------------- slow bodies


def test_a_drip_fed_body_is_cut_by_the_request_deadline():
    """One byte every 0.25 s keeps a 1 s silence timer happy forever; the whole-request
    deadline (2 s) cuts it. The minimum rate is off here: only the deadline acts."""
    limits = _limits(body_timeout_s=1.0, request_read_timeout_s=2.0, min_body_rate=0)
    with EdgeServer(_small_app, limits) as srv, _dripping(srv, 0.25) as sock:
        out, closed = read_all(sock, timeout=30)
    assert closed, "a drip-fed body kept its connection open for 30 s (request read deadline: 2 s)"
    assert status_of(out) == 408 and b"not read in full within 2 s" in out, out


def test_a_drip_fed_body_is_cut_by_the_minimum_body_rate():
    """The same drip (4 bytes/s) against a long deadline: the body's average rate, looked
    at once the grace has passed, is far below the minimum."""
    limits = _limits(body_timeout_s=1.0, request_read_timeout_s=600.0, min_body_rate=100, body_rate_grace_s=1.0)
    with EdgeServer(_small_app, limits) as srv, _dripping(srv, 0.25) as sock:
        out, closed = read_all(sock, timeout=30)
    assert closed, "a drip-fed body (4 bytes/s) kept its connection open for 30 s (minimum rate: 100 bytes/s)"
    assert status_of(out) == 408 and b"at least 100 bytes/s" in out, out


def test_a_slow_starting_steady_body_is_read_in_full():
    """A body that starts late (nothing for 0.8 s: a slow link's first round trips), then
    comes in pieces at ~2,000 bytes/s, is served: the rate is looked at only after the
    grace (2 s), and as an average, not at single gaps."""
    limits = _limits(body_timeout_s=3.0, min_body_rate=100, body_rate_grace_s=2.0)
    size = 4000
    with EdgeServer(_small_app, limits) as srv, srv.connect() as sock, sock.makefile("rb") as rfile:
        sock.sendall(_post_head("/echo", size))
        started = time.monotonic()
        time.sleep(0.8)
        for _ in range(size // 100):
            sock.sendall(b"y" * 100)
            time.sleep(0.05)
        assert time.monotonic() - started > 2.0  # the body outlived the grace (2.8 s of sleeps)
        response = _read_response(rfile)
    assert response is not None and response[0] == 200 and response[2] == b"%d" % size, response


def test_a_keep_alive_socket_kept_busy_by_a_cheap_request_is_retired_by_its_age():
    """GET /live every 0.25 s never lets a 1 s keep-alive timeout fire; past the maximum
    connection age (1.5 s) a response says ``connection: close`` and the socket closes."""
    limits = _limits(keepalive_timeout_s=1.0, max_connection_age_s=1.5)
    answers: list[int] = []
    with EdgeServer(_small_app, limits) as srv, srv.connect() as sock, sock.makefile("rb") as rfile:
        for _ in range(80):  # 20 s of pings; the age is 1.5 s
            try:
                sock.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
                response = _read_response(rfile)
            except OSError:
                response = None
            if response is None:
                break
            answers.append(response[0])
            if response[1].get("connection") == "close":
                assert rfile.read(1) == b"", "the server said connection: close and kept the socket open"
                break
            time.sleep(0.25)
        else:
            raise AssertionError(f"{len(answers)} requests over 20 s on one keep-alive socket (maximum age: 1.5 s)")
    assert len(answers) >= 2 and set(answers) == {200}, answers


# ---------------------------------------------------------------------------- connection caps


def test_one_address_over_its_share_is_refused_while_another_is_served():
    limits = _limits(max_connections_per_client=4, header_timeout_s=60.0)
    with EdgeServer(_small_app, limits) as srv:
        held = [srv.connect() for _ in range(4)]
        try:
            wait_for(lambda: srv.inspect(lambda s: len(s.connections)) == 4, what="four connections accepted")
            with srv.connect() as fifth:  # sends nothing: the answer comes from the connection alone
                out, closed = read_all(fifth, timeout=10)
            assert closed and status_of(out) == 503 and b"from your address" in out, out
            with srv.connect("127.0.0.2") as other, other.makefile("rb") as rfile:  # another client is served
                other.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
                response = _read_response(rfile)
            assert response is not None and response[0] == 200
            wait_for(lambda: srv.inspect(lambda s: "127.0.0.2" not in s.clients), what="127.0.0.2 forgotten")
            held.pop().close()  # a slot of 127.0.0.1's frees when one of its connections ends
            wait_for(lambda: srv.inspect(lambda s: s.clients.get("127.0.0.1")) == 3, what="the closed connection uncounted")
            with srv.connect() as again, again.makefile("rb") as rfile:
                again.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")
                response = _read_response(rfile)
            assert response is not None and response[0] == 200
        finally:
            for sock in held:
                sock.close()


def test_an_ipv6_client_counts_by_its_64_prefix():
    from kvmesh.frontend.server import _client_of

    assert _client_of(("2001:db8:1:2::a", 1, 0, 0)) == _client_of(("2001:db8:1:2:ffff::9", 2, 0, 0))
    assert _client_of(("2001:db8:1:2::a", 1, 0, 0)) != _client_of(("2001:db8:1:3::a", 1, 0, 0))
    assert _client_of(("::ffff:10.0.0.7", 1, 0, 0)) == _client_of(("10.0.0.7", 1)) == "10.0.0.7"


# ---------------------------------------------------------------------------- keys at the head


@contextlib.contextmanager
def _keyed_frontend(limits: HttpLimits) -> Iterator[tuple[EdgeServer, list[Any]]]:
    """The real frontend app with an API key (no worker: the requests here never need one)."""
    from kvmesh.frontend.app import Frontend

    config = FrontendConfig(http_port=0, canary_interval_s=0, http=limits,
                            security=SecurityConfig(api_keys=((KEY, "premium"),)))  # fmt: skip
    made: list[Any] = []

    def make() -> HttpApp:
        made.append(Frontend(config))
        return made[0].app

    with EdgeServer(make, limits) as srv:
        yield srv, made


@pytest.mark.parametrize("authorization", ["", f"authorization: Bearer not-{KEY}\r\n"], ids=["missing", "wrong"])
def test_a_request_without_a_valid_key_gets_its_401_before_the_body_is_sent(authorization):
    """Pipelined 4 MiB bodies without a key were buffered (16 per connection) before the
    key was looked at; now the head alone is answered. The body is never sent here."""
    limits = _limits(body_timeout_s=60.0)  # what the server waits for the body otherwise
    with _keyed_frontend(limits) as (srv, _), srv.connect() as sock:
        sock.sendall(_post_head("/v1/completions", BIG, authorization))
        out, closed = read_all(sock, timeout=20)
    assert out, "no answer in 20 s: the server waits for the body before it looks at the key"
    assert status_of(out) == 401 and closed, out
    assert b"www-authenticate: Bearer" in out and b"connection: close" in out


def test_pipelined_a_keyed_request_is_answered_before_the_refusal_of_an_unkeyed_one():
    limits = _limits(body_timeout_s=60.0)
    with _keyed_frontend(limits) as (srv, _), srv.connect() as sock, sock.makefile("rb") as rfile:
        good = f"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n\r\n".encode()
        sock.sendall(good + _post_head("/v1/completions", BIG))
        first, second = _read_response(rfile), _read_response(rfile)
        assert first is not None and first[0] == 200, first
        assert second is not None and second[0] == 401, second
        assert rfile.read(1) == b""


def test_an_authorized_request_has_its_key_checked_once():
    """The head-time check is the only one: the handlers reuse what it found."""
    from kvmesh.frontend.auth import Authenticator

    class Counting(Authenticator):
        __slots__ = ("calls",)

        def key_of(self, authorization: str | None) -> int:  # every key check goes through it (tier_of too)
            self.calls += 1
            return super().key_of(authorization)

    limits = _limits()
    with _keyed_frontend(limits) as (srv, made):
        counting = Counting(made[0].config.security)
        counting.calls = 0
        made[0].auth = counting
        with srv.connect() as sock, sock.makefile("rb") as rfile:
            body = b'{"model": "no-such-model", "prompt": "x", "max_tokens": 1}'
            auth = f"authorization: Bearer {KEY}\r\n"
            sock.sendall(_post_head("/v1/completions", len(body), auth) + body)
            completion = _read_response(rfile)
            sock.sendall(f"GET /v1/models HTTP/1.1\r\nhost: x\r\n{auth}\r\n".encode())
            models = _read_response(rfile)
    assert completion is not None and completion[0] == 404, completion  # past the key: the model is unknown
    assert models is not None and models[0] == 200
    assert counting.calls == 2, f"the key was checked {counting.calls} times for 2 requests"


# ---------------------------------------------------------------------------- pipelined bytes


def test_pipelined_bodies_past_the_byte_budget_are_not_read_until_earlier_ones_are_served():
    """A request held in its handler, then 12 pipelined 128 KiB bodies (fewer than the 16
    requests max_pipelined allows): reading pauses once 256 KiB of bodies wait, and
    every request is answered, in order, once the first is released."""
    budget, body, count = 256 * 1024, 128 * 1024, 12
    limits = _limits(max_pipelined_bytes=budget)
    box: dict[str, asyncio.Event] = {}

    def make() -> HttpApp:
        box["hold"] = asyncio.Event()
        return _small_app(box["hold"])

    with EdgeServer(make, limits) as srv, srv.connect() as sock, sock.makefile("rb") as rfile:
        data = _post_head("/hold", 2) + b"{}" + (_post_head("/echo", body) + b"z" * body) * count
        sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
        sender.start()

        def queue() -> tuple[bool, int, int]:
            def look(server: HttpServer) -> tuple[bool, int, int]:
                conn = next(iter(server.connections))
                return conn.reading_paused, len(conn.queue), sum(len(r.body) for r in conn.queue)

            return srv.inspect(look) if srv.inspect(lambda s: len(s.connections)) else (False, 0, 0)

        wait_for(lambda: queue()[0] or queue()[1] == count, what="reading paused, or every body queued")
        paused, queued, queued_bytes = queue()
        assert paused and queued < count, f"{queued} requests with {queued_bytes} bytes of bodies queued"
        assert queued_bytes <= budget + body + 256 * 1024, f"{queued_bytes} bytes of bodies queued (budget {budget})"
        srv.loop.call_soon_threadsafe(box["hold"].set)
        answers = [_read_response(rfile) for _ in range(count + 1)]
        sender.join(10)
    assert [a and (a[0], a[2]) for a in answers] == [(200, b"held")] + [(200, b"%d" % body)] * count


def test_the_read_deadlines_stand_still_while_the_server_does_not_read():
    """Reading paused by the server (a body queued past the budget while the first
    request is held) with a request half read: its deadlines do not run meanwhile, and
    count again from where they were when reading resumes; the rest of its body, sent
    0.5 s after that, is read (not a 408)."""
    limits = _limits(max_pipelined_bytes=1, body_timeout_s=2.0, request_read_timeout_s=3.0)
    box: dict[str, asyncio.Event] = {}

    def make() -> HttpApp:
        box["hold"] = asyncio.Event()
        return _small_app(box["hold"])

    def half_read(server: HttpServer) -> bool:
        conn = next(iter(server.connections), None)
        return conn is not None and conn.reading_paused and conn.request_since is not None

    with EdgeServer(make, limits) as srv, srv.connect() as sock, sock.makefile("rb") as rfile:
        sock.sendall(_post_head("/hold", 2) + b"{}" + _post_head("/echo", 10) + b"0123456789" + _post_head("/echo", 20) + b"a" * 10)
        wait_for(lambda: srv.inspect(half_read), what="reading paused with the third request half read")
        time.sleep(4.0)  # longer than both deadlines
        srv.loop.call_soon_threadsafe(box["hold"].set)
        answers = [_read_response(rfile) for _ in range(2)]
        time.sleep(0.5)
        sock.sendall(b"b" * 10)
        answers.append(_read_response(rfile))
    assert [a and (a[0], a[2]) for a in answers] == [(200, b"held"), (200, b"10"), (200, b"20")], answers


# ---------------------------------------------------------------------------- open-file limit


def test_the_descriptor_plan():
    # the soft limit is raised toward the hard one; the cap keeps a reserve
    plan = plan_descriptors(4096, 1024, 1_048_576, 20)
    assert plan.soft is not None and plan.soft >= 4096 + plan.reserve and plan.connections == 4096
    # the hard limit stops it: the cap is what is left after the reserve (never more than half)
    plan = plan_descriptors(4096, 1024, 1024, 20)
    assert (plan.soft, plan.connections) == (1024, 1024 - plan.reserve) and 256 <= plan.reserve <= 512
    plan = plan_descriptors(4096, 300, 300, 20)
    assert (plan.soft, plan.connections, plan.reserve) == (300, 150, 150)
    assert plan_descriptors(4096, None, None, 20).connections == 4096
    assert plan_descriptors(100, 50_000, 50_000, 20) == plan_descriptors(100, 50_000, None, 20)


_SERVE = """
import asyncio, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
from kvmesh.config import HttpLimits
from kvmesh.frontend.server import HttpApp, HttpServer, Response, ServerConfig, bind_http
async def live(request):
    return Response(b"{}")
app = HttpApp({"/live": {"GET": live}}, not_found=lambda r: Response(b"", 404), bad_method=lambda r: Response(b"", 405),
              on_error=lambda e: Response(b"", 500), protocol_error=lambda s, m: Response(m.encode(), s))
sock = bind_http("127.0.0.1", 0)
print(sock.getsockname()[1], flush=True)
asyncio.run(HttpServer(app, ServerConfig(HttpLimits(header_timeout_s=60.0))).serve([sock]))
"""


@contextlib.contextmanager
def _server_under_ulimit(tmp_path: Path, soft: int, hard: int) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    log = tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, stderr=err, env=env, preexec_fn=limit)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        wait_for(lambda: _live(port), what="the server answering")
        yield proc, port, log
    finally:
        proc.terminate()
        proc.wait(15)
        if proc.stdout is not None:
            proc.stdout.close()


def _live(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        out, _ = read_all(sock, timeout=5)
    return out.startswith(b"HTTP/1.1 200")


def _soft_nofile(pid: int) -> int:
    text = Path(f"/proc/{pid}/limits").read_text()
    return int(re.search(r"^Max open files\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
def test_a_low_soft_open_file_limit_is_raised_for_max_connections(tmp_path):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096 + 512:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to raise")
    with _server_under_ulimit(tmp_path, 256, hard) as (proc, _, _):
        soft = _soft_nofile(proc.pid)
    assert soft >= 4096 + 256, f"the soft open-file limit stayed at {soft} with --max-connections 4096"


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
def test_the_connection_cap_follows_a_hard_open_file_limit(tmp_path):
    """Hard limit 300: the cap is lowered (and logged) to what the descriptors allow less
    a reserve; connections past it get a 503 instead of the frontend running out of
    descriptors for its workers and files."""
    with _server_under_ulimit(tmp_path, 300, 300) as (_, port, log):
        found = re.search(r"HTTP connections capped at (\d+) \(--max-connections 4096\)", log.read_text())
        assert found, f"no capped-connections line in the server's log:\n{log.read_text()}"
        cap = int(found.group(1))
        assert 0 < cap <= 150
        extra = 5
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(cap + extra)]
        try:
            refused = _refused_among(socks, want=extra, timeout=20)
        finally:
            for sock in socks:
                sock.close()
    assert refused == extra, f"{refused} of {cap + extra} connections refused; the cap is {cap}"


def _refused_among(socks: list[socket.socket], want: int, timeout: float) -> int:
    """How many of ``socks`` got the server's 503 (each read until it closes), waiting up
    to ``timeout`` for ``want`` of them; the others stay open, silent."""
    refused = 0
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, [b""])
        while refused < want and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(min(left, 1.0)):
                sock, got = key.fileobj, key.data
                try:
                    chunk = sock.recv(65536)  # type: ignore[union-attr]
                except (BlockingIOError, ConnectionResetError):
                    continue
                got[0] += chunk
                if not chunk:
                    selector.unregister(sock)
                    refused += got[0].startswith(b"HTTP/1.1 503")
    return refused
