"""Shared benchmark helpers: a lean streaming HTTP/1.1 + SSE client, a closed-loop
load generator, /proc meters for CPU and memory, and a server launcher.

Everything here is stdlib + msgspec (+ uvloop when importable). Benchmarks that
compare kvmesh against another server (same load, same measurement) should import
from this module (or from ``bench/frontend.py``, which re-exports the public API):

    import sys; sys.path.insert(0, "bench")
    from _lib import run_load, measure_cpu, read_mem

    res = run_load("http://127.0.0.1:8000", "model-id", concurrency=8,
                   requests=200, prompt_tokens=128, output_tokens=64,
                   frontend_pid=1234)
    print(res.req_per_s, res.ttft_p50_ms, res.frontend_cpu_ms_per_req)

Only loopback targets are allowed (see ``check_loopback``).

The client is the same for every server and shares the machine with it, so each level
also reports what the client itself cost: ``client_cpu_ms_per_req`` (this process's CPU
÷ requests: ~0.25–0.42 ms per kvmesh request at c=64, ~6.5 socket reads and ~10 SSE
events each, their parse in ``data_received`` the largest Python item; ~0.65–0.76 ms per
Dynamo request, which sends one SSE event per token), and, per side, the share of
the level's wall time it was runnable (``client_runnable``, ``frontend_runnable``,
``descendants_runnable``; :func:`sched_ns`): a side near 1.0 never slept and is what
caps the level on a shared box. Issue 36 measured the client asleep ~3/4 of a kvmesh
c=64 level and the worker runnable throughout, so the client was left unchanged.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

import msgspec

try:  # optional, faster event loop
    import uvloop  # type: ignore
except ImportError:  # pragma: no cover
    uvloop = None

__all__ = [
    "LoadResult",
    "HttpConnection",
    "Response",
    "run_load",
    "run_load_async",
    "wait_ready",
    "wait_ready_async",
    "measure_cpu",
    "sched_ns",
    "read_mem",
    "descendant_pids",
    "percentile",
    "free_port",
    "check_loopback",
    "kvmesh_command",
    "launch_server",
    "precompile_kvmesh",
    "LaunchedServer",
    "default_requests",
    "default_warmup",
    "run_async",
]

_perf = time.perf_counter
_IPPROTO_TCP = socket.IPPROTO_TCP
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", 12)  # Linux only
_QUICKACK_OK = sys.platform.startswith("linux")

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def run_async(coro):
    """Run a coroutine to completion on uvloop when available, else asyncio."""
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)


def source_arms(repo: Path, base_commit: str | None, specs: Sequence[str], tmp: str) -> list[tuple[str, str, dict[str, str]]]:
    """A/B arms as (label, src folder, extra environment): ``before`` from ``base_commit``'s
    src/ (git archive into ``tmp``) if given, then each ``LABEL=SRC[,VAR=VALUE...]``."""
    arms = []
    if base_commit:
        out = Path(tmp) / "before"
        out.mkdir()
        archive = subprocess.run(["git", "-C", str(repo), "archive", base_commit, "src"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
        arms.append(("before", str(out / "src"), {}))
    for spec in specs:
        label, _, rest = spec.partition("=")
        src, *pairs = rest.split(",")
        arms.append((label, str((repo / src).resolve()), dict(pair.split("=", 1) for pair in pairs)))
    return arms


def check_loopback(url: str) -> tuple[str, int]:
    """Return (host, port) for a loopback http URL; raise ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only plain http:// URLs are supported, got {url!r}")
    host = parts.hostname or ""
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"benchmarks target loopback only, got host {host!r}")
    if parts.port is None:
        raise ValueError(f"URL needs an explicit port: {url!r}")
    return ("127.0.0.1" if host == "localhost" else host), parts.port


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# /proc meters
# ---------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _as_pids(pid: int | Iterable[int] | None) -> list[int]:
    if pid is None:
        return []
    if isinstance(pid, int):
        return [pid]
    return [int(p) for p in pid]


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(b")") + 2 :].decode().split()


def measure_cpu(pid: int | Iterable[int]) -> float:
    """Cumulative user+system CPU time in milliseconds of a process (or the sum
    over several), read from /proc/PID/stat. Vanished processes count as 0."""
    total = 0
    for p in _as_pids(pid):
        try:
            f = _stat_fields(p)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        total += int(f[11]) + int(f[12])  # utime, stime (fields 14, 15)
    return total * 1000.0 / _CLK_TCK


