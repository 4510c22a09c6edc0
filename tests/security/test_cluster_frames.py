"""An on-path attacker between two members of a fleet that share a cluster secret and
run without TLS: the handshake passes through it untouched, then it alters, injects or
replays bytes. Every frame after the handshake must be authenticated (tags keyed by the
handshake over the whole stream so far, an implicit sequence number: tag frames in the
request plane's frame stream, records on KV transfer): the connection closes and nothing
it sent is acted on. Request plane (TcpClient ↔ TcpServer) and KV transfer."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import tracemalloc
from collections.abc import Callable

import msgspec
import pytest

from kvmesh.disagg.transfer import KvTransferServer, TcpKvConnector
from kvmesh.errors import Disconnected, KvmeshError
from kvmesh.protocol import KvEndpoint, KvLayout
from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret, Handshake
from kvmesh.runtime.context import Context
from kvmesh.errors import InvalidArgument
from kvmesh.runtime.frames import MAX_BATCH, MAX_FRAME_BYTES, TAG_FRAME, FrameReader, FrameWriter, Out, Req
from kvmesh.runtime.tcp_client import TcpClient
from kvmesh.runtime.tcp_server import TcpServer

pytestmark = pytest.mark.timeout(60)

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
SECRET = ClusterSecret(b"f" * 32)
HANDSHAKE_UP = 4 + 16 + 32  # client → server: MAGIC + nonce, then the proof


class OnPath:
    """A loopback TCP relay to ``127.0.0.1:target`` that plays the attacker: ``down``
    rewrites what the server sends, :meth:`inject_up` adds bytes towards the server,
    ``up_log`` keeps what the client sent. ``closed`` is set once a side hangs up."""

    def __init__(self, target: int, down: Callable[[bytes], bytes] | None = None) -> None:
        self.target = target
        self.down = down or (lambda data: data)
        self.port = 0
        self.up_log: list[bytes] = []
        self.closed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._up: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> OnPath:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._up = up_writer
        self._writers += [writer, up_writer]
        for src, dst, change in ((reader, up_writer, self._log_up), (up_reader, writer, self.down)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst, change))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _log_up(self, data: bytes) -> bytes:
        self.up_log.append(data)
        return data

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, change: Callable[[bytes], bytes]) -> None:
        try:
            while data := await src.read(65536):
                dst.write(change(data))
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            with contextlib.suppress(Exception):
                dst.transport.abort()

    def inject_up(self, data: bytes) -> None:
        assert self._up is not None
        self._up.write(data)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "neither the attack's effect nor a closed connection was seen"
        await asyncio.sleep(0.01)


def _frame(frame: Req) -> bytes:
    w = FrameWriter()
    w.add(frame)
    return w.take()


@pytest.fixture
async def plane():
    """A worker with a secret, a relay in front of it, a caller (same secret) through it;
    ``calls``: the payloads the worker's handler ran for."""
    calls: list[str] = []

    async def gen(payload, ctx):
        calls.append(dec(payload))
        yield "GENUINE-TOKEN"

    server = TcpServer(secret=SECRET, tls=None)
    server.register("gen", gen)
    await server.start()
    relays: list[OnPath] = []

    async def through(down: Callable[[bytes], bytes] | None = None) -> tuple[OnPath, TcpClient]:
        relay = await OnPath(server.port, down).start()
        relays.append(relay)
        return relay, TcpClient(f"127.0.0.1:{relay.port}", secret=SECRET, tls=None)

    try:
        yield through, calls
    finally:
        for relay in relays:
            await relay.close()
        await server.close()


async def _ask(client: TcpClient, text: str) -> list[str]:
    return [x async for x in client.stream("gen", enc(text), Context("t"), decode=dec)]


async def test_an_injected_request_frame_runs_nothing_and_closes_the_connection(plane, caplog):
    through, calls = plane
    relay, client = await through()
    try:
        assert await _ask(client, "genuine") == ["GENUINE-TOKEN"]  # the handshake passed the relay
        relay.inject_up(_frame(Req(77, "gen", msgspec.Raw(enc("injected")))))
        with contextlib.suppress(Disconnected):  # the caller goes on; its next request follows the injected bytes
            await _ask(client, "after")
        await _until(lambda: "injected" in calls or relay.closed.is_set())
        assert "injected" not in calls, "a frame injected after the handshake ran a generation on the worker"
        assert "frame authentication failed" in caplog.text
    finally:
        await client.close()


