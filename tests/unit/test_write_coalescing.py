"""SSE write coalescing (frontend/server.py ResponseStream + WriteTicks): a stream's
first write in a loop iteration goes out at once, later writes of the same iteration
go out together at the start of the next one, the end of the stream carries what is
still held, and nothing is held for a client that left."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvmesh.frontend.server import ResponseStream, WriteTicks


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def _stream(ticks: WriteTicks, chunked: bool = False) -> tuple[ResponseStream, _Transport]:
    transport = _Transport()
    out = ResponseStream(SimpleNamespace(transport=transport), chunked, True, ticks)  # type: ignore[arg-type]
    out.start(200, [(b"content-type", b"text/event-stream")])
    return out, transport


async def _next_iteration() -> None:
    """Resume one loop iteration later (after the callbacks already scheduled)."""
    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, None)
    await fut


async def test_the_first_write_goes_out_at_once_with_the_head() -> None:
    out, transport = _stream(WriteTicks())
    out.write(b"a")
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200") and transport.writes[0].endswith(b"a")


async def test_writes_of_one_iteration_after_the_first_go_out_together_next_iteration() -> None:
    out, transport = _stream(WriteTicks())
    out.write(b"a")
    out.write(b"b")
    out.write(b"c")
    assert len(transport.writes) == 1  # b and c held
    await _next_iteration()
    assert transport.writes[1:] == [b"bc"]
    assert out.writes == 2


async def test_a_write_in_a_later_iteration_is_not_delayed() -> None:
    out, transport = _stream(WriteTicks())
    out.write(b"a")
    await _next_iteration()
    out.write(b"b")  # first write of this iteration: at once
    assert transport.writes[1:] == [b"b"]
    await _next_iteration()
    await _next_iteration()
    out.write(b"c")
    assert transport.writes[2:] == [b"c"]


async def test_the_end_carries_what_is_held_in_order_chunked() -> None:
    out, transport = _stream(WriteTicks(), chunked=True)
    out.write(b"one")
    out.write(b"two")
    out.end(b"[DONE]")
    assert transport.writes[1:] == [b"3\r\ntwo\r\n6\r\n[DONE]\r\n0\r\n\r\n"]
    await _next_iteration()
    assert len(transport.writes) == 2  # nothing flushed twice


async def test_streams_share_the_iteration_count_but_not_their_bytes() -> None:
    ticks = WriteTicks()
    (a, ta), (b, tb) = _stream(ticks), _stream(ticks)
    a.write(b"a1")
    b.write(b"b1")  # b's own first write of the iteration: at once
    a.write(b"a2")
    assert len(ta.writes) == 1 and len(tb.writes) == 1
    await _next_iteration()
    assert ta.writes[1:] == [b"a2"] and len(tb.writes) == 1


async def test_nothing_is_written_for_a_client_that_left() -> None:
    out, transport = _stream(WriteTicks())
    out.write(b"a")
    out.write(b"b")
    out._lost()
    await _next_iteration()
    out.end(b"z")
    assert len(transport.writes) == 1
