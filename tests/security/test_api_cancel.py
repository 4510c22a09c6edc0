"""Cancellation on every path, measured where it matters: a client that leaves a
non-streamed request stops its generation on the worker (the engine's running count
drops long before the request would have ended), and the KV router's booking of a
request is given back when its client leaves before the first event."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgspec
import pytest

from tests.helpers import InProcessStack

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(100, 300))


async def _send(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = msgspec.json.encode(body)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % (b"/v1/chat/completions" if "messages" in body else b"/v1/completions", len(data))
        + data
    )
    await writer.drain()
    return reader, writer


async def _wait_until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.01)


async def test_a_client_leaving_a_non_streamed_request_stops_its_generation_on_the_worker():
    # speedup 0.5: ~12 ms per decode step, so 1,800 tokens would take ~20 s
    stack = InProcessStack(speedup=0.5)
    async with stack.running():
        engine = stack.engine
        baseline = engine.active_blocks
        body = {"model": "kvmesh-tiny", "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True}
        reader, writer = await _send(stack.port, body)
        await _wait_until(lambda: engine.load_report().num_running == 1, 10, "the request running on the worker")
        await asyncio.sleep(0.2)  # some tokens generated
        writer.transport.abort()  # the client is gone
        await _wait_until(lambda: engine.load_report().num_running == 0, 8, "the worker stopped generating")
        await _wait_until(lambda: engine.active_blocks == baseline, 5, "the KV blocks freed")
        registry = stack.frontend.metrics.registry
        assert registry.get_sample_value(
            "kvmesh_frontend_requests_total", {"model": "kvmesh-tiny", "endpoint": "completions", "status": "499"}
        ) == 1


class _GoneClient:
    """The response-stream side of a connection whose client has already left (what
    the HTTP server hands a streaming response after connection_lost)."""

    disconnected = True
    paused = False
    on_disconnect = None
    head_pending = True

    def start(self, status: int, headers: list) -> None: ...
    def write(self, data: bytes) -> None: ...
    def end(self, data: bytes = b"") -> None: ...
    async def drain(self) -> None: ...


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_stream_left_before_its_first_event_releases_its_router_booking(kind):
    from kvmesh.frontend.server import Request

    stack = InProcessStack(speedup=0.5)
    stack.frontend_config = replace(stack.frontend_config, router_mode="kv-approx")
    async with stack.running():
        core = stack.frontend.registry.get("kvmesh-tiny").kv.core
        body: dict = {"model": "kvmesh-tiny", "max_tokens": 500, "ignore_eos": True, "stream": True}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": "x " * 300}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = PROMPT
            path = "/v1/completions"
        data = msgspec.json.encode(body)
        request = Request("POST", path, "", {"content-type": "application/json"}, data, len(data), True, "1.1")
        response = await stack.frontend.app.handle(request)
        assert len(core.load) == 1  # routed and booked
        await response.send_to(_GoneClient())  # the client left before the first event
        assert len(core.load) == 0, "the router still holds the booking of a request nobody waits for"
        registry = stack.frontend.metrics.registry
        assert registry.get_sample_value("kvmesh_frontend_inflight_requests", {"model": "kvmesh-tiny"}) == 0


async def test_finished_requests_leave_no_booking():
    """The other ends of a request (streamed or not, read to the end) give the booking
    back too: after them the router holds nothing."""
    import httpx

    stack = InProcessStack()
    stack.frontend_config = replace(stack.frontend_config, router_mode="kv-approx")
    async with stack.running():
        core = stack.frontend.registry.get("kvmesh-tiny").kv.core
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            for stream in (False, True):
                for body in ({"prompt": PROMPT}, {"messages": [{"role": "user", "content": "hi"}]}):
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    r = await client.post(path, json={"model": "kvmesh-tiny", "max_tokens": 8, "stream": stream, **body})
                    assert r.status_code == 200
        await _wait_until(lambda: len(core.load) == 0, 5, "every booking released")