def sched_ns(pid: int | Iterable[int]) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one), summed over the threads of the
    process(es), from /proc/PID/task/*/schedstat. Over a level, their sum ÷ the wall
    time is how much of it a process wanted a CPU: ~1.0 is a process that never
    sleeps (the bottleneck on a shared box), a low value one that waits for others."""
    run = wait = 0
    for p in _as_pids(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/schedstat", "rb") as f:
                    fields = f.read().split()
            except OSError:
                continue
            run += int(fields[0])
            wait += int(fields[1])
    return run, wait


def read_mem(pid: int | Iterable[int]) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in KiB from /proc/PID/status (summed over pids)."""
    out = {"rss_kb": 0, "hwm_kb": 0}
    for p in _as_pids(pid):
        try:
            with open(f"/proc/{p}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmRSS:"):
                        out["rss_kb"] += int(line.split()[1])
                    elif line.startswith(b"VmHWM:"):
                        out["hwm_kb"] += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def descendant_pids(pid: int | Iterable[int]) -> list[int]:
    """All live descendants (children, grandchildren, ...) of the given pid(s)."""
    roots = set(_as_pids(pid))
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(name))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    stack = list(roots)
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in roots and c not in out:
                out.append(c)
                stack.append(c)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of a sequence; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


# ---------------------------------------------------------------------------
# Lean HTTP/1.1 client with chunked + SSE parsing
# ---------------------------------------------------------------------------


class _Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct, gc=False):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Event(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_event_decoder = msgspec.json.Decoder(_Event)

# parser states
_IDLE, _HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _BODY_LEN, _BODY_EOF = range(8)
_MAX_BODY = 1 << 20


class Response:
    """Outcome of one HTTP request. Times are time.perf_counter() seconds.

    For event streams, ``stamps`` holds the arrival time of every data event that
    carried non-empty text/content (one entry per event); ``cstamps`` the arrival
    time of other events that had choices (used only as a fallback when a server
    streams tokens with empty text)."""

    __slots__ = (
        "status", "sse", "t_send", "t_end", "stamps", "cstamps", "done", "error",
        "body", "completion_tokens", "prompt_tokens", "idx",
    )

    def __init__(self) -> None:
        self.status = 0
        self.sse = False
        self.t_send = 0.0
        self.t_end = 0.0
        self.stamps: list[float] = []
        self.cstamps: list[float] = []
        self.done = False
        self.error: str | None = None
        self.body = bytearray()
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.idx = -1

    @property
    def ok(self) -> bool:
        return self.error is None

    def token_stamps(self) -> list[float]:
        return self.stamps if self.stamps else self.cstamps

    @property
    def t_first(self) -> float | None:
        s = self.token_stamps()
        return s[0] if s else None

    @property
    def n_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.token_stamps())


class HttpConnection(asyncio.Protocol):
    """One persistent HTTP/1.1 keep-alive connection; one request at a time.

    Parsing happens inline in ``data_received`` (no per-event coroutine hops):
    response head, chunked transfer coding or Content-Length or read-to-EOF body,
    and, for ``text/event-stream`` bodies, SSE ``data:`` events, each time-stamped
    with the arrival time of the socket read that completed it. TCP_NODELAY is set
    and TCP_QUICKACK is re-armed after every read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = True
        self._setsockopt = None
        self._qsock: socket.socket | None = None
        self._buf = bytearray()
        self._rest = b""
        self._crlf = False
        self._state = _IDLE
        self._resp: Response | None = None
        self._fut: asyncio.Future | None = None
        self._remaining = 0
        self._keepalive = True
        self._expect_sse = False

    # -- connection management -------------------------------------------
    @classmethod
    async def connect(cls, host: str, port: int) -> "HttpConnection":
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(cls, host, port)
        return proto

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self.closed = False
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(_IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if _QUICKACK_OK:
                    # Our own socket object on a dup'd fd: uvloop's pseudo-socket
                    # builds a new socket object per setsockopt call (slow), and
                    # QUICKACK is re-armed after every read.
                    self._qsock = socket.socket(fileno=os.dup(sock.fileno()))
                    self._setsockopt = self._qsock.setsockopt
                    self._setsockopt(_IPPROTO_TCP, _TCP_QUICKACK, 1)
            except OSError:
                self._setsockopt = None

    def _release_qsock(self) -> None:
        if self._qsock is not None:
            self._setsockopt = None
            self._qsock.close()
            self._qsock = None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self._release_qsock()

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        self.closed = True
        self._release_qsock()
        if self._resp is not None:
            if self._state == _BODY_EOF:
                self._finish(_perf())
            else:
                self._fail(f"connection closed by server ({'reset' if exc else 'eof'}) "
                           f"in state {self._state}")

    # -- request ------------------------------------------------------------
    async def request(self, raw: bytes, timeout: float = 120.0, expect_sse: bool = True) -> Response:
        """Send pre-encoded request bytes and wait for the full response."""
        r = Response()
        if self.closed or self.transport is None:
            r.error = "connection not open"
            return r
        if self._resp is not None:
            raise RuntimeError("HttpConnection carries one request at a time")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._fut = fut
        self._resp = r
        self._state = _HEAD
        self._keepalive = True
        self._expect_sse = expect_sse
        self._crlf = False
        self._buf.clear()
        self._rest = b""
        handle = loop.call_later(timeout, self._on_timeout, r)
        r.t_send = _perf()
        self.transport.write(raw)
        try:
            return await fut
        finally:
            handle.cancel()

    def _on_timeout(self, r: Response) -> None:
        if self._resp is r:
            self._fail("timeout")
            if self.transport is not None:
                self.transport.abort()
            self.closed = True

    def _fail(self, msg: str) -> None:
        r = self._resp
        if r is not None and r.error is None:
            r.error = msg
        self._keepalive = False
        self._finish(_perf())

    def _finish(self, now: float) -> None:
        r, fut = self._resp, self._fut
        self._resp = None
        self._fut = None
        self._state = _IDLE
        if r is None:
            return
        r.t_end = now
        if r.error is None:
            if r.status != 200:
                r.error = f"HTTP {r.status}: {bytes(r.body[:200]).decode('utf-8', 'replace')}"
            elif self._expect_sse and not r.sse:
                r.error = "response is not text/event-stream"
            elif r.sse and not r.done:
                r.error = "stream ended without [DONE]"
        if not self._keepalive:
            self.close()
        if fut is not None and not fut.done():
            fut.set_result(r)

    # -- parsing ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:  # type: ignore[override]
        now = _perf()
        if self._setsockopt is not None:
            try:
                self._setsockopt(_IPPROTO_TCP, _TCP_QUICKACK, 1)
            except OSError:
                self._setsockopt = None
        if self._resp is None:
            return  # stray bytes after a finished response: ignore
        try:
            if self._buf:
                self._buf += data
                self._parse(self._buf, now)
            else:
                self._parse(data, now)
        except Exception as e:  # malformed response
            self._fail(f"protocol error: {e!r}")

    def _parse(self, buf, now: float) -> None:
        # Index-based framing over the received bytes (no copy when nothing was
        # left over from the previous read); body bytes of all chunks in this read
        # are joined and handed to the body/SSE layer once.
        pos = 0
        parts: list = []
        while self._resp is not None:
            st = self._state
            if st == _CHUNK_SIZE:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                line = buf[pos:i]
                if b";" in line:
                    line = line.split(b";", 1)[0]
                size = int(line, 16)
                pos = i + 2
                if size:
                    self._remaining = size
                    self._state = _CHUNK_DATA
                else:
                    self._state = _TRAILERS
            elif st == _CHUNK_DATA:
                avail = len(buf) - pos
                if not avail:
                    break
                k = self._remaining if self._remaining < avail else avail
                parts.append(buf[pos:pos + k])
                pos += k
                self._remaining -= k
                if not self._remaining:
                    self._state = _CHUNK_END
            elif st == _CHUNK_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ValueError("missing CRLF after chunk data")
                pos += 2
                self._state = _CHUNK_SIZE
            elif st == _HEAD:
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    if len(buf) - pos > 65536:
                        raise ValueError("response head too large")
                    break
                head = bytes(buf[pos:i])
                pos = i + 4
                self._head(head, now)
            elif st == _BODY_LEN:
                avail = len(buf) - pos
                if not avail:
                    break
                k = self._remaining if self._remaining < avail else avail
                parts.append(buf[pos:pos + k])
                pos += k
                self._remaining -= k
                if not self._remaining:
                    self._body(b"".join(parts), now)
                    parts.clear()
                    if self._resp is not None:
                        self._finish(now)
            elif st == _TRAILERS:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                empty = i == pos
                pos = i + 2
                if empty:
                    if parts:
                        self._body(b"".join(parts), now)
                        parts.clear()
                    if self._resp is not None:
                        self._finish(now)
            elif st == _BODY_EOF:
                parts.append(buf[pos:])
                pos = len(buf)
                break
            else:
                break
        if buf is self._buf:
            if pos:
                del buf[:pos]
        elif pos < len(buf) and self._resp is not None:
            self._buf += buf[pos:]
        if parts and self._resp is not None:
            self._body(b"".join(parts), now)

    def _head(self, head: bytes, now: float) -> None:
        r = self._resp
        lines = head.split(b"\r\n")
        version, status = lines[0].split(b" ", 2)[:2]
        code = int(status)
        if 100 <= code < 200:
            return  # interim response; keep reading heads
        r.status = code
        chunked = False
        length = None
        keepalive = version == b"HTTP/1.1"
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            if k == b"transfer-encoding":
                chunked = b"chunked" in v.lower()
            elif k == b"content-length":
                length = int(v.strip())
            elif k == b"content-type":
                r.sse = b"text/event-stream" in v.lower()
            elif k == b"connection":
                v = v.strip().lower()
                if v == b"close":
                    keepalive = False
                elif v == b"keep-alive":
                    keepalive = True
        self._keepalive = keepalive
        if code in (204, 304):
            self._finish(now)
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            if length == 0:
                self._finish(now)
            else:
                self._remaining = length
                self._state = _BODY_LEN
        else:
            self._keepalive = False
            self._state = _BODY_EOF

    def _body(self, data: bytes, now: float) -> None:
        r = self._resp
        if not r.sse:
            if len(r.body) < _MAX_BODY:
                r.body += data
            return
        if self._rest:
            data = self._rest + data
        if self._crlf or b"\r" in data:
            self._crlf = True
            data = data.replace(b"\r\n", b"\n")
        blocks = data.split(b"\n\n")
        self._rest = blocks.pop()
        for block in blocks:
            self._event(block, now)
            if self._resp is None:
                return

    def _event(self, block: bytes, now: float) -> None:
        r = self._resp
        if block.startswith(b"data: ") and b"\n" not in block:
            data = block[6:]
            is_error = False
        else:
            data = None
            is_error = False
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    v = line[5:]
                    if v[:1] == b" ":
                        v = v[1:]
                    data = v if data is None else data + b"\n" + v
                elif line.startswith(b"event:"):
                    is_error = line[6:].strip() == b"error"
            if data is None:
                return  # comment / keep-alive / id-only event
        if data == b"[DONE]":
            r.done = True
            return
        try:
            ev = _event_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if r.error is None:
                r.error = f"undecodable event: {data[:200]!r}"
            return
        if is_error or ev.error is not None:
            if r.error is None:
                r.error = f"error event: {data[:200].decode('utf-8', 'replace')}"
            return
        if ev.usage is not None:
            if ev.usage.completion_tokens is not None:
                r.completion_tokens = ev.usage.completion_tokens
            if ev.usage.prompt_tokens is not None:
                r.prompt_tokens = ev.usage.prompt_tokens
        choices = ev.choices
        if choices:
            for c in choices:
                d = c.delta
                if c.text or (d is not None and (d.content or d.reasoning_content)):
                    r.stamps.append(now)
                    return
            r.cstamps.append(now)


def build_request(method: str, path: str, host: str, port: int, body: bytes | None = None,
                  accept: str = "text/event-stream") -> bytes:
    """Hand-written HTTP/1.1 request bytes (keep-alive)."""
    hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    head = f"{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nAccept: {accept}\r\n"
    if body is None:
        return (head + "\r\n").encode()
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def http_get(host: str, port: int, path: str, timeout: float = 5.0) -> Response:
    """One GET on a fresh connection (used for probes, not in the hot loop)."""
    conn = await HttpConnection.connect(host, port)
    try:
        return await conn.request(build_request("GET", path, host, port, accept="*/*"),
                                  timeout, expect_sse=False)
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# Workload: prompts and request bodies
# ---------------------------------------------------------------------------

