"""FrameWriter batching: one write per loop iteration; with ``coalesce`` (the worker
side) frames of up to COALESCE_ROUNDS + 1 consecutive iterations share a write (less
once the first is COALESCE_MAX_S old), except an urgent one."""

from __future__ import annotations

import asyncio

import msgspec

from kvmesh.protocol import OutputChunk
from kvmesh.runtime import frames
from kvmesh.runtime.frames import COALESCE_ROUNDS, End, FrameReader, FrameWriter, Out, OutItem


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


def _writer(coalesce: bool) -> tuple[FrameWriter, _Transport]:
    writer = FrameWriter(coalesce=coalesce)
    writer.transport = transport = _Transport()  # type: ignore[assignment]
    return writer, transport


async def _one_iteration() -> None:
    await asyncio.sleep(0)


async def test_frames_of_one_iteration_share_a_write():
    writer, transport = _writer(coalesce=False)
    writer.send(End(1))
    writer.send(End(2))
    await _one_iteration()
    writer.send(End(3))
    for _ in range(3):
        await _one_iteration()
    assert [len(FrameReader().feed(w)) for w in transport.writes] == [2, 1]


async def test_coalescing_writes_several_iterations_at_once_but_not_an_urgent_frame(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)  # the rounds alone (a loaded box's iterations are slow)
    writer, transport = _writer(coalesce=True)
    assert COALESCE_ROUNDS > 1
    for sid in range(1, COALESCE_ROUNDS + 1):  # one frame per iteration, COALESCE_ROUNDS iterations
        writer.send(End(sid))
        await _one_iteration()
    assert transport.writes == []  # still held
    for _ in range(3):
        await _one_iteration()
    assert [len(FrameReader().feed(w)) for w in transport.writes] == [COALESCE_ROUNDS]
    writer.send(End(99), urgent=True)
    await _one_iteration()
    assert len(transport.writes) == 2


async def test_coalescing_waits_no_longer_than_its_time_bound(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 0.0)  # every held frame is already too old
    writer, transport = _writer(coalesce=True)
    writer.send(End(1))
    writer.send(End(2))
    for _ in range(2):  # the first round sees the bound passed, the next flushes
        await _one_iteration()
    assert [len(FrameReader().feed(w)) for w in transport.writes] == [2]


async def test_an_urgent_frame_while_frames_are_held_flushes_them_once_in_order(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)
    writer, transport = _writer(coalesce=True)
    writer.send(End(1))
    await _one_iteration()
    writer.send(End(2), urgent=True)
    await _one_iteration()
    assert len(transport.writes) == 1  # at once, with what was held
    writer.send(End(3))  # held again, from a new first round
    for _ in range(COALESCE_ROUNDS + 2):
        await _one_iteration()
    assert [[f.sid for f in FrameReader().feed(w)] for w in transport.writes] == [[1, 2], [3]]


async def test_an_item_is_encoded_inside_its_out_frame():
    writer, transport = _writer(coalesce=False)
    writer.send(OutItem(7, OutputChunk(token_ids=[1, 2])))
    await _one_iteration()
    (frame,) = FrameReader().feed(transport.writes[0])
    assert isinstance(frame, Out) and frame.sid == 7
    assert msgspec.msgpack.decode(frame.payload, type=OutputChunk).token_ids == [1, 2]


async def _until(predicate, limit: int = 1000) -> None:
    for _ in range(limit):
        if predicate():
            return
        await _one_iteration()
    raise AssertionError("condition not reached")


async def test_no_window_to_wait_for_unless_one_is_open(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)
    writer, _ = _writer(coalesce=True)
    assert writer.window() is None  # nothing held
    writer.send(End(1))
    waiter = writer.window()
    assert waiter is not None and not waiter.done()
    writer.send(End(2), urgent=True)  # the flush runs in this iteration: nothing to wait for
    assert writer.window() is None
    assert waiter.done()  # an urgent frame closes the window for its waiters too
    plain, _ = _writer(coalesce=False)
    plain.send(End(1))
    assert plain.window() is None


async def test_a_window_waiter_sends_into_the_write_that_closes_the_window(monkeypatch):
    """A waiter is woken before the window's flush: what it sends then shares that write."""
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)
    writer, transport = _writer(coalesce=True)

    async def sender(sid: int) -> None:
        writer.send(End(sid))
        waiter = writer.window()
        assert waiter is not None
        await waiter
        writer.send(End(sid + 100))  # what accumulated meanwhile

    tasks = [asyncio.ensure_future(sender(sid)) for sid in (1, 2)]
    await _until(lambda: all(t.done() for t in tasks) and not writer.parts)
    assert [[f.sid for f in FrameReader().feed(w)] for w in transport.writes] == [[1, 2, 101, 102]]


async def test_a_cancelled_window_waiter_leaves_the_others_waiting(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)
    writer, transport = _writer(coalesce=True)
    writer.send(End(1))
    first, second = writer.window(), writer.window()
    assert first is not None and second is not None and first is not second
    first.cancel()
    assert not second.done()
    await _until(lambda: bool(transport.writes))
    assert second.done() and not second.cancelled()


async def test_a_direct_flush_releases_the_window_waiters(monkeypatch):
    monkeypatch.setattr(frames, "COALESCE_MAX_S", 3600.0)
    writer, transport = _writer(coalesce=True)
    writer.send(End(1))
    waiter = writer.window()
    assert waiter is not None
    writer.transport = None  # the connection is gone: the flush drops the frames
    writer.flush()
    assert waiter.done() and transport.writes == []


async def test_a_sealed_write_of_merged_items_round_trips_and_any_flipped_byte_is_refused():
    """What a window gathers is ordinary frames under one tag: read back exactly, and a
    flipped byte anywhere (length prefix, payload, tag frame) delivers nothing."""
    from kvmesh.errors import InvalidArgument
    from kvmesh.runtime.frames import SealedFrameReader

    key = bytes(range(32))
    writer, transport = _writer(coalesce=True)
    writer.seal(key)
    chunks = [OutputChunk(token_ids=list(range(100 * sid, 100 * sid + 9))) for sid in (1, 2, 3)]
    for sid, chunk in zip((1, 2, 3), chunks):
        writer.send(OutItem(sid, chunk))
    writer.send(End(3), urgent=True)
    await _one_iteration()
    (data,) = transport.writes
    frames = SealedFrameReader(key).feed(data)
    assert [type(f) for f in frames] == [Out, Out, Out, End]
    assert [msgspec.msgpack.decode(f.payload, type=OutputChunk) for f in frames[:3]] == chunks
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        reader = SealedFrameReader(key)
        try:
            delivered = reader.feed(bytes(bad))
        except InvalidArgument:  # AuthError included
            continue
        assert delivered == [], f"a flipped byte at {i} was delivered"
