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

Sealed (with a cluster secret, without TLS; see :mod:`kvmesh.runtime.auth`), each write
of frames ends with a **tag frame**: the length prefix ``0x3FFFFFFF``, which no frame
has, then a 16-byte tag over everything this direction sent so far (its frames and tag
frame prefixes; keyed BLAKE2b under the direction's key from the handshake)::

    u32 len | frame | u32 len | frame ... | u32 0x3FFFFFFF | tag

:class:`SealedFrameReader` parses frames as they come (each length checked against the
limit from its prefix, as unsealed), folds their bytes into the MAC, and hands out no
frame before the tag after it has checked: a tag that does not match raises
:class:`~kvmesh.runtime.auth.AuthError` (the connection is closed). Between two tags at
most ``MAX_BATCH`` bytes of frames may start (a writer puts a tag after the frame that
reaches it), so what waits for its tag is bounded by ``MAX_BATCH`` plus one frame; a
reader refuses more.
"""

from __future__ import annotations

import asyncio
import hmac
import struct
from typing import Any, Union

import msgspec

from kvmesh.errors import InvalidArgument
from kvmesh.runtime.auth import AUTH_FAILED, SMALL, AuthError, Keyed

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
    "SealedFrameReader",
    "MAX_BATCH",
    "TAG_FRAME",
]

STOP = 1
KILL = 2
MAX_FRAME_BYTES = 64 * 1024 * 1024  # what a caller accepts from a worker
MAX_REQUEST_FRAME = 16 * 1024 * 1024  # what a worker accepts from a caller
MAX_STREAMS = 4096  # streams open at once on one connection
# a coalescing writer's flush (FrameWriter) waits this many loop iterations, or until
# the first frame it holds is this old: a busy worker's consecutive steps share a write,
# and a stream's tokens in it one frontend wake-up, SSE event and socket write
COALESCE_ROUNDS = 8
COALESCE_MAX_S = 0.010


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
TAG_FRAME = 0x3FFF_FFFF  # a length past every frame limit: a tag follows (< 2**30: a fast int compare)
_TAG_HEAD = _LEN.pack(TAG_FRAME)
_TAG = 16  # the tag's bytes (BLAKE2b with digest_size=16)
_TAGGED = 4 + _TAG  # a tag frame
_SMALL_COPY = 4096  # up to this size the MAC is given a copy of the bytes, past it a view
_same = hmac.compare_digest  # constant time (a tag's first wrong byte tells an attacker nothing)
MAX_BATCH = 1024 * 1024  # bytes of frames after which a sealed writer puts a tag
_ONE_BATCH = MAX_BATCH + len(_TAG_HEAD)  # a write up to this size (tag frame prefix included) needs one tag


class FrameWriter:
    """Queues length-prefixed frames. With a ``transport`` set, :meth:`send` writes what
    was queued in one event-loop iteration with one syscall (the flush is scheduled
    with ``call_soon``); without one, frames are dropped at the flush.

    ``coalesce`` (the worker side): the flush waits up to :data:`COALESCE_ROUNDS` more
    loop iterations, at most until the first frame held is :data:`COALESCE_MAX_S` old,
    so frames from back-to-back work (a fast engine's consecutive steps, each of which
    yields to the loop) share one write, and the caller one wake-up per stream. A loop
    with nothing else ready runs those iterations at once: a frame waits at most that
    many rounds of ready work and never much past the time bound. An ``urgent`` frame
    (a stream's first token) is flushed in this iteration.

    :meth:`seal` (once the cluster-secret handshake is done): each flush ends with a tag
    frame (one MAC per write, not per frame; see the module docstring).

    :meth:`window` (coalescing): a sender whose source merges what accumulates while it is
    not read (an engine's mailbox) waits for the open window to close instead of reading
    its next item now. Closing resolves the window's future *before* the flush runs (the
    flush is scheduled after the woken tasks), so what they send then (all that
    accumulated in the window, as one item) goes out in this very write: a stream's tokens
    wait no longer than without waiting, and travel as one item per write, not one each."""

    __slots__ = ("parts", "_encode", "transport", "_scheduled", "_coalesce", "_now", "_mac", "_round", "_since", "_waiters")

    def __init__(self, coalesce: bool = False) -> None:
        self.parts: list[bytes] = []  # encoded frames, each with its length prefix
        self._encode = msgspec.msgpack.Encoder().encode
        self.transport: asyncio.WriteTransport | None = None
        self._scheduled = False  # a flush is scheduled (this iteration or the next)
        self._coalesce = coalesce
        self._now = False  # a flush is scheduled for this iteration
        self._mac: Keyed | None = None  # this direction's MAC state once sealed
        self._round = 0  # coalescing: the iterations waited so far
        self._since = 0.0  # coalescing: when the first frame held was queued (loop time)
        self._waiters: list[asyncio.Future[None]] = []  # resolved as the open window closes

    def seal(self, key: bytes) -> None:
        """From now on every write ends with the tag of the stream so far, under ``key``."""
        self._mac = SMALL(key)

    def add(self, frame: Frame | OutItem) -> None:
        data = self._encode(frame)  # a frame that cannot be encoded leaves nothing queued
        self.parts.append(_LEN.pack(len(data)) + data)

    def take(self) -> bytes:
        parts = self.parts
        if self._mac is None:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        elif len(parts[0]) >= MAX_BATCH:  # one big frame: not joined twice
            data = self._batches(parts)
        else:
            parts.append(_TAG_HEAD)
            data = b"".join(parts)
            if len(data) > _ONE_BATCH:
                parts.pop()
                data = self._batches(parts)
            else:  # the common case, one tag: two short copies cost less than more calls
                mac = self._mac
                mac.update(data)
                data += mac.digest()
        parts.clear()
        return data

    def _batches(self, parts: list[bytes]) -> bytes:
        """Sealed frames past :data:`MAX_BATCH`: a tag after each frame that reaches it."""
        mac = self._mac
        assert mac is not None
        out: list[bytes] = []
        size = 0
        for part in parts:
            mac.update(part)
            out.append(part)
            size += len(part)
            if size >= MAX_BATCH:
                mac.update(_TAG_HEAD)
                out += (_TAG_HEAD, mac.digest())
                size = 0
        if size:
            mac.update(_TAG_HEAD)
            out += (_TAG_HEAD, mac.digest())
        return b"".join(out)

    def send(self, frame: Frame | OutItem, urgent: bool = False) -> None:
        self.add(frame)
        if self._coalesce and not urgent:
            if not self._scheduled:
                self._scheduled = True
                self._round = 0
                loop = asyncio.get_running_loop()
                self._since = loop.time()
                loop.call_soon(self._next_round, loop)
        elif not self._now:
            self._close(asyncio.get_running_loop())

    def window(self) -> asyncio.Future[None] | None:
        """A future of the open coalescing window's end (see the class docstring), one per
        waiter (cancelling one waiter cancels nobody else's); None when no window is open
        (nothing held, or the flush already runs in this iteration)."""
        if not self._scheduled or self._now:
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    def _next_round(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._now or not self._scheduled:  # an urgent frame took the flush (and maybe ran it)
            return
        self._round += 1
        if self._round < COALESCE_ROUNDS and loop.time() - self._since < COALESCE_MAX_S:
            loop.call_soon(self._next_round, loop)
        else:
            self._close(loop)

    def _close(self, loop: asyncio.AbstractEventLoop) -> None:
        """Flush in the next iteration, after the window's waiters (their wake-ups are
        scheduled first) have sent what they hold."""
        self._scheduled = self._now = True
        self._release()
        loop.call_soon(self.flush)

    def _release(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def flush(self) -> None:
        self._scheduled = self._now = False
        self._release()  # a direct flush (a close, an error reply) ends the window too
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

    def sealed(self, key: bytes) -> SealedFrameReader:
        """A reader of this one's limit for the sealed frames that follow the handshake
        (``key``: the peer's direction's); this one must hold nothing yet."""
        assert not self._chunks, "bytes before the handshake ended"
        return SealedFrameReader(key, self._max)

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        if self._chunks:
            joined = self._join(data)
            if joined is None:
                return []
            data = joined
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
            self._keep(data, pos)
        return frames

    def _join(self, data: bytes | memoryview) -> bytes | None:
        """``data`` after the reads held for an incomplete frame, joined once the frame
        (or the next length prefix) is complete; None while it is not."""
        self._chunks.append(data)
        self._have += len(data)
        if self._have < self._need:
            return None
        joined = b"".join(self._chunks)
        self._chunks.clear()
        self._have = 0
        return joined

    def _keep(self, data: bytes | memoryview, pos: int) -> None:
        """Hold ``data[pos:]``, the start of a frame (or of a tag frame) for the next read."""
        rest = data[pos:] if pos else data
        self._chunks.append(rest)
        self._have = len(rest)
        if len(rest) < 4:
            self._need = 4
        else:
            (size,) = _LEN.unpack_from(rest)
            self._need = 4 + (_TAG if size == TAG_FRAME else size)


class SealedFrameReader(FrameReader):
    """A :class:`FrameReader` for sealed frames (see the module docstring): frames are
    parsed and decoded as they arrive, their bytes folded into the MAC, and handed out
    only once the tag frame after them has checked. :class:`AuthError` for a tag that does
    not match, or for more frames waiting for a tag than a sealed writer lets through
    (:data:`MAX_BATCH` and one frame); a malformed frame is reported once its tag has
    checked (garbage injected on the way is an authentication failure, not the peer's bug)."""

    __slots__ = ("_mac", "_pending", "_open", "_malformed")

    def __init__(self, key: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes >= TAG_FRAME:
            raise ValueError(f"a sealed frame reader's limit must be under {TAG_FRAME} bytes")
        super().__init__(max_frame_bytes)
        self._mac = SMALL(key)  # absorbs the stream as the peer's FrameWriter did
        self._pending: list[Frame] = []  # decoded, waiting for their tag
        self._open = 0  # their bytes
        self._malformed: InvalidArgument | None = None  # a frame among them that did not decode

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        if self._chunks:
            joined = self._join(data)
            if joined is None:
                return []
            data = joined
        view = memoryview(data)
        frames = self._pending  # the frames waiting for a tag come first
        checked = 0  # frames[:checked] passed their tag
        pos = start = 0  # start: the first byte the MAC has not absorbed
        end = len(data)
        decode = self._decoder.decode
        while end - pos >= 4:
            (size,) = _LEN.unpack_from(data, pos)
            if size > self._max:
                if size != TAG_FRAME:
                    raise InvalidArgument(f"frame of {size} bytes exceeds the limit of {self._max} bytes")
                if end - pos < _TAGGED:
                    break
                pos += 4
                mac = self._mac
                # the frames and this tag frame's prefix: a small copy costs less than a view
                mac.update(data[start:pos] if pos - start < _SMALL_COPY else view[start:pos])
                if not _same(mac.digest(), data[pos : pos + _TAG]):
                    raise AuthError(AUTH_FAILED)
                if self._malformed is not None:
                    raise self._malformed
                pos = start = pos + _TAG
                checked = len(frames)
                continue
            if end - pos - 4 < size:
                break
            try:
                frames.append(decode(view[pos + 4 : pos + 4 + size]))
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
                self._malformed = self._malformed or InvalidArgument(f"malformed frame: {exc}")
            pos += 4 + size
        if start == end:  # the common case: the read ended with a tag frame
            self._pending = []
            self._open = 0
            return frames
        return self._wait(data, frames, checked, start, pos)

    def _wait(self, data: bytes | memoryview, frames: list[Frame], checked: int, start: int, pos: int) -> list[Frame]:
        """The end of a read that left frames waiting for their tag, or part of a frame:
        absorb and keep them; ``frames[:checked]`` passed their tag. AuthError past what
        a sealed writer sends without a tag (:data:`MAX_BATCH` and one frame)."""
        if start < pos:
            self._mac.update(memoryview(data)[start:pos])
        if pos < len(data):
            self._keep(data, pos)
        self._open = pos - start + (self._open if start == 0 else 0)
        if self._open >= MAX_BATCH + 4 + self._max:
            raise AuthError(f"frame authentication failed: over {self._open} bytes of frames without a tag")
        self._pending = frames[checked:]
        return frames[:checked]