TOKEN_ID_LO, TOKEN_ID_HI = 100, 1999  # inclusive
_TOKEN_IDS = range(TOKEN_ID_LO, TOKEN_ID_HI + 1)


def _make_vocab(n: int = 2000, seed: int = 12345) -> list[str]:
    rng = random.Random(seed)
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 3))))
    return sorted(words)


_VOCAB: list[str] | None = None


class Workload:
    """Generates distinct prompts from a seeded RNG (token ids 100..1999, or words
    in chat mode); with ``shared_prefix_tokens`` K > 0 the first K ids/words come
    from one of ``prefix_groups`` fixed prefixes (request i uses group i % G)."""

    def __init__(self, model: str, prompt_tokens: int = 128, output_tokens: int = 64, *,
                 chat: bool = False, chat_words: int | None = None,
                 shared_prefix_tokens: int = 0, prefix_groups: int = 1, seed: int = 0,
                 min_tokens: bool = True, include_usage: bool = True,
                 extra_body: dict | None = None) -> None:
        global _VOCAB
        self.model = model
        self.chat = chat
        self.length = (chat_words or prompt_tokens) if chat else prompt_tokens
        self.output_tokens = output_tokens
        self.shared = max(0, min(shared_prefix_tokens, self.length))
        self.groups = max(1, prefix_groups)
        self.rng = random.Random(seed)
        self.min_tokens = min_tokens
        self.include_usage = include_usage
        self.extra_body = dict(extra_body or {})
        self.count = 0
        if chat and _VOCAB is None:
            _VOCAB = _make_vocab()
        prng = random.Random(seed ^ 0x5EED)
        self.prefixes = [self._draw(prng, self.shared) for _ in range(self.groups)] if self.shared else []
        self.path = "/v1/chat/completions" if chat else "/v1/completions"

    def _draw(self, rng: random.Random, n: int) -> list:
        if self.chat:
            return rng.choices(_VOCAB, k=n)
        return rng.choices(_TOKEN_IDS, k=n)

    def next_prompt(self) -> list:
        i = self.count
        self.count += 1
        if self.shared:
            return self.prefixes[i % self.groups] + self._draw(self.rng, self.length - self.shared)
        return self._draw(self.rng, self.length)

    def body(self, prompt: list, max_tokens: int | None = None) -> bytes:
        n = self.output_tokens if max_tokens is None else max_tokens
        b: dict[str, Any] = {"model": self.model}
        if self.chat:
            b["messages"] = [{"role": "user", "content": " ".join(prompt)}]
        else:
            b["prompt"] = prompt
        b["max_tokens"] = n
        if self.min_tokens:
            b["min_tokens"] = n
        b["ignore_eos"] = True
        b["stream"] = True
        if self.include_usage:
            b["stream_options"] = {"include_usage": True}
        b.update(self.extra_body)
        return msgspec.json.encode(b)

    def requests(self, n: int, host: str, port: int) -> list[bytes]:
        return [build_request("POST", self.path, host, port, self.body(self.next_prompt()))
                for _ in range(n)]


