#!/usr/bin/env python3
"""Self-check for the bench client (no kvmesh needed): feeds synthetic HTTP
responses to the parser byte-by-byte and in one piece, checks the workload
generator, then runs short closed-loop levels against bench/_fake_server.py in
several framing modes, plus the launch path of frontend.py via --server-cmd.

    python bench/_selfcheck.py          # prints "selfcheck OK" or raises
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _lib  # noqa: E402
from _lib import HttpConnection, Response, Workload, run_load  # noqa: E402


class _T:
    def write(self, b):
        pass

    def get_extra_info(self, k):
        return None

    def close(self):
        pass

    def abort(self):
        pass


def _feed(raw: bytes, pieces: str, expect_sse: bool = True) -> Response:
    c = HttpConnection()
    c.connection_made(_T())
    r = Response()
    c._resp, c._state, c._expect_sse = r, _lib._HEAD, expect_sse
    if pieces == "one":
        c.data_received(raw)
    else:
        for i in range(len(raw)):
            c.data_received(raw[i:i + 1])
    if c._resp is not None:  # read-to-EOF body
        c.connection_lost(None)
    return r


def _sse(events: list[bytes], sep: bytes = b"\n\n", chunked: bool = True) -> bytes:
    body = [b"data: " + e + sep for e in events]
    if chunked:
        head = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
        return head + b"".join(b"%X;ext=1\r\n" % len(x) + x + b"\r\n" for x in body) + b"0\r\nX-Trailer: 1\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + b"".join(body)


def check_parser() -> None:
    tok = [json.dumps({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}).encode()
           for i in range(5)]
    fin = json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}).encode()
    use = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}).encode()
    ok_events = tok + [fin, use, b"[DONE]"]
    for pieces in ("one", "bytes"):
        for sep in (b"\n\n", b"\r\n\r\n"):
            for chunked in (True, False):
                r = _feed(_sse(ok_events, sep, chunked), pieces)
                assert r.ok, (pieces, sep, chunked, r.error)
                assert len(r.stamps) == 5 and r.n_tokens == 5 and r.prompt_tokens == 7, r.stamps
        r = _feed(_sse(tok + [fin]), pieces)
        assert r.error == "stream ended without [DONE]", r.error
        r = _feed(_sse(tok[:2] + [b'{"error": {"message": "boom"}}', b"[DONE]"]), pieces)
        assert r.error and r.error.startswith("error event"), r.error
        r = _feed(_sse([b"{not json", b"[DONE]"]), pieces)
        assert r.error and r.error.startswith("undecodable"), r.error
        # multi-line data field, comment lines, event: field
        raw = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n")
        body = (b": keep-alive\n\nevent: message\ndata: {\"choices\":\ndata: [{\"delta\":{\"content\":\"hi\"}}]}\n\n"
                b"data: [DONE]\n\n")
        r = _feed(raw % len(body) + body, pieces)
        assert r.ok and len(r.stamps) == 1, (r.error, r.stamps)
        r = _feed(raw % len(body) + body.replace(b"event: message", b"event: error"), pieces)
        assert r.error and r.error.startswith("error event"), r.error
        # non-200 with chunked JSON body, and a plain JSON GET
        r = _feed(b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", pieces)
        assert r.error == "HTTP 503: hello", r.error
        r = _feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", pieces, expect_sse=False)
        assert r.ok and bytes(r.body) == b"{}", r.error
        r = _feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", pieces, expect_sse=True)
        assert r.error == "response is not text/event-stream", r.error
        # chat: role-only first delta is not a token
        role = json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}).encode()
        r = _feed(_sse([role] + [json.dumps({"choices": [{"delta": {"content": "x"}}]}).encode()] * 3
                       + [b"[DONE]"]), pieces)
        assert r.ok and len(r.stamps) == 3 and r.n_tokens == 3 and len(r.cstamps) == 1
    print("parser OK")


def check_workload() -> None:
    w = Workload("m", 128, 64, seed=1)
    ps = [w.next_prompt() for _ in range(100)]
    assert all(len(p) == 128 and min(p) >= 100 and max(p) <= 1999 for p in ps)
    assert len({tuple(p[:16]) for p in ps}) == 100
    w2 = Workload("m", 128, 64, seed=1)
    assert w2.next_prompt() == ps[0]  # seeded
    w = Workload("m", 128, 64, seed=1, shared_prefix_tokens=64, prefix_groups=4)
    ps = [w.next_prompt() for _ in range(40)]
    assert len({tuple(p[:64]) for p in ps}) == 4 and len({tuple(p[64:]) for p in ps}) == 40
    assert all(ps[i][:64] == ps[i + 4][:64] for i in range(36))
    w = Workload("m", 128, 64, chat=True, chat_words=50, seed=2)
    body = json.loads(w.body(w.next_prompt()))
    assert len(body["messages"][0]["content"].split()) == 50 and body["ignore_eos"] is True
    assert body["max_tokens"] == 64 and body["stream_options"] == {"include_usage": True}
    print("workload OK")


def _start_fake(*args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, str(HERE / "_fake_server.py"), "--port", "0", *args],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("FAKE_READY"), line
    port = int(line.split("port=")[1].split()[0])
    return p, f"http://127.0.0.1:{port}"


def check_live() -> None:
    cases = [
        ((), {}, 0),
        (("--crlf", "--split-writes", "--tokens-per-event", "3"), {}, 0),
        (("--sse-eof",), {"chat": True}, 0),
        (("--fail-every", "5"), {}, 5),  # probe is request 1; 2..25 -> 5 fail
    ]
    for fake_args, kw, want_fail in cases:
        p, url = _start_fake(*fake_args)
        try:
            model, _ = _lib.wait_ready(url, 10, chat=kw.get("chat", False))
            r = run_load(url, model, 4, 20, 128, 64, warmup=4, frontend_pid=p.pid, **kw)
        finally:
            p.terminate()
            p.wait()
        assert r.requests == 20 and r.completed_total == 24, r
        assert r.failures == want_fail, (fake_args, r.failures, r.errors)
        assert r.output_tokens_mean == 64 and r.token_mismatch == 0, r
        assert r.frontend_cpu_ms_per_req and r.frontend_cpu_ms_per_req > 0, r
        assert r.ttft_p50_ms is not None and r.req_per_s > 0
        print(f"live {' '.join(fake_args) or 'default'} {kw}: {r.req_per_s:.0f} req/s, "
              f"failures {r.failures} OK")
    # launch path: frontend.py starts the server itself and stops it
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(HERE / "frontend.py"), "--quiet", "--concurrency", "1,3",
         "--requests", "10", "--json", os.devnull, "--server-cmd",
         f"{sys.executable} {HERE / '_fake_server.py'} --port {{port}} --startup-delay 0.3"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "launch to first completion" in out.stdout, out.stdout
    print(f"launch path OK ({time.perf_counter() - t:.1f}s)")


def check_venv() -> None:
    """``path_only_venv`` (compare_dynamo's kvmesh venv): the same packages as this
    interpreter, found through path lines, and no code line of a ``.pth`` file run."""
    import site
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        py = _lib.path_only_venv(os.path.join(d, "v"))
        probe = "import sys, msgspec; print(msgspec.__file__); print(sys.prefix)"
        got = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout.split()
        import msgspec

        assert got == [msgspec.__file__, os.path.join(d, "v")], got
        purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        lines = open(os.path.join(purelib, "_kvmesh_paths.pth")).read().splitlines()
        assert lines[: len(site.getsitepackages())] == site.getsitepackages(), lines
        assert not any(line.startswith("import") for line in lines), lines
    print("path-only venv OK")


if __name__ == "__main__":
    check_parser()
    check_workload()
    check_live()
    check_venv()
    print("selfcheck OK")
