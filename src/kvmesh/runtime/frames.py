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

Limits (each reader is given its channel's maximum; a length prefix over it closes
the connection before a byte of the frame is buffered):

=========================  =====================  ==========================================
channel                    default                why
=========================  =====================  ==========================================
caller → worker (``Req``)  ``MAX_REQUEST_FRAME``  16 MiB: a prompt of a few million tokens
worker → caller (``Out``)  ``MAX_FRAME_BYTES``    64 MiB: a model's tokenizer.json, a KV dump
streams per connection     ``MAX_STREAMS``        4096 open at once; more get ``ResourceExhausted``
=========================  =====================  ==========================================

Reassembly is linear: a partial frame's reads are kept as a list of chunks and joined
once, when the frame is complete.

With a cluster secret (and no TLS) the frames travel inside authenticated records
(:mod:`kvmesh.runtime.auth`): the writer seals what it writes at once (``sealer``), the
connection checks records before its :class:`FrameReader` sees their bytes.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Union

import msgspec

from kvmesh.errors import InvalidArgument
from kvmesh.runtime.auth import Sealer

__all__ = [
    "Req",
    "Ctl",
    "Ack",
    "Out",
    "OutItem",
    "End",
    "Err",
    "Frame",
    "STOP",
    "KILL",
    "MAX_FRAME_BYTES",
    "MAX_REQUEST_FRAME",
    "MAX_STREAMS",
    "FrameWriter",
    "FrameReader",
]

STOP = 1
KILL = 2
MAX_FRAME_BYTES = 64 * 1024 * 1024  # what a caller accepts from a worker
MAX_REQUEST_FRAME = 16 * 1024 * 1024  # what a worker accepts from a caller
MAX_STREAMS = 4096  # streams open at once on one connection


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


class OutItem(msgspec.Struct, tag=4, array_like=True, gc=False):
    """An ``Out`` frame as the worker writes it: the item itself, encoded inside the
    frame in one pass (the same bytes as ``Out(sid, Raw(encode(item)))``)."""

    sid: int
    payload: Any


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
    with ``call_soon``); without one, frames are dropped at the flush.

    ``coalesce`` (the worker side): the flush waits one more loop iteration, so frames
    from back-to-back work (a fast engine's consecutive steps, each of which yields to
    the loop) share one write, and the caller one wake-up. A loop with nothing else
    ready runs that iteration at once: the cost is at most one round of ready work.
    An ``urgent`` frame (a stream's first token) is flushed in this iteration.

    ``sealer`` (set once the cluster-secret handshake is done): what one flush writes
    goes out as one authenticated record (one MAC per write, not per frame)."""

    __slots__ = ("parts", "_encode", "transport", "_scheduled", "_coalesce", "_now", "sealer")

    def __init__(self, coalesce: bool = False) -> None:
        self.parts: list[bytes] = []  # encoded frames, each with its length prefix
        self._encode = msgspec.msgpack.Encoder().encode
        self.transport: asyncio.WriteTransport | None = None
        self._scheduled = False  # a flush is scheduled (this iteration or the next)
        self._coalesce = coalesce
        self._now = False  # a flush is scheduled for this iteration
        self.sealer: Sealer | None = None

    def add(self, frame: Frame | OutItem) -> None:
        data = self._encode(frame)  # a frame that cannot be encoded leaves nothing queued
        self.parts.append(_LEN.pack(len(data)) + data)

    def take(self) -> bytes:
        parts = self.parts
        if self.sealer is not None:
            data = self.sealer.seal(parts)
        else:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return data

    def send(self, frame: Frame | OutItem, urgent: bool = False) -> None:
        self.add(frame)
        if self._coalesce and not urgent:
            if not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._next_round)
        elif not self._now:
            self._scheduled = self._now = True
            asyncio.get_running_loop().call_soon(self.flush)

    def _next_round(self) -> None:
        if not self._now:
            self._now = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = self._now = False
        if not self.parts:
            return
        if self.transport is not None:
            self.transport.write(self.take())
        else:
            self.parts.clear()


class FrameReader:
    """Incremental frame parser. ``feed`` returns the complete frames so far.

    Raises :class:`InvalidArgument` for an oversized or undecodable frame; the
    connection owner then closes the connection. An oversized frame is refused from its
    length prefix, before anything of it is buffered.

    NOTE: frames are decoded from slices of immutable bytes objects (``msgspec.Raw``
    payloads keep a reference to them), so a partial frame is kept as a list of the
    reads that carried it and joined once, when ``_need`` bytes have arrived: every byte
    is copied at most once however many reads a frame takes.
    """

    __slots__ = ("_chunks", "_have", "_need", "_decoder", "_max")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._chunks: list[bytes | memoryview] = []  # the reads holding an incomplete frame
        self._have = 0  # their total length
        self._need = 0  # bytes needed before the next frame can be parsed
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self._max = max_frame_bytes

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return self._have

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        if self._chunks:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._have = 0
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
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
                raise InvalidArgument(f"malformed frame: {exc}") from None
            pos += 4 + size
        if pos < end:
            rest = data[pos:] if pos else data
            self._chunks.append(rest)
            self._have = len(rest)
            self._need = 4 + _LEN.unpack_from(rest)[0] if len(rest) >= 4 else 4
        return frames