# ---------------------------------------------------------------------------
# Closed-loop load
# ---------------------------------------------------------------------------

REQUESTS_CAP = 2000


def default_requests(concurrency: int) -> int:
    return min(max(200, 20 * concurrency), REQUESTS_CAP)


def default_warmup(concurrency: int) -> int:
    return max(2, concurrency)


@dataclass
class LoadResult:
    concurrency: int
    requests: int  # measured requests (after warm-up) that finished
    warmup: int
    completed_total: int  # all finished requests incl. warm-up (ok or failed)
    failures: int  # all failed requests incl. warm-up
    ok: int  # measured requests that succeeded
    duration_s: float  # whole level wall time incl. warm-up and drain
    window_s: float  # steady-state window used for throughput
    window_requests: int  # successful completions inside the window
    req_per_s: float
    output_tok_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_mean_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    output_tokens_mean: float | None
    prompt_tokens_mean: float | None  # from server usage, when reported
    token_mismatch: int  # ok requests whose completion tokens != requested
    frontend_cpu_ms_per_req: float | None
    descendants_cpu_ms_per_req: float | None  # children of the frontend pid(s)
    client_cpu_ms_per_req: float
    frontend_rss_peak_kb: int | None  # max sampled VmRSS during the level
    stopped_by: str  # "requests" | "time" | "errors"
    errors: list[str] = field(default_factory=list)  # up to 5 distinct messages
    # share of the level's wall time each side was runnable (on a CPU + waiting for
    # one; see sched_ns): the client (this process), the frontend pid(s), their descendants
    client_runnable: float | None = None
    frontend_runnable: float | None = None
    descendants_runnable: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


