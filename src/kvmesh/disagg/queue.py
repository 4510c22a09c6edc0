"""The global prefill queue: decode workers put remote-prefill jobs, prefill workers
pull them one at a time.

Backends (one contract, :class:`PrefillQueue`):

* :class:`JetStreamPrefillQueue`: distributed mode. A NATS JetStream stream with
  work-queue retention and one durable pull consumer shared by every prefill worker:
  a job goes to exactly one puller and leaves the stream when acknowledged; a job
  whose puller died unacknowledged is redelivered after ``ack_wait``. New prefill
  workers just start pulling: no registration.
* :class:`LocalPrefillQueue`: in-process (embedded mode; tests).
* :class:`RemotePrefillQueue`: embedded mode's worker processes reach the
  ``kvmesh run`` process's :class:`LocalPrefillQueue` over the TCP request plane
  (:func:`serve_queue` registers its endpoints there).

``status()`` counts jobs waiting to be pulled (not the ones being prefilled) and the
tokens they have left to prefill: what conditional disaggregation compares with
``max_prefill_queue_size`` / ``max_prefill_queue_tokens``.

**The bound is atomic** (:meth:`PrefillQueue.offer`): a decode worker's "is there room?"
and "put" are one step, so the limit holds across every decode worker racing for the
last place. Locally that is a check and an append with no ``await`` between them
(one event loop); embedded mode's remote queue runs that on the server
(``prefill_queue_offer``); JetStream keeps the waiting jobs and tokens in a KV-bucket
key updated by compare-and-set on its revision (a put that lost the race re-reads and
re-checks), taken back when a job is first delivered. A failed publish gives its place
back. A decode worker killed between its compare-and-set and its publish (or a prefill
worker killed between its first delivery and taking the job back) leaves the counter
off for good, so every holder of the queue **reconciles** it every ``reconcile_s``
(:meth:`JetStreamPrefillQueue.reconcile`): it reads the counter, then what the stream
really holds waiting (the durable consumer's pending count, the stream's message
count before any consumer exists; while that is off, the tokens from the pending jobs'
headers, up to :data:`RECONCILE_READ_MAX` of them), and when two rounds in a row found the counter
off the same way it sets it back by the smaller of the two differences, by
compare-and-set on the revision it read (a counter that moved meanwhile is left to the
next round; holders reconciling at once cannot correct twice). Two rounds, because a
put between its compare-and-set and its publish is counted and not yet in the stream
for a moment; a leak stays.

**With a cluster secret** (:mod:`kvmesh.runtime.auth`) the JetStream queue trusts
nothing that anyone on NATS could write:

* a job is sealed (:mod:`kvmesh.runtime.seal`, purpose ``prefill-job``): encrypted (its
  prompt's token ids are never readable on NATS nor on the NATS server's disk),
  authenticated, bound to the queue's subject and to its ``Kvmesh-Tokens`` header,
  timestamped; a puller refuses a forged or altered job, one sealed more than
  ``max_job_age_s`` ago (:data:`MAX_JOB_AGE_S`) and a replay: a nonce it opened
  before from another stream message (the same message delivered again after
  ``ack_wait`` is not a replay). Refused jobs are terminated and logged.
* the counter's value is signed: ``(replaces, jobs, tokens, mac)``, ``replaces`` the
  key's revision the value was written over, the MAC over the bucket, the key and
  the three numbers. A holder accepts a value at revision ``R`` only if its MAC is
  right and ``replaces < R``, and, once it has accepted a value at revision ``S``,
  only values with ``replaces >= S`` (every later honest write replaced ``S`` or a
  later revision: JetStream's revisions only grow), so an old signed value written
  again is refused too. A value refused (forged, unsigned, an old one again, or the
  key deleted) is ignored and logged once: the holder reads **the last value it
  accepted** (a holder that never accepted one: what the stream holds waiting, read
  once), so
  a forged "full" or "empty" changes nothing any worker reads, and its next write
  replaces the forgery by compare-and-set on the forgery's revision.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvmesh.errors import CannotConnect, InvalidArgument
from kvmesh.protocol import DisaggThresholds, KvEndpoint, PrefillJob, QueueStatus
from kvmesh.runtime import auth
from kvmesh.runtime.auth import ClusterSecret
from kvmesh.runtime.context import Context
from kvmesh.runtime.frames import MAX_REQUEST_FRAME
from kvmesh.runtime.seal import MessageSeal, SealRefused
from kvmesh.runtime.tasks import cancel_and_wait

__all__ = [
    "Delivery",
    "PrefillQueue",
    "LocalPrefillQueue",
    "JetStreamPrefillQueue",
    "RemotePrefillQueue",
    "serve_queue",
    "QUEUE_PUT",
    "QUEUE_OFFER",
    "QUEUE_PULL",
    "QUEUE_STATUS",
    "KV_METADATA",
]

T = TypeVar("T")

log = logging.getLogger(__name__)

# request-plane endpoints of embedded mode's queue server
QUEUE_PUT = "prefill_queue_put"
QUEUE_OFFER = "prefill_queue_offer"
QUEUE_PULL = "prefill_queue_pull"
QUEUE_STATUS = "prefill_queue_status"
KV_METADATA = "kv_metadata"  # a decode worker's KvEndpoint by worker id (embedded mode's discovery)

_encode = msgspec.msgpack.encode
_decode_job = msgspec.msgpack.Decoder(PrefillJob).decode

RECONCILE_S = 30.0  # how often a holder of a JetStream queue reconciles its counter
RECONCILE_READ_MAX = 1024  # pending jobs read for their tokens; past it only the job count is reconciled
# With a cluster secret, how long after it was sealed a job may still be pulled (and how
# long a puller remembers its nonce). It covers a decode worker's default
# --remote-prefill-timeout (30 s: past it the decode worker has prefilled locally and its
# KV server refuses the job's writes), a redelivery after ack_wait (60 s) and clock skew.
# A fleet with a longer --remote-prefill-timeout passes a larger max_job_age_s.
MAX_JOB_AGE_S = 120.0


@dataclass(slots=True)
class Delivery:
    """A pulled job; ``ack()`` once it is done (or abandoned for good)."""

    job: PrefillJob
    ack: Callable[[], Awaitable[None]]


class PrefillQueue(abc.ABC):
    @abc.abstractmethod
    async def put(self, job: PrefillJob) -> None:
        """Queue ``job`` whatever the queue holds."""

    @abc.abstractmethod
    async def offer(self, job: PrefillJob, limits: DisaggThresholds | None = None) -> bool:
        """Queue ``job`` only if the queue admits one more (``limits.admits(depth,
        tokens)``; the queue's own thresholds where it has them, else ``limits``),
        atomically with respect to every other ``offer``; False: refused."""

    @abc.abstractmethod
    async def status(self) -> QueueStatus: ...

    @abc.abstractmethod
    async def pull(self, timeout_s: float) -> Delivery | None:
        """The next job, or None when none came within ``timeout_s``."""

    async def close(self) -> None:
        return None


async def _no_ack() -> None:
    return None


class LocalPrefillQueue(PrefillQueue):
    """FIFO in one process; ``thresholds`` is what embedded mode hands to decode workers."""

    def __init__(self, thresholds: DisaggThresholds | None = None) -> None:
        self.thresholds = thresholds if thresholds is not None else DisaggThresholds()
        self._jobs: deque[PrefillJob] = deque()
        self._tokens = 0
        self._ready = asyncio.Condition()
        self.put_count = 0
        self.refused = 0
        self.max_depth = 0  # the most jobs it ever held

    async def put(self, job: PrefillJob) -> None:
        self._append(job)
        async with self._ready:
            self._ready.notify()

    async def offer(self, job: PrefillJob, limits: DisaggThresholds | None = None) -> bool:
        # check and append with no await between them: atomic in the event loop
        if not self.thresholds.admits(len(self._jobs), self._tokens):
            self.refused += 1
            return False
        self._append(job)
        async with self._ready:
            self._ready.notify()
        return True

    def _append(self, job: PrefillJob) -> None:
        self._jobs.append(job)
        self._tokens += job.tokens
        self.put_count += 1
        self.max_depth = max(self.max_depth, len(self._jobs))

    async def status(self) -> QueueStatus:
        return QueueStatus(len(self._jobs), self.thresholds, self._tokens)

    async def pull(self, timeout_s: float) -> Delivery | None:
        async with self._ready:
            try:
                await asyncio.wait_for(self._ready.wait_for(lambda: bool(self._jobs)), timeout_s)
            except TimeoutError:
                return None
            job = self._jobs.popleft()
            self._tokens -= job.tokens
            return Delivery(job, _no_ack)


class JetStreamPrefillQueue(PrefillQueue):
    """A JetStream work queue (see the module docstring); ``nc`` is a connected nats-py client.

    With a cluster secret jobs are sealed and the counter signed (the module docstring);
    ``ignored_counts`` counts the counter values this holder refused."""

    def __init__(
        self, nc: Any, namespace: str = "kvmesh", ack_wait_s: float = 60.0, secret: Any = auth.FROM_ENV,
        reconcile_s: float = RECONCILE_S, max_job_age_s: float = MAX_JOB_AGE_S, clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self._secret: ClusterSecret | None = auth.resolve(secret)
        self._clock = clock  # wall-clock seconds: what sealed jobs are timestamped and checked with
        self._seal = None if self._secret is None else MessageSeal(
            self._secret, "prefill-job", window_s=max_job_age_s, max_bytes=MAX_REQUEST_FRAME
        )  # fmt: skip
        self._good: tuple[int, int] | None = None  # the last counter value accepted (with a secret)
        self._seen_revision = 0  # ... and its revision
        self.ignored_counts = 0
        self.reconcile_s = reconcile_s  # 0: never (from its first use: the loop starts with the counter)
        self.repairs = 0  # times reconcile() set the counter back
        self._drift = (0, 0)  # the counter minus what the stream holds, at the last round
        self._reconciler: asyncio.Task[None] | None = None
        self._nc = nc
        self.stream = f"KVMESH_PREFILL_{namespace}".replace(".", "_").replace("-", "_")
        self.subject = f"{namespace}.prefill_queue"
        self.durable = "prefill_workers"
        self._ack_wait_s = ack_wait_s
        self.bucket = f"{self.stream}_depth"
        self._js: Any = None
        self._kv: Any = None
        self._sub: Any = None

    async def _jetstream(self) -> Any:
        if self._js is None:
            from nats.js.api import RetentionPolicy, StreamConfig
            from nats.js.errors import BadRequestError

            js = self._nc.jetstream()
            config = StreamConfig(name=self.stream, subjects=[self.subject], retention=RetentionPolicy.WORK_QUEUE)
            try:
                await js.add_stream(config)
            except BadRequestError:  # exists already (created by another worker)
                pass
            self._js = js
        return self._js

    async def _counter(self) -> Any:
        if self._kv is None:
            from nats.js.errors import BucketNotFoundError

            js = await self._jetstream()
            try:
                self._kv = await js.key_value(self.bucket)
            except BucketNotFoundError:
                from nats.js.api import KeyValueConfig
                from nats.js.errors import BadRequestError

                try:
                    self._kv = await js.create_key_value(KeyValueConfig(bucket=self.bucket, history=1))
                except BadRequestError:  # created by another worker meanwhile
                    self._kv = await js.key_value(self.bucket)
            if self._reconciler is None and self.reconcile_s > 0:
                self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_loop(), name="prefill-queue-reconcile")
        return self._kv

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_s)
            try:
                await self.reconcile()
            except Exception as exc:  # noqa: BLE001 - NATS out of reach: the next round tries again
                log.debug("prefill queue counter not reconciled: %r", exc)

    async def reconcile(self) -> bool:
        """One round (see the module docstring); True when it set the counter."""
        from nats.js.errors import KeyWrongLastSequenceError

        jobs, tokens, revision = await self._read_counter()  # first: see the docstring
        pending, after = await self._pending()
        # the tokens (a read per pending job) only while something is off: jobs and
        # tokens leak together, and a round may have fixed the jobs before the tokens
        off = jobs != pending or self._drift != (0, 0)
        really = await self._pending_tokens(pending, after) if off else None
        drift = (jobs - pending, 0 if really is None else tokens - really)
        fix = (_confirmed(self._drift[0], drift[0]), _confirmed(self._drift[1], drift[1]))
        self._drift = drift
        if fix == (0, 0) or revision == 0:
            return False
        try:
            await self._write_counter(max(0, jobs - fix[0]), max(0, tokens - fix[1]), revision)
        except KeyWrongLastSequenceError:
            return False  # moved since it was read: the next round
        self.repairs += 1
        self._drift = (drift[0] - fix[0], drift[1] - fix[1])
        log.warning(
            "prefill queue counter reconciled: it counted %+d jobs and %+d tokens the stream does not hold"
            " (a worker that died between counting a job and publishing or taking it)", fix[0], fix[1],
        )  # fmt: skip
        return True

    async def _pending(self) -> tuple[int, int]:
        """Jobs in the stream not delivered yet, and the stream sequence they follow."""
        from nats.js.errors import NotFoundError

        js = await self._jetstream()
        try:
            info = await js.consumer_info(self.stream, self.durable)
            return int(info.num_pending or 0), int(info.delivered.stream_seq or 0)
        except NotFoundError:  # no prefill worker pulled yet: every job waits
            state = (await js.stream_info(self.stream)).state
            return int(state.messages or 0), 0

    async def _pending_tokens(self, pending: int, after: int) -> int | None:
        """The tokens of the ``pending`` jobs after stream sequence ``after``, from their
        headers (None: more than :data:`RECONCILE_READ_MAX` to read)."""
        from nats.js.errors import NotFoundError

        if pending > RECONCILE_READ_MAX:
            return None
        js = await self._jetstream()
        tokens, seq = 0, after + 1
        for _ in range(pending):
            try:
                msg = await js.get_msg(self.stream, seq, next=True)
            except NotFoundError:
                break
            tokens += _header_tokens(msg)
            seq = int(msg.seq) + 1
        return tokens

    async def _read_counter(self) -> tuple[int, int, int]:
        """(waiting jobs, their tokens, the key's revision to write over; 0: no key yet).
        With a secret, a stored value that is refused reads as the fallback (the module
        docstring) with the refused value's revision, so a write replaces it."""
        from nats.js.errors import KeyNotFoundError

        kv = await self._counter()
        try:
            entry = await kv.get(_DEPTH_KEY)
        except KeyNotFoundError as exc:
            marker = getattr(exc, "entry", None)  # the key was deleted: nothing of ours deletes it
            if self._secret is None or marker is None:
                return 0, 0, 0
            return await self._ignored(int(marker.revision or 0), "the key was deleted")
        revision = int(entry.revision or 0)
        if self._secret is not None:
            why = self._accept(entry.value or b"", revision)
            if why is not None:
                return await self._ignored(revision, why)
            assert self._good is not None
            return *self._good, revision
        try:
            jobs, tokens = _decode_depth(entry.value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("prefill queue counter is malformed; starting it again from 0")
            jobs, tokens = 0, 0
        return jobs, tokens, revision

    def _accept(self, value: bytes, revision: int) -> str | None:
        """Check a signed counter value at ``revision`` (the module docstring); None:
        accepted and remembered, else why it was refused."""
        assert self._secret is not None
        try:
            depth = _decode_signed_depth(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "not signed with this fleet's cluster secret"
        if not self._secret.verify(depth.mac, "prefill-depth", *self._depth_parts(depth.replaces, depth.jobs, depth.tokens)):
            return "not signed with this fleet's cluster secret"
        if revision < self._seen_revision:  # the bucket was made again: its revisions start over
            self._seen_revision = 0
        if depth.replaces >= revision or (revision != self._seen_revision and depth.replaces < self._seen_revision):
            return "an older signed value written again"
        self._good, self._seen_revision = (depth.jobs, depth.tokens), revision
        return None

    async def _ignored(self, revision: int, why: str) -> tuple[int, int, int]:
        self.ignored_counts += 1
        if self.ignored_counts == 1:
            log.error(
                "ignoring the prefill queue counter in %s (%s): something outside the fleet wrote it; reading the last"
                " value signed with the cluster secret instead (logged once; see ignored_counts)", self.bucket, why,
            )  # fmt: skip
        if self._good is None:  # nothing accepted yet: what the stream holds waiting (read once)
            pending, after = await self._pending()
            self._good = (pending, await self._pending_tokens(pending, after) or 0)
        return *self._good, revision

    def _depth_parts(self, replaces: int, jobs: int, tokens: int) -> tuple[bytes, ...]:
        numbers = b"".join(n.to_bytes(9, "little", signed=True) for n in (replaces, jobs, tokens))
        return self.bucket.encode(), _DEPTH_KEY.encode(), numbers

    async def _write_counter(self, jobs: int, tokens: int, revision: int) -> None:
        """Compare-and-set the counter over ``revision`` (0: create the key); raises
        KeyWrongLastSequenceError (or the create race's error) when it moved."""
        kv = await self._counter()
        if self._secret is None:
            value = _encode((jobs, tokens))
        else:
            mac = self._secret.sign("prefill-depth", *self._depth_parts(revision, jobs, tokens))
            value = _encode(_SignedDepth(revision, jobs, tokens, mac))
        written = await (kv.create(_DEPTH_KEY, value) if revision == 0 else kv.update(_DEPTH_KEY, value, last=revision))
        if self._secret is not None and int(written) >= self._seen_revision:
            self._good, self._seen_revision = (jobs, tokens), int(written)

    async def _add(self, jobs: int, tokens: int, limits: DisaggThresholds | None) -> bool:
        """Compare-and-set the counter by (+jobs, +tokens), refusing when ``limits``
        do not admit one more job; retries when another writer won the race."""
        from nats.js.errors import KeyWrongLastSequenceError

        for _ in range(_CAS_TRIES):
            have_jobs, have_tokens, revision = await self._read_counter()
            if limits is not None and not limits.admits(have_jobs, have_tokens):
                return False
            try:
                await self._write_counter(max(0, have_jobs + jobs), max(0, have_tokens + tokens), revision)
            except KeyWrongLastSequenceError:
                continue  # someone else moved it first: read again
            except Exception as exc:  # noqa: BLE001 - create() raced another create()
                if "wrong last sequence" in str(exc).lower() or "key exists" in str(exc).lower():
                    continue
                raise
            return True
        raise CannotConnect(f"prefill queue counter: {_CAS_TRIES} compare-and-set attempts lost the race")

    async def put(self, job: PrefillJob) -> None:
        await self._add(1, job.tokens, None)
        await self._publish(job)

    async def offer(self, job: PrefillJob, limits: DisaggThresholds | None = None) -> bool:
        if not await self._add(1, job.tokens, limits if limits is not None else DisaggThresholds()):
            return False
        await self._publish(job)
        return True

    async def _publish(self, job: PrefillJob) -> None:
        js = await self._jetstream()
        data, tokens = _encode(job), str(job.tokens)
        if self._seal is not None:
            data = self._seal.seal(data, self._job_bind(tokens), self._clock())
        try:
            await js.publish(self.subject, data, stream=self.stream, headers={_TOKENS_HEADER: tokens})
        except BaseException:
            await _quietly_call(self._add(-1, -job.tokens, None))
            raise

    def _job_bind(self, tokens: str) -> bytes:
        """What a sealed job is bound to: the queue's subject and its tokens header."""
        return f"{self.subject}\0{tokens}".encode()

    async def status(self) -> QueueStatus:
        jobs, tokens, _ = await self._read_counter()
        return QueueStatus(jobs, tokens=tokens)

    async def pull(self, timeout_s: float) -> Delivery | None:
        """The next job, or None; :class:`CannotConnect` while NATS is out of reach
        (the puller retries: a job taken but not acknowledged is delivered again)."""
        import nats.errors

        try:
            return await self._pull(timeout_s)
        except nats.errors.Error as exc:
            raise CannotConnect(f"prefill queue unreachable: {exc or type(exc).__name__}") from None

    async def _pull(self, timeout_s: float) -> Delivery | None:
        if self._sub is None:
            from nats.js.api import AckPolicy, ConsumerConfig

            js = await self._jetstream()
            config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self._ack_wait_s, max_ack_pending=-1)
            self._sub = await js.pull_subscribe(self.subject, durable=self.durable, stream=self.stream, config=config)
        from nats.errors import TimeoutError as NatsTimeout

        try:
            msgs = await self._sub.fetch(1, timeout=timeout_s)
        except (TimeoutError, NatsTimeout):
            return None
        msg = msgs[0]
        job, counted = self._open_job(msg)
        if msg.metadata.num_delivered == 1 and counted:  # it leaves the waiting count once, on its first delivery
            await self._add(-1, -_header_tokens(msg), None)
        if job is None:
            await msg.term()
            return None
        return Delivery(job, msg.ack)

    def _open_job(self, msg: Any) -> tuple[PrefillJob | None, bool]:
        """The job in ``msg`` (None: refused, logged) and whether a put counted it (a
        forged job or a replayed copy was never counted; with a secret its tokens
        header is authenticated with it)."""
        data = msg.data
        if self._seal is not None:
            tokens = (msg.headers or {}).get(_TOKENS_HEADER, "")
            try:
                data = self._seal.open(data, self._job_bind(tokens), self._clock(), redelivery=msg.metadata.sequence.stream)
            except SealRefused as exc:
                log.error("dropping a prefill job: %s", exc.message)
                return None, exc.reason in ("expired", "future", "crowded")
        try:
            return _decode_job(data), True
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            log.error("dropping a malformed prefill job: %s", exc)
            return None, True

    async def close(self) -> None:
        reconciler, self._reconciler = self._reconciler, None
        await cancel_and_wait(reconciler)
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already gone
                pass


_DEPTH_KEY = "waiting"
_TOKENS_HEADER = "Kvmesh-Tokens"
_CAS_TRIES = 1000
_decode_depth = msgspec.msgpack.Decoder(tuple[int, int]).decode


class _SignedDepth(msgspec.Struct, array_like=True, frozen=True):
    """The counter's value with a cluster secret (the module docstring)."""

    replaces: int  # the key's revision this value was written over (0: it created the key)
    jobs: int
    tokens: int
    mac: bytes


_decode_signed_depth = msgspec.msgpack.Decoder(_SignedDepth).decode


def _confirmed(before: int, now: int) -> int:
    """The part of a counter's difference from the stream seen in two rounds in a row:
    the smaller of the two when they agree in sign, else 0."""
    if before > 0 and now > 0:
        return min(before, now)
    if before < 0 and now < 0:
        return max(before, now)
    return 0


def _header_tokens(msg: Any) -> int:
    """The tokens a job message says it carries (what its put added to the counter)."""
    try:
        return max(0, min(int((msg.headers or {}).get(_TOKENS_HEADER, "0")), 1 << 40))
    except ValueError:
        return 0


async def _quietly_call(op: Awaitable[Any]) -> None:
    try:
        await op
    except Exception as exc:  # noqa: BLE001 - best effort
        log.warning("prefill queue counter not restored: %r", exc)


class RemotePrefillQueue(PrefillQueue):
    """Embedded mode: the queue of the ``kvmesh run`` process, over the request plane."""

    def __init__(self, address: str) -> None:
        from kvmesh.runtime.tcp_client import TcpClient

        self._client = TcpClient(address)

    async def _call(self, endpoint: str, payload: bytes, decode: Callable[[msgspec.Raw], T]) -> T | None:
        from kvmesh.runtime.distributed import call

        return await call(self._client, endpoint, payload, decode)

    async def put(self, job: PrefillJob) -> None:
        from kvmesh.runtime.distributed import call

        await call(self._client, QUEUE_PUT, _encode(job))

    async def offer(self, job: PrefillJob, limits: DisaggThresholds | None = None) -> bool:
        """The server's queue decides with its own thresholds."""
        accepted = await self._call(QUEUE_OFFER, _encode(job), msgspec.msgpack.Decoder(bool).decode)
        return bool(accepted)

    async def status(self) -> QueueStatus:
        status = await self._call(QUEUE_STATUS, _encode(None), msgspec.msgpack.Decoder(QueueStatus).decode)
        if status is None:
            raise CannotConnect("the prefill queue answered no status")
        return status

    async def pull(self, timeout_s: float) -> Delivery | None:
        job = await self._call(QUEUE_PULL, _encode(timeout_s), msgspec.msgpack.Decoder(PrefillJob | None).decode)
        return None if job is None else Delivery(job, _no_ack)

    async def kv_metadata(self, worker_id: int) -> KvEndpoint | None:
        return await self._call(KV_METADATA, _encode(worker_id), msgspec.msgpack.Decoder(KvEndpoint | None).decode)

    async def close(self) -> None:
        await self._client.close()


def serve_queue(
    server: Any, queue: LocalPrefillQueue, kv_metadata: Callable[[int], Awaitable[KvEndpoint | None]]
) -> None:
    """Register the queue's endpoints (and the KV-metadata lookup) on a request server."""

    async def put(payload: bytes, ctx: Context) -> AsyncIterator[int]:
        await queue.put(_decode_or_400(payload, PrefillJob))
        yield 1

    async def offer(payload: bytes, ctx: Context) -> AsyncIterator[bool]:
        yield await queue.offer(_decode_or_400(payload, PrefillJob))

    async def status(payload: bytes, ctx: Context) -> AsyncIterator[QueueStatus]:
        yield await queue.status()

    async def pull(payload: bytes, ctx: Context) -> AsyncIterator[PrefillJob | None]:
        timeout_s = _decode_or_400(payload, float)
        delivery = await queue.pull(min(max(timeout_s, 0.0), 30.0))
        if delivery is not None and ctx.is_stopped():  # the puller went away: keep the job
            await queue.put(delivery.job)
            delivery = None
        yield None if delivery is None else delivery.job

    async def metadata(payload: bytes, ctx: Context) -> AsyncIterator[KvEndpoint | None]:
        yield await kv_metadata(_decode_or_400(payload, int))

    server.register(QUEUE_PUT, put)
    server.register(QUEUE_OFFER, offer)
    server.register(QUEUE_STATUS, status)
    server.register(QUEUE_PULL, pull)
    server.register(KV_METADATA, metadata)


def _decode_or_400(payload: bytes, kind: Any) -> Any:
    try:
        return msgspec.msgpack.decode(payload, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidArgument(f"malformed prefill-queue call: {exc}") from None
