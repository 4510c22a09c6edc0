"""A client that leaves mid-stream stops the engine: the request leaves the worker's
scheduler and its KV blocks go back to the pool, long before it would have ended."""

from __future__ import annotations

import asyncio
import time

import msgspec

from tests.helpers import InProcessStack

PROMPT = list(range(100, 300))  # 200 tokens: 12 full blocks of 16


async def _open_stream(port: int, max_tokens: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = msgspec.json.encode(
        {"model": "kvmesh-tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    )
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    await writer.drain()
    return reader, writer


async def _read_events(reader: asyncio.StreamReader, count: int) -> None:
    seen = 0
    while seen < count:
        line = await asyncio.wait_for(reader.readline(), 10)
        if line.startswith(b"data: {"):
            seen += 1


async def _wait_until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def test_disconnect_mid_stream_aborts_and_frees_blocks():
    # speedup 1: ~6 ms per decode step, so 1,500 tokens would take ~9 s
    stack = InProcessStack(speedup=1.0)
    async with stack.running():
        engine = stack.engine
        baseline = engine.active_blocks
        reader, writer = await _open_stream(stack.port, max_tokens=1500)
        await _read_events(reader, 5)
        assert engine.active_blocks > baseline
        assert engine.load_report().num_running == 1
        writer.transport.abort()  # RST: the client is gone
        took = await _wait_until(lambda: engine.load_report().num_running == 0 and stack.service.server.in_flight == 0, 2.0)
        assert engine.active_blocks == baseline
        assert took < 1.0
        # the prompt's full blocks stay cached (free, reusable): the next identical prompt hits them
        assert len(engine.kv_dump()) >= len(PROMPT) // 16


async def test_many_disconnects_return_blocks_to_baseline():
    stack = InProcessStack(speedup=1.0)
    async with stack.running():
        engine = stack.engine
        baseline = engine.active_blocks
        streams = [await _open_stream(stack.port, max_tokens=1500) for _ in range(20)]
        await asyncio.gather(*(_read_events(r, 2) for r, _ in streams))
        assert engine.load_report().num_running == 20
        for _, writer in streams:
            writer.close()
        await _wait_until(lambda: engine.load_report().num_running == 0, 3.0)
        assert engine.active_blocks == baseline
        registry = stack.frontend.metrics.registry
        assert registry.get_sample_value("kvmesh_frontend_client_disconnects_total") == 20


async def test_a_thousand_disconnects_each_stop_within_100ms():
    """20 waves of 50 streams: each wave is cut (RST) after its first events; the wave's
    requests must all leave the engine within 100 ms of the last cut, so no single
    request took longer; at the end the KV blocks are back at their baseline."""
    stack = InProcessStack(speedup=1.0)
    async with stack.running():
        engine = stack.engine
        baseline = engine.active_blocks
        slowest = 0.0
        for _ in range(20):
            streams = [await _open_stream(stack.port, max_tokens=1500) for _ in range(50)]
            await asyncio.gather(*(_read_events(r, 1) for r, _ in streams))
            assert engine.load_report().num_running == 50
            for _, writer in streams:
                writer.transport.abort()
            slowest = max(slowest, await _wait_until(lambda: engine.load_report().num_running == 0, 2.0))
        assert slowest < 0.1, f"a wave took {slowest * 1000:.0f} ms to stop"
        await _wait_until(lambda: stack.service.server.in_flight == 0, 2.0)
        assert engine.active_blocks == baseline
        registry = stack.frontend.metrics.registry
        assert registry.get_sample_value("kvmesh_frontend_client_disconnects_total") == 1000