async def _rss_sampler(pids: list[int], box: list[int], interval: float) -> None:
    while True:
        rss = read_mem(pids)["rss_kb"]
        if rss > box[0]:
            box[0] = rss
        await asyncio.sleep(interval)


async def run_load_async(url: str, model: str, concurrency: int, requests: int | None = None,
                         prompt_tokens: int = 128, output_tokens: int = 64, *,
                         warmup: int | None = None, max_seconds: float = 60.0,
                         chat: bool = False, chat_words: int | None = None,
                         shared_prefix_tokens: int = 0, prefix_groups: int = 1,
                         seed: int = 0, request_timeout: float = 120.0,
                         frontend_pid: int | Sequence[int] | None = None,
                         include_descendants: bool = True,
                         min_tokens: bool = True, extra_body: dict | None = None,
                         workload: Workload | None = None) -> LoadResult:
    """One closed-loop level: ``concurrency`` clients, each on its own keep-alive
    connection, send a streaming request, read it to [DONE], send the next.

    ``warmup`` requests (default max(2, C)) run first in the same loop and are
    excluded from latency stats; then ``requests`` (default max(200, 20*C), capped
    at 2000) are measured. No new request is issued after ``max_seconds`` (level
    wall clock, warm-up included); in-flight requests finish or hit
    ``request_timeout``. Pass a ``workload`` to keep prompts distinct across levels.
    """
    host, port = check_loopback(url)
    C = max(1, int(concurrency))
    n_req = default_requests(C) if requests is None else int(requests)
    n_warm = default_warmup(C) if warmup is None else int(warmup)
    total = n_warm + n_req
    wl = workload or Workload(model, prompt_tokens, output_tokens, chat=chat, chat_words=chat_words,
                              shared_prefix_tokens=shared_prefix_tokens,
                              prefix_groups=prefix_groups, seed=seed, min_tokens=min_tokens,
                              extra_body=extra_body)
    raws = wl.requests(total, host, port)
    pids = _as_pids(frontend_pid)
    desc = descendant_pids(pids) if (pids and include_descendants) else []

    conns = list(await asyncio.gather(*(HttpConnection.connect(host, port) for _ in range(C))))
    results: list[Response] = []
    st = {"next": 0, "t_stop": None, "stopped_by": "requests"}

    async def client(slot: int) -> None:
        conn = conns[slot]
        while True:
            i = st["next"]
            if i >= total or _perf() >= deadline:
                if st["t_stop"] is None:
                    st["t_stop"] = _perf()
                    st["stopped_by"] = "requests" if i >= total else "time"
                return
            st["next"] = i + 1
            if conn.closed:
                try:
                    conn = conns[slot] = await HttpConnection.connect(host, port)
                except OSError as e:
                    r = Response()
                    r.idx, r.error = i, f"connect failed: {e!r}"
                    r.t_send = r.t_end = _perf()
                    results.append(r)
                    st["stopped_by"] = "errors"
                    return
            r = await conn.request(raws[i], request_timeout)
            r.idx = i
            results.append(r)

    gc.collect()
    gc.freeze()
    rss_box = [0]
    sampler = asyncio.create_task(_rss_sampler(pids, rss_box, 0.2)) if pids else None
    cpu0 = measure_cpu(pids) if pids else 0.0
    dcpu0 = measure_cpu(desc) if desc else 0.0
    ccpu0 = time.process_time()
    sched0 = [sched_ns(os.getpid()), sched_ns(pids), sched_ns(desc)]
    t0 = _perf()
    deadline = t0 + max_seconds
    try:
        await asyncio.gather(*(client(s) for s in range(C)))
    finally:
        t1 = _perf()
        sched1 = [sched_ns(os.getpid()), sched_ns(pids), sched_ns(desc)]
        ccpu1 = time.process_time()
        cpu1 = measure_cpu(pids) if pids else 0.0
        dcpu1 = measure_cpu(desc) if desc else 0.0
        if sampler is not None:
            sampler.cancel()
            try:
                await sampler
            except asyncio.CancelledError:
                pass
        for c in conns:
            c.close()
        gc.unfreeze()
    if pids:
        rss_box[0] = max(rss_box[0], read_mem(pids)["rss_kb"])
    res = _summarize(results, C, n_warm, output_tokens, t0, t1, st, pids, desc,
                     cpu1 - cpu0, dcpu1 - dcpu0, ccpu1 - ccpu0, rss_box[0])
    wall_ns = max((t1 - t0) * 1e9, 1.0)
    shares = [(sum(b) - sum(a)) / wall_ns for a, b in zip(sched0, sched1)]
    res.client_runnable = shares[0]
    res.frontend_runnable = shares[1] if pids else None
    res.descendants_runnable = shares[2] if desc else None
    return res


