"""A client that leaves mid-stream stops the engine: the request leaves the worker's
scheduler and its KV blocks go back to the pool, long before it would have ended.

"Long before" is measured against the engine's own clock, not the wall: the mocker
never runs ahead of its timing model, so a request with ``n`` tokens left needs at
least ``n`` model decode steps to end by itself. A stop must come within half of that,
whatever the machine's load; a leak (no abort) would take all of it."""

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


async def _wait_until(predicate, timeout: float, what: str = "condition") -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not met within {timeout:.2f} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def _stop_budget_s(engine, tokens_left: int) -> float:
    """Half the least time the engine needs to decode ``tokens_left`` more tokens by
    itself (its fastest step is the decode pass at zero KV usage, divided by speedup;
    it catches up at most a few ms when late, so it is never faster than that)."""
    opts = engine.options
    return 0.5 * tokens_left * opts.decode_ms(0.0) / opts.speedup / 1000.0


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
        budget = _stop_budget_s(engine, 1500 - 5)
        assert budget > 2.0  # the model's own time is long enough for "long before" to mean something
        stopped = lambda: engine.load_report().num_running == 0 and stack.service.server.in_flight == 0  # noqa: E731
        await _wait_until(stopped, budget, "request left the engine within half its natural remaining time")
        assert engine.active_blocks == baseline
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
        await _wait_until(lambda: engine.load_report().num_running == 0, _stop_budget_s(engine, 1500 - 2), "all 20 stopped")
        assert engine.active_blocks == baseline
        registry = stack.frontend.metrics.registry
        assert registry.get_sample_value("kvmesh_frontend_client_disconnects_total") == 20


async def test_a_thousand_disconnects_each_stop_early():
    """20 waves of 50 streams: each wave is cut (RST) after its first events; the wave's
    requests must all leave the engine within half the time they would need to end by
    themselves (see the module docstring), so no single request ran on; at the end the
    KV blocks are back at their baseline. The slowest wave is reported against that."""
    stack = InProcessStack(speedup=1.0)
    async with stack.running():
        engine = stack.engine
        baseline = engine.active_blocks
        slowest = 0.0
        budget = _stop_budget_s(engine, 1500 - 1)
        for _ in range(20):
            streams = [await _open_stream(stack.port, max_tokens=1500) for _ in range(50)]
            await asyncio.gather(*(_read_events(r, 1) for r, _ in streams))
            assert engine.load_report().num_running == 50
            for _, writer in streams:
                writer.transport.abort()
            took = await _wait_until(lambda: engine.load_report().num_running == 0, budget, "a wave stopped early")
            slowest = max(slowest, took)
        print(f"slowest wave stopped in {slowest * 1000:.0f} ms; budget {budget * 1000:.0f} ms")
        await _wait_until(lambda: stack.service.server.in_flight == 0, budget, "worker streams closed")
        assert engine.active_blocks == baseline
        registry = stack.frontend.metrics.registry
        assert registry.get_sample_value("kvmesh_frontend_client_disconnects_total") == 1000
