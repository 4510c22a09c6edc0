"""FrameWriter batching: one write per loop iteration; with ``coalesce`` (the worker
side) frames of two consecutive iterations share a write, except an urgent one."""

from __future__ import annotations

import asyncio

import msgspec

from kvmesh.protocol import OutputChunk
from kvmesh.runtime.frames import End, FrameReader, FrameWriter, Out, OutItem


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


async def test_coalescing_writes_two_iterations_at_once_but_not_an_urgent_frame():
    writer, transport = _writer(coalesce=True)
    writer.send(End(1))
    await _one_iteration()
    writer.send(End(2))  # the next iteration: same write as End(1)
    for _ in range(3):
        await _one_iteration()
    assert [len(FrameReader().feed(w)) for w in transport.writes] == [2]
    writer.send(End(3), urgent=True)
    await _one_iteration()
    assert len(transport.writes) == 2


async def test_an_item_is_encoded_inside_its_out_frame():
    writer, transport = _writer(coalesce=False)
    writer.send(OutItem(7, OutputChunk(token_ids=[1, 2])))
    await _one_iteration()
    (frame,) = FrameReader().feed(transport.writes[0])
    assert isinstance(frame, Out) and frame.sid == 7
    assert msgspec.msgpack.decode(frame.payload, type=OutputChunk).token_ids == [1, 2]