def _summarize(results: list[Response], C: int, n_warm: int, output_tokens: int, t0: float,
               t1: float, st: dict, pids: list[int], desc: list[int], cpu_ms: float,
               dcpu_ms: float, ccpu_s: float, rss_peak: int) -> LoadResult:
    done = len(results)
    measured = [r for r in results if r.idx >= n_warm]
    good = [r for r in measured if r.ok]
    failures = sum(1 for r in results if not r.ok)
    errors: list[str] = []
    for r in results:
        if r.error is not None and r.error not in errors:
            errors.append(r.error)
            if len(errors) >= 5:
                break

    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    ntok: list[int] = []
    ptok: list[int] = []
    mismatch = 0
    for r in good:
        stamps = r.token_stamps()
        e2e.append((r.t_end - r.t_send) * 1e3)
        n = r.n_tokens
        ntok.append(n)
        if r.prompt_tokens is not None:
            ptok.append(r.prompt_tokens)
        if n != output_tokens:
            mismatch += 1
        if not stamps:
            continue
        ttft.append((stamps[0] - r.t_send) * 1e3)
        if len(stamps) > 1:
            # tokens per inter-event gap (>1 when the server batches tokens per event)
            k = (n - 1) / (len(stamps) - 1) if n > len(stamps) else 1.0
            prev = stamps[0]
            for t in stamps[1:]:
                itl.append((t - prev) * 1e3 / k)
                prev = t
        if n > 1:
            tpot.append((stamps[-1] - stamps[0]) * 1e3 / (n - 1))

    # Steady-state throughput window: from the moment `warmup` requests have
    # completed until the first client found no more work (all C clients busy
    # throughout). Falls back to first measured send .. last measured end.
    ends = sorted(r.t_end for r in results)
    t_stop = st["t_stop"]
    t_a = ends[n_warm - 1] if 0 < n_warm <= len(ends) else t0
    win_reqs: list[Response] = []
    if t_stop is not None and t_stop > t_a:
        win_reqs = [r for r in results if r.ok and t_a < r.t_end <= t_stop]
        window = t_stop - t_a
    if len(win_reqs) < max(2, min(C, 10)):
        if measured:
            t_a = min(r.t_send for r in measured)
            t_b = max(r.t_end for r in measured)
            window = max(t_b - t_a, 1e-9)
            win_reqs = good
        else:
            window = max(t1 - t0, 1e-9)
            win_reqs = []
    win_tokens = sum(r.n_tokens for r in win_reqs)

    def mean(xs):
        return (sum(xs) / len(xs)) if xs else None

    return LoadResult(
        concurrency=C,
        requests=len(measured),
        warmup=n_warm,
        completed_total=done,
        failures=failures,
        ok=len(good),
        duration_s=t1 - t0,
        window_s=window,
        window_requests=len(win_reqs),
        req_per_s=len(win_reqs) / window,
        output_tok_per_s=win_tokens / window,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        ttft_mean_ms=mean(ttft),
        itl_p50_ms=percentile(itl, 50),
        itl_p99_ms=percentile(itl, 99),
        tpot_mean_ms=mean(tpot),
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
        output_tokens_mean=mean(ntok),
        prompt_tokens_mean=mean(ptok),
        token_mismatch=mismatch,
        frontend_cpu_ms_per_req=(cpu_ms / done) if (pids and done) else None,
        descendants_cpu_ms_per_req=(dcpu_ms / done) if (desc and done) else None,
        client_cpu_ms_per_req=(ccpu_s * 1e3 / done) if done else 0.0,
        frontend_rss_peak_kb=rss_peak if pids else None,
        stopped_by=st["stopped_by"],
        errors=errors,
    )