async def test_an_injected_frame_with_a_forged_tag_runs_nothing(plane, caplog):
    """The attacker who knows the wire format: the frame and a tag frame after it, with a
    tag it cannot compute."""
    through, calls = plane
    relay, client = await through()
    try:
        assert await _ask(client, "genuine") == ["GENUINE-TOKEN"]
        frame = _frame(Req(78, "gen", msgspec.Raw(enc("injected"))))
        relay.inject_up(frame + struct.pack(">I", TAG_FRAME) + bytes(16))
        await _until(lambda: "injected" in calls or relay.closed.is_set())
        assert "injected" not in calls, "a record with a forged tag ran a generation on the worker"
        assert "frame authentication failed" in caplog.text
    finally:
        await client.close()


async def test_an_altered_token_never_reaches_the_caller(plane, caplog):
    through, calls = plane
    relay, client = await through(down=lambda data: data.replace(b"GENUINE", b"FORGED!"))
    try:
        try:
            got: list[str] | None = await _ask(client, "genuine")
        except Disconnected:
            got = None
        assert got is None, f"a token altered on the way reached the caller: {got}"
        assert "frame authentication failed" in caplog.text
    finally:
        await client.close()


async def test_a_replayed_request_runs_once(plane):
    through, calls = plane
    relay, client = await through()
    try:
        assert await _ask(client, "once") == ["GENUINE-TOKEN"]
        recorded = b"".join(relay.up_log)[HANDSHAKE_UP:]  # the request, as the caller sent it
        assert recorded
        relay.inject_up(recorded)
        await _until(lambda: len(calls) > 1 or relay.closed.is_set())
        assert calls == ["once"], f"a recorded request replayed on the connection ran again: {calls}"
    finally:
        await client.close()


async def test_a_caller_reconnects_after_a_tampered_connection_closed(plane):
    through, calls = plane
    flips = [True]

    def once(data: bytes) -> bytes:  # alter the first answer only
        if flips and b"GENUINE" in data:
            flips.clear()
            return data.replace(b"GENUINE", b"FORGED!")
        return data

    relay, client = await through(down=once)
    try:
        with pytest.raises(Disconnected):
            await _ask(client, "first")
        assert await _ask(client, "second") == ["GENUINE-TOKEN"]  # a fresh connection, a fresh handshake
    finally:
        await client.close()


# ---------------------------------------------------------------------- KV transfer

BLOCK = 4096


class _Blocks:
    """Just enough of an engine for the KV-transfer server: blocks of bytes."""

    def __init__(self) -> None:
        self.blocks = {i: bytes([65 + i]) * BLOCK for i in range(8)}

    def kv_layout(self) -> KvLayout:
        return KvLayout("stub", 16, 8, (BLOCK,), "uint8", BLOCK, BLOCK)

    def kv_export(self, block_ids) -> bytes:
        return b"".join(self.blocks[i] for i in block_ids)

    def kv_import(self, block_ids, data: bytes) -> None:
        for n, i in enumerate(block_ids):
            self.blocks[i] = bytes(data[n * BLOCK : (n + 1) * BLOCK])


def _flip_first(marker: bytes, to: bytes) -> Callable[[bytes], bytes]:
    done: list[bool] = []

    def change(data: bytes) -> bytes:
        if not done and marker in data:
            done.append(True)
            return data.replace(marker, to, 1)
        return data

    return change


@pytest.fixture
async def kv():
    engine = _Blocks()
    server = KvTransferServer(engine, secret=SECRET, tls=None)  # type: ignore[arg-type]
    await server.start()
    try:
        yield engine, server
    finally:
        await server.close()


class _UpTamper(OnPath):
    """Alters what the client sends instead (the relay's other direction)."""

    def __init__(self, target: int, up: Callable[[bytes], bytes]) -> None:
        super().__init__(target)
        self._change_up = up

    def _log_up(self, data: bytes) -> bytes:
        return self._change_up(super()._log_up(data))


async def test_kv_altered_on_the_way_is_not_written(kv, caplog):
    engine, server = kv
    server.expect("t1", readable=[], writable=[5])
    relay = await _UpTamper(server.port, _flip_first(b"K" * 64, b"K" * 63 + b"X")).start()
    connector = TcpKvConnector(secret=SECRET, tls=None)
    peer = KvEndpoint(f"127.0.0.1:{relay.port}", engine.kv_layout())
    try:
        with contextlib.suppress(KvmeshError):
            await connector.write(peer, "t1", [5], b"K" * BLOCK, engine.kv_layout())
        await _until(lambda: engine.blocks[5] != bytes([70]) * BLOCK or relay.closed.is_set())
        assert engine.blocks[5] == bytes([70]) * BLOCK, "KV altered on the way was written into the worker's blocks"
        assert "frame authentication failed" in caplog.text
    finally:
        await connector.close()
        await relay.close()


