#!/usr/bin/env python3
"""Tiny fake OpenAI-style streaming server (asyncio only) for testing the bench
client without kvmesh. Loopback only.

    python bench/_fake_server.py --port 0          # prints "FAKE_READY port=N pid=P"

Endpoints: GET /health, GET /v1/models, POST /v1/completions and
/v1/chat/completions (streaming SSE over chunked transfer, or JSON when
"stream" is false). Knobs to exercise the parser: --ttft-ms, --itl-ms,
--tokens-per-event, --crlf, --split-writes, --sse-eof (no chunking, close at end),
--fail-every N (HTTP 500), --drop-done-every N, --error-event-every N,
--startup-delay S.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

MODEL = "fake-model"


class Fake:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.n = 0
        self.sep = b"\r\n\r\n" if a.crlf else b"\n\n"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v)
                body = await reader.readexactly(length) if length else b""
                keep = await self.route(method, path, body, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def _json(self, writer, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}.get(status, "X")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    async def route(self, method: str, path: str, body: bytes, writer) -> bool:
        a = self.a
        if method == "GET" and path == "/health":
            self._json(writer, 200, {"status": "ok"})
            return True
        if method == "GET" and path == "/v1/models":
            self._json(writer, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            self._json(writer, 404, {"error": {"message": "not found"}})
            return True
        req = json.loads(body)
        self.n += 1
        n = self.n
        if a.fail_every and n % a.fail_every == 0:
            self._json(writer, 500, {"error": {"message": "injected failure"}})
            return True
        chat = path.endswith("chat/completions")
        max_tokens = int(req.get("max_tokens", 16))
        prompt = req.get("prompt") if not chat else req["messages"][-1]["content"].split()
        ptoks = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        if not req.get("stream"):
            text = " tok" * max_tokens
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            self._json(writer, 200, {"id": f"x-{n}", "model": MODEL, "choices": [choice],
                                     "usage": {"prompt_tokens": ptoks, "completion_tokens": max_tokens,
                                               "total_tokens": ptoks + max_tokens}})
            return True
        eof = a.sse_eof
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     + (b"Connection: close\r\n\r\n" if eof else b"Transfer-Encoding: chunked\r\n\r\n"))

        def send(payload: bytes) -> None:
            ev = b"data: " + payload + self.sep
            if eof:
                writer.write(ev)
                return
            frame = b"%x\r\n" % len(ev) + ev + b"\r\n"
            if a.split_writes:
                h = len(frame) // 2
                writer.write(frame[:h])
                writer.write(frame[h:])
            else:
                writer.write(frame)

        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": f"x-{n}", "object": obj, "created": int(time.time()), "model": MODEL}

        def ev(text: str | None, finish=None) -> bytes:
            if chat:
                delta = {"content": text} if text is not None else {"role": "assistant", "content": ""}
                c = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": finish}
            return json.dumps({**base, "choices": [c]}).encode()

        if a.ttft_ms:
            await asyncio.sleep(a.ttft_ms / 1e3)
        if chat:
            send(ev(None))
        k = max(1, a.tokens_per_event)
        sent = 0
        while sent < max_tokens:
            m = min(k, max_tokens - sent)
            sent += m
            if a.error_event_every and n % a.error_event_every == 0 and sent > max_tokens // 2:
                send(json.dumps({"error": {"message": "injected error event"}}).encode())
                break
            send(ev(" tok" * m))
            if a.itl_ms:
                await asyncio.sleep(a.itl_ms * m / 1e3)
            else:
                await writer.drain()
        send(ev("", "length"))
        if (req.get("stream_options") or {}).get("include_usage"):
            send(json.dumps({**base, "choices": [], "usage": {
                "prompt_tokens": ptoks, "completion_tokens": sent, "total_tokens": ptoks + sent}}).encode())
        if not (a.drop_done_every and n % a.drop_done_every == 0):
            send(b"[DONE]")
        if not eof:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return not eof


async def amain(a: argparse.Namespace) -> None:
    if a.startup_delay:
        await asyncio.sleep(a.startup_delay)
    fake = Fake(a)
    server = await asyncio.start_server(fake.handle, "127.0.0.1", a.port, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(f"FAKE_READY port={port} pid={os.getpid()}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--tokens-per-event", type=int, default=1)
    p.add_argument("--crlf", action="store_true", help="SSE events separated by CRLF CRLF")
    p.add_argument("--split-writes", action="store_true", help="split every chunk in two writes")
    p.add_argument("--sse-eof", action="store_true", help="no chunking; body ends at close")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--drop-done-every", type=int, default=0)
    p.add_argument("--error-event-every", type=int, default=0)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--uvloop", action="store_true")
    a = p.parse_args()
    if a.uvloop:
        import uvloop
        uvloop.run(amain(a))
    else:
        asyncio.run(amain(a))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