def run_load(url: str, model: str, concurrency: int, requests: int | None = None,
             prompt_tokens: int = 128, output_tokens: int = 64, **kw) -> LoadResult:
    """Synchronous wrapper around :func:`run_load_async` (runs its own event loop)."""
    return run_async(run_load_async(url, model, concurrency, requests, prompt_tokens,
                                    output_tokens, **kw))


# ---------------------------------------------------------------------------
# Readiness
# ---------------------------------------------------------------------------


async def _first_model(host: str, port: int) -> str | None:
    r = await http_get(host, port, "/v1/models")
    if r.status != 200:
        return None
    data = msgspec.json.decode(bytes(r.body)).get("data") or []
    return data[0]["id"] if data else None


async def wait_ready_async(url: str, timeout: float = 180.0, *, model: str | None = None,
                           chat: bool = False, proc: subprocess.Popen | None = None,
                           interval: float = 0.05, min_tokens: bool = True) -> tuple[str, float]:
    """Poll until a streaming completion succeeds. Returns (model, perf_counter time
    of the first success). Discovers the model from GET /v1/models unless given."""
    host, port = check_loopback(url)
    deadline = _perf() + timeout
    last = "no attempt"
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before serving; last: {last}")
        if _perf() > deadline:
            raise TimeoutError(f"server not ready after {timeout:.0f}s; last: {last}")
        try:
            if model is None:
                model = await _first_model(host, port)
                if model is None:
                    last = "GET /v1/models: no model yet"
            if model is not None:
                wl = Workload(model, 8, 4, chat=chat, seed=987654, min_tokens=min_tokens)
                raw = wl.requests(1, host, port)[0]
                conn = await HttpConnection.connect(host, port)
                try:
                    r = await conn.request(raw, min(30.0, max(1.0, deadline - _perf())))
                finally:
                    conn.close()
                if r.ok:
                    return model, r.t_end
                last = r.error or "?"
        except (OSError, ValueError, KeyError, msgspec.DecodeError) as e:
            last = repr(e)
        await asyncio.sleep(interval)


