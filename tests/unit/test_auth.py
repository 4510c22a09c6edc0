"""The cluster-secret handshake without I/O: both sides agree, a wrong secret fails on
both sides, proofs cannot be replayed, reflected or moved to another channel."""

from __future__ import annotations

import pytest

from kvmesh.runtime import auth
from kvmesh.runtime.auth import MAGIC, AuthError, ClusterSecret, Handshake

A = ClusterSecret(b"a" * 32)
B = ClusterSecret(b"b" * 32)


def _run(client: Handshake, server: Handshake) -> tuple[bytes, bytes]:
    """Drive both sides to the end; returns what each had after the handshake."""
    c_rest = s_rest = None
    to_server = client.start()
    to_client = b""
    for _ in range(4):
        if to_server:
            out, s_rest = server.feed(to_server)
            to_server, to_client = b"", out
        if to_client:
            out, c_rest = client.feed(to_client)
            to_client, to_server = b"", out
    assert c_rest is not None and s_rest is not None
    return c_rest, s_rest


def test_both_sides_with_the_same_secret_finish():
    client, server = Handshake(A, "request", client=True), Handshake(A, "request", client=False)
    assert _run(client, server) == (b"", b"")
    assert client.done and server.done


def test_bytes_after_the_handshake_are_handed_back():
    client, server = Handshake(A, "request", client=True), Handshake(A, "request", client=False)
    reply, _ = server.feed(client.start())
    proof, _ = client.feed(reply)
    _, rest = server.feed(proof + b"first frame")
    assert rest == b"first frame"


def test_a_wrong_secret_fails_on_both_sides():
    client, server = Handshake(B, "request", client=True), Handshake(A, "request", client=False)
    reply, _ = server.feed(client.start())
    with pytest.raises(AuthError, match="mismatch"):
        client.feed(reply)
    with pytest.raises(AuthError, match="mismatch"):
        server.feed(client.to_send_on_error)  # the client's proof still reaches the server


def test_a_proof_for_another_channel_or_nonce_does_not_open_this_one():
    recorded_client = Handshake(A, "kv", client=True)
    recorded_server = Handshake(A, "kv", client=False)
    reply, _ = recorded_server.feed(recorded_client.start())
    old_proof, _ = recorded_client.feed(reply)
    # replayed against a fresh server (new server nonce) on the same channel
    fresh = Handshake(A, "kv", client=False)
    fresh.feed(recorded_client.start())
    with pytest.raises(AuthError):
        fresh.feed(old_proof)
    # the server's own proof reflected back as a client proof
    server = Handshake(A, "request", client=False)
    reply, _ = server.feed(MAGIC + b"n" * 16)
    with pytest.raises(AuthError):
        server.feed(reply[len(MAGIC) + 16 :])
    # another channel
    other = Handshake(A, "request", client=False)
    kv_client = Handshake(A, "kv", client=True)
    reply, _ = other.feed(kv_client.start())
    with pytest.raises(AuthError):
        kv_client.feed(reply)


def test_a_peer_without_the_handshake_is_recognised_from_its_first_byte():
    server = Handshake(A, "request", client=False)
    with pytest.raises(AuthError, match="did not start the cluster-secret handshake"):
        server.feed(b"\x00\x00\x00\x10")


def test_need_never_reads_past_the_handshake():
    server = Handshake(A, "request", client=False)
    assert server.need() == 20
    server.feed(MAGIC + b"x" * 10)
    assert server.need() == 6


def test_the_process_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.process_secret() is None
    monkeypatch.setenv(auth.SECRET_ENV, "x" * 20)
    assert auth.process_secret() is not None
    f = tmp_path / "s"
    f.write_text("short\n")
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(f))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        auth.process_secret()
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read"):
        auth.process_secret()
    assert "x" * 20 not in repr(ClusterSecret(b"x" * 20))


class _Transport:
    """Enough of an asyncio transport for ProtocolHandshake: records writes and close."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


async def test_the_protocol_gate_passes_nothing_before_the_proof_and_everything_after():
    client = Handshake(A, "request", client=True)
    gate = auth.ProtocolHandshake(Handshake(A, "request", client=False), _Transport())  # type: ignore[arg-type]
    hello = client.start()
    assert gate.admit(hello[:5]) == (b"", gate)  # a partial hello: nothing passes, the gate stays
    assert gate.admit(hello[5:]) == (b"", gate)
    proof, _ = client.feed(gate._transport.written)
    passed, rest_gate = gate.admit(proof + b"first frame")
    assert (passed, rest_gate) == (b"first frame", None)  # the read that opens it: the bytes after
    assert gate.ready.done() and gate.ready.exception() is None


async def test_the_protocol_gate_stays_shut_after_a_wrong_proof():
    client = Handshake(B, "request", client=True)
    transport = _Transport()
    gate = auth.ProtocolHandshake(Handshake(A, "request", client=False), transport)  # type: ignore[arg-type]
    gate.admit(client.start())
    with pytest.raises(AuthError):
        client.feed(transport.written)
    assert gate.admit(client.to_send_on_error + b"frame") == (b"", gate)
    assert gate.admit(b"more frames") == (b"", gate)  # nothing passes, ever
    assert transport.closed and isinstance(gate.ready.exception(), AuthError)