async def test_kv_altered_on_the_way_never_reaches_the_reader(kv):
    engine, server = kv
    server.offer("t2", readable=[2])
    relay = await OnPath(server.port, down=_flip_first(b"C" * 64, b"C" * 63 + b"X")).start()
    connector = TcpKvConnector(secret=SECRET, tls=None)
    peer = KvEndpoint(f"127.0.0.1:{relay.port}", engine.kv_layout())
    try:
        try:
            got: bytes | None = await connector.read(peer, "t2", [2], engine.kv_layout())
        except Disconnected:
            got = None
        assert got is None, f"the reader took KV altered on the way ({got.count(b'X') if got else 0} bytes changed)"
    finally:
        await connector.close()
        await relay.close()


async def test_kv_transfer_with_the_secret_moves_large_payloads_intact(kv):
    """Payloads bigger than a record travel in several, and arrive whole."""
    engine, server = kv
    big = 3 * auth.MAX_RECORD + 123
    server.engine = _Big(big)  # type: ignore[assignment]
    server.expect("t3", readable=[0], writable=[0])
    connector = TcpKvConnector(secret=SECRET, tls=None)
    peer = KvEndpoint(server.address, server.engine.kv_layout())
    payload = bytes(range(256)) * (big // 256) + b"z" * (big % 256)
    try:
        await connector.write(peer, "t3", [0], payload, peer.layout)
        assert server.engine.data == payload  # type: ignore[attr-defined]
        assert await connector.read(peer, "t3", [0], peer.layout) == payload
    finally:
        await connector.close()


class _Big:
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = b""

    def kv_layout(self) -> KvLayout:
        return KvLayout("stub", 16, 1, (self.size,), "uint8", self.size, self.size)

    def kv_export(self, block_ids) -> bytes:
        return self.data

    def kv_import(self, block_ids, data: bytes) -> None:
        self.data = bytes(data)


# ---------------------------------------------------------------------- the sealed frames themselves


def _pair() -> tuple[Handshake, Handshake]:
    client, server = Handshake(SECRET, "request", client=True), Handshake(SECRET, "request", client=False)
    reply, _ = server.feed(client.start())
    proof, _ = client.feed(reply)
    server.feed(proof)
    return client, server


def _sealed_writer(key: bytes) -> FrameWriter:
    w = FrameWriter()
    w.seal(key)
    return w


def _write(w: FrameWriter, *frames: Req | Out) -> bytes:
    for frame in frames:
        w.add(frame)
    return w.take()


def _out(i: int, size: int = 8) -> Out:
    return Out(i, msgspec.Raw(enc(bytes([i % 256]) * size)))


def test_frame_keys_are_per_direction_and_per_connection():
    client, server = _pair()
    assert client.keys() == server.keys()[::-1]  # what one sends with, the other checks with
    assert client.keys()[0] != client.keys()[1]
    again, _ = _pair()
    assert set(again.keys()).isdisjoint(client.keys())


def test_sealed_frames_survive_any_split_of_the_stream():
    """Writes of one frame, of several, of none but big frames, and one past MAX_BATCH
    (a tag after the frame that reaches it, and one at the end)."""
    up, _ = _pair()[0].keys()
    w = _sealed_writer(up)
    writes = [[_out(1)], [_out(2), _out(3, 0), _out(4, 5000)], [_out(5, 70_000)], [_out(6 + i, 300_000) for i in range(5)]]
    wire = b"".join(_write(w, *frames) for frames in writes)
    assert wire.count(struct.pack(">I", TAG_FRAME)) >= len(writes) + 1  # the long write carries two tags
    sent = [f for frames in writes for f in frames]
    for step in (1, 3, 4, 21, 1000, 65536, len(wire)):
        reader = FrameReader().sealed(up)
        got = [f for i in range(0, len(wire), step) for f in reader.feed(wire[i : i + step])]
        assert got == sent, step
        assert reader.buffered == 0


def test_a_frame_bigger_than_a_batch_is_sealed_whole():
    up, _ = _pair()[0].keys()
    big = _out(9, MAX_BATCH + 10)
    wire = _write(_sealed_writer(up), big)
    assert wire.count(struct.pack(">I", TAG_FRAME)) == 1 and wire[-20:-16] == struct.pack(">I", TAG_FRAME)
    for step in (4096, 65536, len(wire)):
        reader = FrameReader().sealed(up)
        assert [f for i in range(0, len(wire), step) for f in reader.feed(wire[i : i + step])] == [big], step


@pytest.mark.parametrize("joined", [False, True], ids=["one-read-each", "one-read"])
@pytest.mark.parametrize("attack", ["drop", "reorder", "replay", "tag", "frame", "untag", "other-direction"])
def test_a_write_out_of_place_fails(attack, joined):
    client, _ = _pair()
    up, down = client.keys()
    w = _sealed_writer(down if attack == "other-direction" else up)
    writes = [_write(w, _out(i)) for i in range(3)]
    if attack == "drop":
        writes = [writes[0], writes[2]]
    elif attack == "reorder":
        writes = [writes[1], writes[0]]
    elif attack == "replay":
        writes = [writes[0], writes[0]]
    elif attack == "tag":
        writes[1] = writes[1][:-1] + bytes([writes[1][-1] ^ 1])
    elif attack == "frame":
        writes[1] = writes[1][:-21] + bytes([writes[1][-21] ^ 1]) + writes[1][-20:]
    elif attack == "untag":  # the first write's tag frame cut out: its frame to pass under the next tag
        writes = [writes[0][:-20], writes[1]]
    reader = FrameReader().sealed(up)
    got = []
    with pytest.raises(auth.AuthError, match="frame authentication failed"):
        for data in [b"".join(writes)] if joined else writes:
            got += reader.feed(data)
    assert got in ([], [_out(0)]), f"frames out of place were handed out: {got}"


def test_frames_are_handed_out_only_after_their_tag():
    """A truncated write (its tag frame not there yet, or never) hands out nothing."""
    up, _ = _pair()[0].keys()
    write = _write(_sealed_writer(up), _out(1), _out(2))
    reader = FrameReader().sealed(up)
    assert reader.feed(write[:-20]) == []  # both frames whole, no tag yet
    assert reader.feed(write[-20:-1]) == []
    assert reader.feed(write[-1:]) == [_out(1), _out(2)]


def test_injected_garbage_is_an_authentication_failure_not_a_malformed_frame():
    up, _ = _pair()[0].keys()
    reader = FrameReader().sealed(up)
    garbage = struct.pack(">I", 3) + b"\xc1\xc1\xc1"  # not msgpack
    with pytest.raises(auth.AuthError, match="frame authentication failed"):
        reader.feed(garbage + _write(_sealed_writer(up), _out(1)))


def test_an_oversized_frame_is_refused_from_its_length():
    reader = FrameReader(max_frame_bytes=1 << 20).sealed(b"k" * 32)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgument, match="exceeds the limit"):
            reader.feed(struct.pack(">I", (1 << 20) + 1) + b"x" * 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_frames_without_a_tag_are_held_only_up_to_the_batch_limit():
    """A sealed writer puts a tag after at most MAX_BATCH bytes and one frame: frames
    past that without one are refused, not kept waiting in memory."""
    reader = FrameReader(max_frame_bytes=64 * 1024).sealed(b"k" * 32)
    frame = _frame(_out(1, 32 * 1024))
    with pytest.raises(auth.AuthError, match="without a tag"):
        for _ in range(MAX_BATCH // len(frame) + 4):
            assert reader.feed(frame) == []
    assert MAX_FRAME_BYTES < TAG_FRAME  # no frame limit reaches the tag frame's prefix


def test_kv_records_out_of_place_fail():
    """KV transfer's records (SealedStream): a record's tag covers the stream so far."""
    up, _ = _pair()[0].keys()
    sealer = auth.Sealer(up)
    records = [b"".join(bytes(piece) for piece in sealer.records(f"chunk {i}".encode())) for i in range(3)]
    for wire in (records[0] + records[2], records[1] + records[0], records[0] + records[0]):
        opener = auth.Opener(up)
        with pytest.raises(auth.AuthError, match="frame authentication failed"):
            for record in (wire[: len(records[0])], wire[len(records[0]) :]):
                size = auth.Opener.size(record[:4])
                opener.check(record[4 + size :], record[:4], record[4 : 4 + size])


def test_a_peer_of_the_previous_handshake_version_is_told_so():
    server = Handshake(SECRET, "request", client=False, peer="old worker")
    with pytest.raises(auth.AuthError, match="version 1 of the cluster-secret handshake"):
        server.feed(b"KVM\x01" + b"n" * 16)
    assert auth.looks_like_handshake(b"KVM\x01")  # a process without a secret still names it


async def test_without_a_secret_nothing_changes_on_the_wire():
    """No handshake, no records: a plain frame is read as it is."""

    async def gen(payload, ctx):
        yield dec(payload)

    server = TcpServer(secret=None, tls=None)
    server.register("gen", gen)
    await server.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(_frame(Req(1, "gen", msgspec.Raw(enc("plain")))))
        data = b""
        while b"plain" not in data:
            data += await asyncio.wait_for(r.read(4096), 10)
        w.close()
    finally:
        await server.close()

