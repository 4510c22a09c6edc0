"""Chaos on three hosts: what a fleet survives, under a steady streamed load.

    sudo python bench/chaos.py                      # every scenario, one report
    sudo python bench/chaos.py --scenario cut_c     # some of them (repeatable)

Builds three network namespaces on one bridge (``tests/netns.py``: private test
addresses that exist only inside them; torn down at the end), then runs on them:

    host a: etcd member, nats-server (JetStream), `kvmesh frontend` (a second one for
            the two-frontend scenario), and the load generator
    host b: etcd member, a decode `kvmesh worker` and a prefill `kvmesh worker`
    host c: etcd member, a decode `kvmesh worker`

with the NATS request plane (``--request-plane tcp`` for the TCP one), the JetStream
prefill queue and etcd discovery (lease TTL ``--lease-ttl``). Each scenario streams requests (the openai client, 8 at a
time, prompts long enough that half of them are prefilled remotely) while it
injects its fault, and reports: requests sent, completed, identical to the
undisturbed run (the mocker is deterministic: each prompt's text is taken once
before the load), failed, the longest stall a client saw between two chunks, and
what discovery did. Scenarios, in order:

    cut_c          host c's link down mid-load (10 s, and until every request it may have
                   had has ended: "streams ended while c was cut"), then back: its
                   streams migrate to b, discovery drops c within its lease TTL (plus an election, and
                   the leases extended by it, when c's etcd member was the leader),
                   c rejoins (same process, new lease) and takes traffic
    etcd_member    one etcd member SIGKILLed, restarted later: nothing fails, no churn
    nats_restart   nats-server SIGKILLed, restarted 3 s later: nothing lost
    etcd_outage    every etcd member down for 3 lease TTLs: nothing fails, the fleet
                   is whole after
    two_frontends  two frontends on the fleet, one SIGTERMed mid-load: the client
                   fails over (as a load balancer would) and nothing fails

``python bench/chaos.py load ...`` is the load generator itself (run inside host a).
Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.netns import HOSTS, Hosts, unavailable  # noqa: E402
from tests.services import binary  # noqa: E402

MODEL = "kvmesh-tiny"
NAMESPACE = "chaos"
HTTP_PORT = 8000
MAX_TOKENS = 48
DISTINCT_PROMPTS = 8
CONCURRENCY = 8
SPEEDUP = "1"  # the mocker at real speed: streams last long enough to be cut mid-way
CUT_S = 10.0  # how long host c stays cut off, at least
CUT_WAIT_S = 30.0  # ... and at most this much longer, while requests it may have had are still open
LEADER_AT_CUT = os.environ.get("CHAOS_LEADER", "")  # "" leaves etcd's choice


def prompt(i: int) -> list[int]:
    n = 500 if i % 2 else 60  # decode workers prefill up to 300 tokens locally
    return [(k * 7 + i * 31) % 1500 + 20 for k in range(n)]


# ---------------------------------------------------------------------- load generator


async def _load(urls: list[str], count: int, stop_file: str) -> dict:
    import asyncio

    import httpx
    import openai

    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=120) for u in urls]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, float]:
        """The text, and the longest wait for a chunk (the first one included)."""
        last, gap = time.monotonic(), 0.0
        stream = await client.completions.create(
            model=MODEL, prompt=prompt(i), max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        parts: list[str] = []
        async for chunk in stream:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            parts.extend(c.text for c in chunk.choices)
        return "".join(parts), gap

    expected = {}
    for i in range(DISTINCT_PROMPTS):  # the undisturbed run
        expected[i] = (await one(clients[0], i))[0]
    state = {"sent": 0, "completed": 0, "identical": 0, "failed": 0, "failovers": 0, "stall_s": 0.0, "errors": []}
    workers_seen: list[int] = []

    async def request(n: int) -> str:
        i = n % DISTINCT_PROMPTS
        for attempt in range(len(clients) * 3):
            client = clients[(n + attempt) % len(clients)]
            try:
                text, gap = await one(client, i)
            except openai.APIConnectionError:
                if attempt + 1 == len(clients) * 3:
                    raise
                state["failovers"] += 1  # this frontend is not there: try the next one
                await asyncio.sleep(0.1)
                continue
            state["stall_s"] = max(state["stall_s"], gap)
            return text
        raise AssertionError("unreachable")

    async def loop(worker: int) -> None:
        n = worker
        while state["sent"] < count and not os.path.exists(stop_file):
            state["sent"] += 1
            print(f"open {n}", flush=True)
            try:
                text = await request(n)
                state["completed"] += 1
                state["identical"] += text == expected[n % DISTINCT_PROMPTS]
            except Exception as exc:  # noqa: BLE001 - counted and reported
                state["failed"] += 1
                state["errors"].append(repr(exc)[:300])
            print(f"progress {state['completed']} {state['failed']} {n}", flush=True)
            n += CONCURRENCY

    async def poll_health() -> None:
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                try:
                    models = (await http.get(urls[-1] + "/health")).json()["models"]
                    workers_seen.append(models.get(MODEL, 0))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await asyncio.sleep(0.25)

    poller = asyncio.ensure_future(poll_health())
    print("started", flush=True)
    await asyncio.gather(*(loop(w) for w in range(CONCURRENCY)))
    poller.cancel()
    for client in clients:
        await client.close()
    state["workers_min"] = min(workers_seen, default=0)
    state["workers_max"] = max(workers_seen, default=0)
    return state


def load_main(argv: list[str]) -> int:
    import asyncio

    p = argparse.ArgumentParser(prog="chaos.py load")
    p.add_argument("--urls", required=True, help="comma-separated frontend URLs")
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--stop-file", required=True)
    a = p.parse_args(argv)
    result = asyncio.run(_load(a.urls.split(","), a.count, a.stop_file))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------- the fleet


@dataclass
class Report:
    scenario: str
    sent: int = 0
    completed: int = 0
    identical: int = 0
    failed: int = 0
    failovers: int = 0
    stall_s: float = 0.0
    workers_min: int = 0
    workers_max: int = 0
    notes: dict[str, object] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def row(self) -> str:
        notes = ", ".join(f"{k} {v}" for k, v in self.notes.items())
        return (
            f"{self.scenario:<14} {self.sent:>5} {self.completed:>9} {self.identical:>9} {self.failed:>6} "
            f"{self.stall_s:>9.1f} {self.failovers:>9} {self.workers_min:>4}-{self.workers_max:<3} {notes}"
        )


HEADER = (
    f"{'scenario':<14} {'sent':>5} {'completed':>9} {'identical':>9} {'failed':>6} {'stall (s)':>9} {'failovers':>9} "
    f"{'seen':>8} discovery / notes"
)


class Load:
    """The load generator running in host a; progress read from its output."""

    def __init__(self, fleet: Fleet, urls: list[str]) -> None:
        self.fleet = fleet
        self.stop_file = fleet.workdir / f"stop-{time.monotonic_ns()}"
        argv = [sys.executable, str(Path(__file__).resolve()), "load", "--urls", ",".join(urls), "--stop-file", str(self.stop_file)]
        self.proc = fleet.hosts.spawn("a", argv, "load.log", env=fleet.env_common, stdout=subprocess.PIPE)
        self.completed = 0
        self.failed = 0
        self._open: set[int] = set()  # requests sent and not yet ended, by number
        self.started = threading.Event()
        self.result: dict | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "started":
                self.started.set()
            elif line.startswith("open "):
                self._open.add(int(line.split()[1]))
            elif line.startswith("progress "):
                _, done, failed, n = line.split()
                self._open.discard(int(n))
                self.completed, self.failed = int(done), int(failed)
            elif line.startswith("RESULT "):
                self.result = json.loads(line[len("RESULT ") :])

    def wait_started(self, timeout: float = 120) -> None:
        if not self.started.wait(timeout):
            raise TimeoutError("the load generator did not start")

    def in_flight(self) -> set[int]:
        """The requests under way now (as far as the generator's output has been read)."""
        return set(self._open)

    def wait_ended(self, requests: set[int], timeout: float) -> bool:
        """Until every one of ``requests`` has ended; False if one is still open past ``timeout``."""
        deadline = time.monotonic() + timeout
        while requests & self._open:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def wait_more(self, n: int, timeout: float = 90) -> None:
        """Until ``n`` more requests completed than now."""
        target = self.completed + n
        deadline = time.monotonic() + timeout
        while self.completed < target:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"load stalled at {self.completed} completed (wanted {target})")
            time.sleep(0.05)

    def finish(self, report: Report) -> Report:
        self.stop_file.touch()
        self.proc.wait(180)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.result is None:
            raise RuntimeError("the load generator printed no result")
        for key in ("sent", "completed", "identical", "failed", "failovers", "workers_min", "workers_max", "errors"):
            setattr(report, key, self.result[key])
        report.stall_s = round(self.result["stall_s"], 2)
        return report