def wait_ready(url: str, timeout: float = 180.0, **kw) -> tuple[str, float]:
    return run_async(wait_ready_async(url, timeout, **kw))


# ---------------------------------------------------------------------------
# Server launcher
# ---------------------------------------------------------------------------


def precompile_kvmesh() -> str:
    """Byte-compile the kvmesh package being benchmarked into its ``__pycache__``
    folders, as ``pip install`` does for an installed package. An editable install under
    PYTHONDONTWRITEBYTECODE=1 (set on some machines) otherwise recompiles every module at
    every launch, which a competitor installed by pip never pays. Returns the folder."""
    import compileall

    try:
        import kvmesh
        folder = os.path.dirname(kvmesh.__file__)
    except ImportError:  # pragma: no cover
        folder = str(REPO_ROOT / "src" / "kvmesh")
    compileall.compile_dir(folder, quiet=1, workers=1)
    return folder


def path_only_venv(folder: str) -> str:
    """A virtualenv over this interpreter that sees the packages of this one's
    ``sys.path`` (kvmesh, its dependencies) as plain path lines: what ``pip install
    kvmesh`` into a venv gives, without running the code lines of the system
    site-packages' ``.pth`` files (this sandbox's ``_sandboxing_egress_ca.pth`` imports
    certifi at every interpreter start, ~40 ms; a competitor in its own venv never
    runs it). ``distutils-precedence.pth`` is kept, as a venv with setuptools has it.
    Returns the venv's python."""
    import shutil
    import site
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    py = os.path.join(folder, "bin", "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    system = site.getsitepackages()
    stdlib = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
    added = [p for p in sys.path[sys.path.index(system[0]) + 1 :] if os.path.isdir(p) and p not in stdlib]
    with open(os.path.join(purelib, "_kvmesh_paths.pth"), "w") as f:  # e.g. an editable install's src
        f.write("\n".join(system + added) + "\n")  # path lines only: no code runs
    hack = next((os.path.join(d, "distutils-precedence.pth") for d in system
                 if os.path.exists(os.path.join(d, "distutils-precedence.pth"))), None)
    if hack:
        shutil.copy(hack, purelib)
    return py


def kvmesh_command(port: int, workers: int = 1, speedup: float | str = 1e9,
                   router_mode: str | None = None, extra: Sequence[str] = (),
                   python: str | None = None) -> list[str]:
    cmd = [python or sys.executable, "-m", "kvmesh.cli.main", "run", "--workers", str(workers),
           "--speedup", str(speedup), "--http-host", "127.0.0.1", "--http-port", str(port)]
    if router_mode:
        cmd += ["--router-mode", router_mode]
    return cmd + list(extra)


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    port: int
    t_launch: float  # perf_counter just before Popen
    log_path: str
    leftovers: int = 0  # descendants still alive after the frontend exited
    temp_log: bool = False  # log_path is a temp file we created

    def remove_temp_log(self) -> None:
        if self.temp_log:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the frontend by PID, wait, SIGKILL if needed; then clean up any
        descendants left in the session we created for it. Returns the exit code."""
        p = self.proc
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        # start_new_session=True made the frontend the leader of its own process
        # group: anything still in it is a worker the frontend failed to reap.
        pgid = p.pid
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                break
            self.leftovers += 1
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                try:
                    os.killpg(pgid, 0)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.05)
        return p.returncode


def launch_server(cmd: Sequence[str], port: int, log_path: str | None = None,
                  env: dict | None = None) -> LaunchedServer:
    """Start a server process (own session, output to a log file)."""
    temp_log = log_path is None
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="kvmesh-bench-server-", suffix=".log")
        os.close(fd)
    if env is None:
        env = dict(os.environ)
        src = REPO_ROOT / "src"
        if (src / "kvmesh").is_dir():
            env["PYTHONPATH"] = os.pathsep.join(
                [str(src)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    log = open(log_path, "wb")
    try:
        t0 = _perf()
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        log.close()
    return LaunchedServer(proc=proc, port=port, t_launch=t0, log_path=log_path, temp_log=temp_log)
