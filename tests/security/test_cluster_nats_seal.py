"""Attacks on what a fleet with a cluster secret puts on NATS (real nats-server): a
subscriber reading prompts out of requests and prefill jobs, a captured request or
job sent again, tampered or moved ones, a stale one, and a forged prefill-queue
depth counter (kvmesh.runtime.seal, kvmesh.runtime.nats, kvmesh.disagg.queue).

The attacker is anyone who can subscribe and publish on the NATS server and holds
no secret; every step of the attacks below uses only what such a client can do."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest

from kvmesh.disagg.queue import JetStreamPrefillQueue
from kvmesh.protocol import DisaggThresholds, PrefillJob, PreprocessedRequest, StopConditions
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.nats import (
    CallHomeServer, NatsReply, NatsRequestClient, NatsRequestServer, connect_nats, sync_with_server,
)  # fmt: skip

pytestmark = pytest.mark.timeout(90)

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode
LEASE = 0x5EA1
SECRET = ClusterSecret(b"s" * 32)
# a prompt whose token ids are easy to spot: each packs to 5 msgpack bytes (0xce + u32)
TOKENS = [7_000_001 + 7919 * i for i in range(64)]


def _shows_tokens(data: bytes) -> list[int]:
    return [t for t in TOKENS if enc(t) in data]


async def _eventually(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Endpoints:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def tokens(self, payload, ctx):
        self.calls.append("tokens")
        yield len(dec(payload))


class Sniffer:
    """A NATS client without the secret that records every message on a subject."""

    def __init__(self) -> None:
        self.msgs: list = []

    async def start(self, nc, subject: str) -> None:
        async def cb(msg):
            self.msgs.append(msg)

        self.sub = await nc.subscribe(subject, cb=cb)
        await sync_with_server(nc)  # one flush alone can overtake the SUB


@pytest.fixture
async def fleet(nats):
    worker_nc, caller_nc, rogue_nc = [await connect_nats(nats.url) for _ in range(3)]
    eps = Endpoints()
    server = NatsRequestServer(worker_nc, "ns", "worker", LEASE, secret=SECRET)
    server.register("tokens", eps.tokens)
    await server.start()
    home = CallHomeServer(secret=SECRET)
    client = NatsRequestClient(caller_nc, home, "ns", "worker", LEASE, connect_timeout=5.0, response_timeout=10.0)
    sniffer = Sniffer()
    await sniffer.start(rogue_nc, client.subject("tokens"))
    try:
        yield server, client, eps, sniffer, rogue_nc
    finally:
        await client.close()
        await server.close()
        await home.close()
        for nc in (worker_nc, caller_nc, rogue_nc):
            await nc.close()


async def _served_once(client, sniffer) -> bytes:
    """One real request (its prompt: TOKENS); what the sniffer captured of it."""
    out = [x async for x in client.stream("tokens", enc(TOKENS), Context("real"), decode=dec)]
    assert out == [len(TOKENS)]
    await _eventually(lambda: len(sniffer.msgs) == 1)
    return sniffer.msgs[0].data


async def _send(nc, subject: str, data: bytes) -> NatsReply:
    """What an attacker gets back for publishing ``data`` as a request on ``subject``."""
    return msgspec.msgpack.decode((await nc.request(subject, data, timeout=5)).data, type=NatsReply)


async def test_a_subscriber_on_the_subject_reads_no_token_ids(fleet):
    server, client, eps, sniffer, _ = fleet
    captured = await _served_once(client, sniffer)
    assert _shows_tokens(captured) == [], "the prompt's token ids travel in clear on the worker's subject"
    assert eps.calls == ["tokens"]


async def test_a_captured_request_sent_again_is_refused(fleet, caplog):
    server, client, eps, sniffer, rogue_nc = fleet
    captured = await _served_once(client, sniffer)
    reply = await _send(rogue_nc, client.subject("tokens"), captured)
    assert reply.kind == "invalid_argument", f"the worker accepted a replayed request ({reply})"
    assert "replayed" in reply.message
    assert server.unsigned == 1
    assert eps.calls == ["tokens"]  # a refused request is answered and dropped: nothing else runs
    # the real caller is served meanwhile
    assert [x async for x in client.stream("tokens", enc([1, 2]), Context("ok"), decode=dec)] == [2]


async def test_a_tampered_or_moved_request_is_refused(fleet, nats):
    server, client, eps, sniffer, rogue_nc = fleet
    captured = await _served_once(client, sniffer)
    for i in (len(captured) - 1, len(captured) - 40, 3):  # the tag, the ciphertext, the timestamp
        tampered = bytearray(captured)
        tampered[i] ^= 0x01
        reply = await _send(rogue_nc, client.subject("tokens"), bytes(tampered))
        assert reply.kind == "invalid_argument" and "cluster secret" in reply.message, reply
    # the same sealed bytes moved to another worker's subject
    other = NatsRequestServer(rogue_nc, "ns", "worker", LEASE + 1, secret=SECRET)
    other_eps = Endpoints()
    other.register("tokens", other_eps.tokens)
    await other.start()
    try:
        reply = await _send(rogue_nc, other.subject("tokens"), captured)
        assert reply.kind == "invalid_argument" and "cluster secret" in reply.message, reply
        assert other_eps.calls == []
    finally:
        await other.close()
    assert eps.calls == ["tokens"]


async def test_a_request_sealed_long_ago_is_refused(fleet):
    from kvmesh.runtime.nats import NatsRequest
    from kvmesh.runtime.nats.wire import request_seal

    server, client, eps, sniffer, rogue_nc = fleet
    subject = client.subject("tokens")
    await client.callhome.start()  # a real call-home address: only the timestamp is wrong
    request = enc(NatsRequest(1234, client.callhome.address, msgspec.Raw(enc(TOKENS))))
    # sealed with the secret an hour ago: what a capture replayed after its nonce was forgotten looks like
    old = request_seal(SECRET).seal(request, subject.encode(), time.time() - 3600)
    reply = await _send(rogue_nc, subject, old)
    assert reply.kind == "invalid_argument" and "window" in reply.message, reply
    future = request_seal(SECRET).seal(request, subject.encode(), time.time() + 3600)
    reply = await _send(rogue_nc, subject, future)
    assert reply.kind == "invalid_argument" and "window" in reply.message, reply
    assert eps.calls == [] and server.unsigned == 2


# -- prefill jobs (JetStream)


def _job(job_id: str) -> PrefillJob:
    request = PreprocessedRequest(request_id=job_id, model="m", token_ids=TOKENS, stop=StopConditions(max_tokens=1))
    return PrefillJob(job_id, 1, request, [0, 1, 2, 3, 4], 0, len(TOKENS))


@pytest.fixture
async def queues(nats):
    nc, rogue_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    real = JetStreamPrefillQueue(nc, "seal", secret=SECRET, reconcile_s=0)
    sniffer = Sniffer()
    await sniffer.start(rogue_nc, real.subject)
    try:
        yield real, sniffer, rogue_nc
    finally:
        await real.close()
        await nc.close()
        await rogue_nc.close()


async def _pull_all(queue, tries: int = 3) -> list[str]:
    pulled = []
    for _ in range(tries):
        delivery = await queue.pull(1.0)
        if delivery is not None:
            pulled.append(delivery.job.job_id)
            await delivery.ack()
    return pulled


async def test_a_prefill_job_shows_no_token_ids_on_nats_or_on_the_server(queues):
    real, sniffer, rogue_nc = queues
    await real.put(_job("real"))
    await _eventually(lambda: len(sniffer.msgs) == 1)
    assert _shows_tokens(sniffer.msgs[0].data) == [], "a prefill job's token ids travel in clear on NATS"
    stored = await rogue_nc.jetstream().get_msg(real.stream, 1)  # what the NATS server keeps on its disk
    assert _shows_tokens(stored.data) == [], "a prefill job's token ids are stored in clear by the NATS server"
    assert await _pull_all(real) == ["real"]


async def test_a_captured_prefill_job_published_again_is_refused(queues, caplog):
    real, sniffer, rogue_nc = queues
    await real.put(_job("real"))
    await _eventually(lambda: len(sniffer.msgs) == 1)
    captured = sniffer.msgs[0]
    assert await _pull_all(real, 1) == ["real"]
    js = rogue_nc.jetstream()
    await js.publish(real.subject, captured.data, stream=real.stream, headers=captured.headers)
    assert await _pull_all(real) == [], "a replayed prefill job was pulled"
    assert "replayed" in caplog.text
    # a real job after it still goes through
    await real.put(_job("after"))
    assert await _pull_all(real) == ["after"]


async def test_a_tampered_or_misused_prefill_job_is_refused(queues, fleet, caplog):
    real, sniffer, rogue_nc = queues
    await real.put(_job("real"))
    await _eventually(lambda: len(sniffer.msgs) == 1)
    captured = sniffer.msgs[0]
    js = rogue_nc.jetstream()
    tampered = bytearray(captured.data)
    tampered[-20] ^= 0x01
    await js.publish(real.subject, bytes(tampered), stream=real.stream, headers=captured.headers)
    # the tokens header is bound to the job: a lighter-looking job is a forgery
    await js.publish(real.subject, captured.data, stream=real.stream, headers={"Kvmesh-Tokens": "1"})
    assert await _pull_all(real, 4) == ["real"]
    # both refused as forgeries (not merely as replays of the real job's nonce)
    assert caplog.text.count("dropping a prefill job: a prefill-job not signed with this fleet's cluster secret") == 2
    # a job's sealed bytes sent as a request to a worker
    server, client, eps, _, _ = fleet
    reply = await _send(rogue_nc, client.subject("tokens"), captured.data)
    assert reply.kind == "invalid_argument" and "cluster secret" in reply.message, reply
    assert eps.calls == []


async def test_a_prefill_job_sealed_long_ago_is_refused(queues, caplog):
    real, sniffer, rogue_nc = queues
    # a decode worker whose clock is an hour behind: its jobs look like captures replayed an hour later
    stale = JetStreamPrefillQueue(real._nc, "seal", secret=SECRET, reconcile_s=0, clock=lambda: time.time() - 3600)
    try:
        await stale.put(_job("stale"))
        await real.put(_job("fresh"))
        assert await _pull_all(real) == ["fresh"]
        assert "outside the 120 s window" in caplog.text
        assert (await real.status()).depth == 0  # the stale job left the count when it was dropped
    finally:
        await stale.close()


# -- the depth counter


async def _rogue_write(rogue_nc, real, value: bytes) -> None:
    kv = await rogue_nc.jetstream().key_value(real.bucket)
    await kv.put("waiting", value)


async def test_a_forged_depth_counter_changes_nothing_decode_workers_read(queues, caplog):
    real, sniffer, rogue_nc = queues
    caplog.set_level(logging.ERROR, "kvmesh.disagg.queue")
    await real.offer(_job("a"))
    kv = await rogue_nc.jetstream().key_value(real.bucket)
    after_one = (await kv.get("waiting")).value  # a signed value the attacker captured
    await real.offer(_job("b"))
    assert (await real.status()).depth == 2
    fresh = JetStreamPrefillQueue(real._nc, "seal", secret=SECRET, reconcile_s=0)  # a decode worker started now
    try:
        for forged in (enc((100, 100_000)), enc((0, 0))):  # "full", "empty"
            await _rogue_write(rogue_nc, real, forged)
            assert (await real.status()).depth == 2, f"a forged counter {forged!r} changed what a worker reads"
            assert (await fresh.status()).depth == 2, f"a forged counter {forged!r} changed what a new worker reads"
        # an old signed value written again: refused by a holder that has read a later one
        # (a holder that never read the counter cannot tell it from the current one: see queue.py)
        await _rogue_write(rogue_nc, real, after_one)
        assert (await real.status()).depth == 2, "an old signed counter value written again was believed"
        # "full" does not refuse a job the real count admits
        await _rogue_write(rogue_nc, real, enc((100, 100_000)))
        assert await real.offer(_job("c"), DisaggThresholds(max_prefill_queue_size=3))
        assert (await fresh.status()).depth == 3  # the offer wrote over the forgery, signed
        assert real.ignored_counts >= 3 and fresh.ignored_counts >= 2
        assert caplog.text.count("ignoring the prefill queue counter") == 2  # once per holder
        assert sorted(await _pull_all(real, 4)) == ["a", "b", "c"]
        assert (await fresh.status()).depth == 0
    finally:
        await fresh.close()


# -- the replay guard's bounds (pure: the clock is passed in)


def test_the_replay_guard_is_bounded_in_size_and_time():
    from kvmesh.runtime.seal import ReplayGuard

    guard = ReplayGuard(window_s=30.0, max_entries=4)
    for i in range(4):
        assert guard.admit(bytes([i]) * 12, sent=100.0 + i, now=100.0 + i) is None
    assert guard.admit(bytes([0]) * 12, sent=100.0, now=104.0) == "replayed"
    # full: the oldest nonce is forgotten, and everything sent no later than it is refused
    assert guard.admit(b"n" * 12, sent=104.0, now=104.0) is None
    assert len(guard) == 4
    assert guard.admit(bytes([0]) * 12, sent=100.0, now=104.0) == "crowded"
    # a nonce is kept only while its timestamp is inside the window
    assert guard.admit(b"late" * 3, sent=140.0, now=140.0) is None
    assert len(guard) == 1
    # the same JetStream message delivered again is no replay; another message with its nonce is
    assert guard.admit(b"job" * 4, sent=140.0, now=140.0, redelivery=7) is None
    assert guard.admit(b"job" * 4, sent=140.0, now=141.0, redelivery=7) is None
    assert guard.admit(b"job" * 4, sent=140.0, now=141.0, redelivery=8) == "replayed"


def test_a_sealed_message_over_the_size_bound_is_refused_before_it_is_decoded():
    from kvmesh.runtime.seal import SEAL_OVERHEAD, MessageSeal, SealRefused

    seal = MessageSeal(SECRET, "test", window_s=30.0, max_bytes=1024)
    now = time.time()
    assert seal.open(seal.seal(b"x" * 1024, b"s", now), b"s", now) == b"x" * 1024
    with pytest.raises(SealRefused, match="over the 1024-byte limit") as refused:
        seal.open(b"\xff" * (1024 + SEAL_OVERHEAD + 1), b"s", now)  # not msgpack: never decoded
    assert refused.value.reason == "oversize"