class Fleet:
    """etcd (3 members), nats-server and the kvmesh processes on three hosts."""

    def __init__(self, hosts: Hosts, workdir: Path, lease_ttl: float, request_plane: str = "nats") -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.lease_ttl = lease_ttl
        self.request_plane = request_plane
        self.etcd: dict[str, subprocess.Popen[bytes]] = {}
        self.nats: subprocess.Popen[bytes] | None = None
        self.frontends: list[subprocess.Popen[bytes]] = []
        self.workers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}  # name -> (proc, worker id)
        self.env_common = {"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
        # the fleet listens on its namespaces' addresses, not loopback: kvmesh refuses that
        # without cluster credentials, and the fleet runs as a real one would, with a secret
        self.env_common["KVMESH_CLUSTER_SECRET"] = secrets.token_hex(32)

    # -------------------------------------------------------------- services
    def etcd_url(self, host: str) -> str:
        return f"http://{self.hosts.addr(host)}:2379"

    def start_etcd(self, host: str, state: str = "new") -> None:
        h = self.hosts
        cluster = ",".join(f"m{x}=http://{h.addr(x)}:2380" for x in HOSTS)
        argv = [
            binary("etcd"), "--name", f"m{host}", "--data-dir", str(self.workdir / f"etcd-{host}"),
            "--listen-client-urls", self.etcd_url(host), "--advertise-client-urls", self.etcd_url(host),
            "--listen-peer-urls", f"http://{h.addr(host)}:2380", "--initial-advertise-peer-urls", f"http://{h.addr(host)}:2380",
            "--initial-cluster", cluster, "--initial-cluster-state", state, "--initial-cluster-token", h.tag, "--pre-vote",
        ]  # fmt: skip
        self.etcd[host] = h.spawn(host, argv, f"etcd-{host}.log")

    def kill_etcd(self, host: str) -> None:
        proc = self.etcd.pop(host)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def etcdctl(self, *args: str, timeout: float = 10) -> str:
        endpoints = ",".join(self.etcd_url(x) for x in ("a", "b"))  # c is the one cut off
        return self.hosts.run("a", [binary("etcdctl"), "--endpoints", endpoints, "--command-timeout=3s", *args], timeout=timeout)

    def wait_etcd(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.etcdctl("put", "/chaos/ping", "1")
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def start_nats(self) -> None:
        argv = [binary("nats-server"), "-a", self.hosts.addr("a"), "-p", "4222", "-js", "-sd", str(self.workdir / "js")]
        self.nats = self.hosts.spawn("a", argv, "nats.log")
        self.hosts.wait_port(self.hosts.addr("a"), 4222, self.nats, self.hosts, "a")

    def kill_nats(self) -> None:
        assert self.nats is not None
        self.nats.send_signal(signal.SIGKILL)
        self.nats.wait(10)
        self.nats = None

    # -------------------------------------------------------------- kvmesh
    def env(self, host: str) -> dict[str, str]:
        others = [self.etcd_url(x) for x in HOSTS if x != host]
        return dict(
            self.env_common,
            KVMESH_DISCOVERY="etcd",
            KVMESH_ETCD_ENDPOINTS=",".join([self.etcd_url(host), *others]),  # the local member first
            KVMESH_NATS_URL=f"nats://{self.hosts.addr('a')}:4222",
            KVMESH_REQUEST_PLANE=self.request_plane,
            KVMESH_EVENT_PLANE="zmq",
            KVMESH_HOST=self.hosts.addr(host),
            KVMESH_NAMESPACE=NAMESPACE,
            KVMESH_LEASE_TTL=str(self.lease_ttl),
            PYTHONUNBUFFERED="1",
        )

    def start_worker(self, name: str, host: str, mode: str) -> None:
        argv = [
            sys.executable, "-m", "kvmesh.cli.main", "worker", "--mode", mode, "--speedup", SPEEDUP,
            "--max-local-prefill-length", "300", "--remote-prefill-timeout", "3", "--grace", "15",
        ]  # fmt: skip
        log = f"worker-{name}.log"
        proc = self.hosts.spawn(host, argv, log, env=self.env(host))
        self.workers[name] = (proc, self._ready_id(proc, self.workdir / log))

    def _ready_id(self, proc: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("KVMESH_READY "):
                    return int(json.loads(line[len("KVMESH_READY ") :])["lease_id"])
            if proc.poll() is not None:
                raise RuntimeError(f"{log.name}: exited with {proc.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"{log.name}: not ready within {timeout} s")

    def url(self, index: int = 0) -> str:
        return f"http://{self.hosts.addr('a')}:{HTTP_PORT + index}"

    def start_frontend(self) -> subprocess.Popen[bytes]:
        index = len(self.frontends)
        argv = [
            sys.executable, "-m", "kvmesh.cli.main", "frontend", "--http-host", self.hosts.addr("a"),
            "--http-port", str(HTTP_PORT + index), "--canary-interval", "0", "--log-level", "info",
            "--allow-unauthenticated",  # a bridge between network namespaces no one else reaches
        ]  # fmt: skip
        proc = self.hosts.spawn("a", argv, f"frontend-{index}.log", env=self.env("a"))
        self.frontends.append(proc)
        self.wait_workers(2, index)
        return proc

    def workers_seen(self, index: int = 0) -> int:
        out = self.hosts.run("a", ["curl", "-s", "--max-time", "2", self.url(index) + "/health"])
        return json.loads(out)["models"].get(MODEL, 0) if out else 0

    def wait_workers(self, n: int, index: int = 0, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.workers_seen(index) == n:
                    return
            except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"frontend {index} did not see {n} workers")
            time.sleep(0.2)

    def routed(self, worker: str) -> float:
        """Requests the first live frontend routed to ``worker``."""
        text = self.hosts.run("a", ["curl", "-s", "--max-time", "2", self.url(len(self.frontends) - 1) + "/metrics"])
        wid = f"{self.workers[worker][1]:x}"
        m = re.search(rf'kvmesh_router_decisions_total\{{model="{MODEL}",worker="{wid}"\}} ([0-9.e+]+)', text)
        return float(m.group(1)) if m else 0.0

    def leader(self) -> str:
        """The host whose etcd member leads."""
        endpoints = ",".join(self.etcd_url(x) for x in HOSTS)
        out = self.hosts.run("a", [binary("etcdctl"), "--endpoints", endpoints, "endpoint", "status", "-w", "json"])
        for status in json.loads(out):
            if status["Status"]["header"]["member_id"] == status["Status"]["leader"]:
                return next(h for h in HOSTS if self.hosts.addr(h) in status["Endpoint"])
        return "?"

    def decisions(self) -> float:
        """Routing decisions of the last frontend started, over every worker: one per
        request, plus one per move to another worker after a failure."""
        text = self.hosts.run("a", ["curl", "-s", "--max-time", "2", self.url(len(self.frontends) - 1) + "/metrics"])
        return sum(float(v) for v in re.findall(r"^kvmesh_router_decisions_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))

    def move_leader(self, host: str) -> None:
        """Make ``host``'s etcd member the leader (a cut then costs no election)."""
        if self.leader() == host:
            return
        endpoints = ",".join(self.etcd_url(x) for x in HOSTS)
        members = json.loads(self.hosts.run("a", [binary("etcdctl"), "--endpoints", endpoints, "member", "list", "-w", "json"]))
        target = next(m["ID"] for m in members["members"] if m["name"] == f"m{host}")
        current = self.etcd_url(self.leader())
        self.hosts.run("a", [binary("etcdctl"), "--endpoints", current, "move-leader", f"{target:x}"])

    def registered(self) -> set[int]:
        """Decode workers in discovery (by worker id), as etcd says."""
        out = self.etcdctl("get", "--prefix", f"/services/{NAMESPACE}/backend/generate-", "--keys-only")
        return {int(k.rsplit("-", 1)[1], 16) for k in out.split()}

    def start(self) -> None:
        for host in HOSTS:
            self.start_etcd(host)
        self.wait_etcd()
        self.start_nats()
        self.start_worker("b", "b", "decode")
        self.start_worker("c", "c", "decode")
        self.start_worker("prefill", "b", "prefill")
        self.start_frontend()

    def alive(self) -> bool:
        return all(p.poll() is None for p, _ in self.workers.values())

    def load(self, urls: list[str] | None = None) -> Load:
        load = Load(self, urls or [self.url()])
        load.wait_started()
        load.wait_more(CONCURRENCY * 2)
        return load


# ---------------------------------------------------------------------- scenarios


def _until(predicate, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``predicate()``; TimeoutError past ``timeout``."""
    start = time.monotonic()
    while not _holds(predicate):
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return round(time.monotonic() - start, 1)


def _holds(predicate) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(predicate())
    except (RuntimeError, subprocess.TimeoutExpired, ValueError):  # etcd or the frontend not answering yet
        return False


def cut_c(fleet: Fleet) -> Report:
    report = Report("cut_c")
    c_id = fleet.workers["c"][1]
    decided = fleet.decisions()
    load = fleet.load()
    try:
        # when c's member leads, the others elect a leader first, which extends leases
        if LEADER_AT_CUT:
            fleet.move_leader(LEADER_AT_CUT)
        report.notes["etcd leader"] = fleet.leader()
        fleet.hosts.cut("c")
        cut = time.monotonic()
        caught = load.in_flight()  # c's streams among them
        report.notes["c dropped after (s)"] = _until(lambda: c_id not in fleet.registered(), 30, "c dropped")
        caught |= load.in_flight()  # and any sent to c before discovery dropped it
        load.wait_more(30)
        # c stays away long enough for its connections to be found dead (its streams
        # then migrate to b), not just for TCP to retransmit over a short gap; and until
        # every request that may have gone to c has ended, or CUT_WAIT_S: one still
        # waiting for c then would only end once c is back
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut)))
        report.notes["streams ended while c was cut"] = load.wait_ended(caught, CUT_WAIT_S)
        report.notes["c cut for (s)"] = round(time.monotonic() - cut, 1)
        fleet.hosts.restore("c")
        report.notes["c back after (s)"] = _until(lambda: c_id in fleet.registered(), 30, "c re-registered")
        before = fleet.routed("c")
        report.notes["c routed again after (s)"] = _until(lambda: fleet.routed("c") >= before + 5, 60, "traffic on c")
    finally:
        fleet.hosts.restore("c")
        load.finish(report)
    # the undisturbed texts, the load, and the requests moved off c by the frontend
    report.notes["moved to b"] = int(fleet.decisions() - decided - DISTINCT_PROMPTS - report.sent)
    report.notes["processes alive"] = fleet.alive()
    return report


def etcd_member(fleet: Fleet) -> Report:
    report = Report("etcd_member")
    load = fleet.load()
    try:
        before = fleet.registered()
        fleet.kill_etcd("b")
        time.sleep(2 * fleet.lease_ttl)  # longer than a TTL: keep-alives must go elsewhere
        load.wait_more(20)
        fleet.start_etcd("b", state="existing")
        fleet.wait_etcd()
        load.wait_more(20)
        report.notes["discovery unchanged"] = fleet.registered() == before
    finally:
        load.finish(report)
    report.notes["processes alive"] = fleet.alive()
    return report


def nats_restart(fleet: Fleet) -> Report:
    report = Report("nats_restart")
    load = fleet.load()
    try:
        fleet.kill_nats()
        time.sleep(3)
        fleet.start_nats()
        load.wait_more(40)
    finally:
        if fleet.nats is None:
            fleet.start_nats()
        load.finish(report)
    report.notes["processes alive"] = fleet.alive()
    return report


def etcd_outage(fleet: Fleet) -> Report:
    report = Report("etcd_outage")
    load = fleet.load()
    try:
        before = fleet.registered()
        for host in HOSTS:
            fleet.kill_etcd(host)
        start = time.monotonic()
        load.wait_more(20)  # requests flow while etcd is gone
        time.sleep(max(0.0, 3 * fleet.lease_ttl - (time.monotonic() - start)))
        for host in HOSTS:
            fleet.start_etcd(host, state="existing")
        fleet.wait_etcd()
        report.notes["fleet whole after (s)"] = _until(lambda: fleet.registered() == before, 30, "the fleet back in discovery")
        load.wait_more(20)
    finally:
        for host in HOSTS:
            if host not in fleet.etcd:
                fleet.start_etcd(host, state="existing")
        load.finish(report)
    report.notes["processes alive"] = fleet.alive()
    return report


def two_frontends(fleet: Fleet) -> Report:
    report = Report("two_frontends")
    second = fleet.start_frontend()
    load = fleet.load([fleet.url(0), fleet.url(1)])
    try:
        first = fleet.frontends[0]
        first.send_signal(signal.SIGTERM)
        first.wait(30)
        report.notes["stopped frontend exit"] = first.returncode
        load.wait_more(40)
    finally:
        load.finish(report)
    report.notes["second frontend alive"] = second.poll() is None
    return report


SCENARIOS = {f.__name__: f for f in (cut_c, etcd_member, nats_restart, etcd_outage, two_frontends)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["load"]:
        return load_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all, in order")
    p.add_argument("--lease-ttl", type=float, default=3.0)
    p.add_argument("--request-plane", choices=("nats", "tcp"), default="nats", help="the JetStream prefill queue is used either way")
    p.add_argument("--keep-logs", action="store_true", help="keep the work directory (logs) and print its path")
    a = p.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"chaos.py: {reason}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    reports = []
    try:
        with Hosts(workdir) as hosts:
            fleet = Fleet(hosts, workdir, a.lease_ttl, a.request_plane)
            started = time.monotonic()
            fleet.start()
            print(f"fleet up in {time.monotonic() - started:.1f} s (lease TTL {a.lease_ttl:g} s, {a.request_plane} request plane)", flush=True)
            print(HEADER, flush=True)
            for name in a.scenario or list(SCENARIOS):
                report = SCENARIOS[name](fleet)
                reports.append(report)
                print(report.row(), flush=True)
                for error in report.errors[:3]:
                    print(f"    {error}", flush=True)
    finally:
        if a.keep_logs:
            print(f"logs in {workdir}")
        else:
            subprocess.run(["rm", "-rf", str(workdir)])
    print(json.dumps([asdict(r) for r in reports]))
    return 0 if all(r.failed == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
