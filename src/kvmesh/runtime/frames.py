"""Request-plane frames: what travels on one TCP connection between a caller and a
worker. Many streams share a connection; each frame names its stream id (``sid``).

Wire format: a 4-byte big-endian length, then one msgpack-encoded frame::

    caller → worker   Req(sid, endpoint, payload)   open a stream
                      Ctl(sid, action)              STOP (graceful) or KILL
    worker → caller   Ack(sid)                      the stream was accepted
                      Out(sid, payload)             one response item
                      End(sid)                      the stream finished normally
                      Err(sid, kind, message)       typed failure; ends the stream

Payloads are msgpack of the endpoint's own Struct types, kept as ``msgspec.Raw`` so
the transport never decodes what it does not route.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Union

import msgspec

from kvmesh.errors import InvalidArgument

__all__ = [
    "Req",
    "Ctl",
    "Ack",
    "Out",
    "End",
    "Err",
    "Frame",
    "STOP",
    "KILL",
    "MAX_FRAME_BYTES",
    "FrameWriter",
    "FrameReader",
]

STOP = 1
KILL = 2
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Req(msgspec.Struct, tag=1, array_like=True):
    sid: int
    endpoint: str
    payload: msgspec.Raw


class Ctl(msgspec.Struct, tag=2, array_like=True):
    sid: int
    action: int


class Ack(msgspec.Struct, tag=3, array_like=True):
    sid: int


class Out(msgspec.Struct, tag=4, array_like=True, gc=False):
    sid: int
    payload: msgspec.Raw


class End(msgspec.Struct, tag=5, array_like=True):
    sid: int


class Err(msgspec.Struct, tag=6, array_like=True):
    sid: int
    kind: str
    message: str


Frame = Union[Req, Ctl, Ack, Out, End, Err]

_LEN = struct.Struct(">I")


class FrameWriter:
    """Queues length-prefixed frames. With a ``transport`` set, :meth:`send` writes what
    was queued in one event-loop iteration with one syscall (the flush is scheduled
    with ``call_soon``); without one, frames are dropped at the flush."""

    __slots__ = ("buffer", "_encoder", "transport", "_scheduled")

    def __init__(self) -> None:
        self.buffer = bytearray()
        self._encoder = msgspec.msgpack.Encoder()
        self.transport: asyncio.WriteTransport | None = None
        self._scheduled = False

    def add(self, frame: Frame) -> None:
        buf = self.buffer
        start = len(buf)
        buf.extend(b"\0\0\0\0")
        self._encoder.encode_into(frame, buf, -1)
        _LEN.pack_into(buf, start, len(buf) - start - 4)

    def take(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def send(self, frame: Frame) -> None:
        self.add(frame)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self.transport is not None and self.buffer:
            self.transport.write(self.take())
        else:
            self.buffer.clear()


class FrameReader:
    """Incremental frame parser. ``feed`` returns the complete frames so far.

    Raises :class:`InvalidArgument` for an oversized or undecodable frame; the
    connection owner then closes the connection.
    """

    __slots__ = ("_buf", "_decoder", "_max")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[Frame]:
        if self._buf:
            self._buf.extend(data)
            data = bytes(self._buf)
            self._buf.clear()
        # Frames are decoded from slices of one immutable bytes object: msgspec.Raw
        # payloads keep a reference to it, so it must never be resized.
        view = memoryview(data)
        frames = []
        pos = 0
        end = len(data)
        decode = self._decoder.decode
        while end - pos >= 4:
            (size,) = _LEN.unpack_from(data, pos)
            if size > self._max:
                raise InvalidArgument(f"frame of {size} bytes exceeds the limit of {self._max} bytes")
            if end - pos - 4 < size:
                break
            try:
                frames.append(decode(view[pos + 4 : pos + 4 + size]))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise InvalidArgument(f"malformed frame: {exc}") from None
            pos += 4 + size
        if pos < end:
            self._buf.extend(view[pos:])
        return frames
