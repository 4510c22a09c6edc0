"""etcd and nats-server outages on one host, as an operator would try them:

    python bench/outage.py                          # etcd down 30 s, then NATS down 5 s
    python bench/outage.py --etcd-down 30 --nats-down 5 --requests 2000 --lease-ttl 10

Starts etcd (one member) and nats-server on loopback, `kvmesh frontend` and two
`kvmesh worker --speedup 5` with the NATS request plane, and streams ``--requests``
requests at concurrency 8 (the load generator of ``bench/chaos.py``, the openai
client). While the load runs it SIGKILLs etcd for ``--etcd-down`` seconds and
restarts it on the same data directory, then SIGKILLs nats-server for
``--nats-down`` seconds and restarts it. Prints sent, completed, identical to the
undisturbed run, failed and the longest client stall, and whether both workers are
still the same processes, still in discovery and still taking traffic.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import KvmeshProcess, free_port, wait_healthy  # noqa: E402
from tests.services import Etcd, Nats  # noqa: E402


class LoadProcess:
    def __init__(self, url: str, requests: int, workdir: Path) -> None:
        self.stop_file = workdir / "stop"
        argv = [sys.executable, str(REPO / "bench" / "chaos.py"), "load", "--urls", url, "--count", str(requests),
                "--stop-file", str(self.stop_file)]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.completed = 0
        self.result: dict | None = None
        self.started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "started":
                self.started.set()
            elif line.startswith("progress "):
                self.completed = int(line.split()[1])
            elif line.startswith("RESULT "):
                self.result = json.loads(line[len("RESULT ") :])

    def wait_more(self, n: int, timeout: float = 120) -> None:
        target, deadline = self.completed + n, time.monotonic() + timeout
        while self.completed < target and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def finish(self) -> dict:
        self.proc.wait(600)
        time.sleep(0.2)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        if self.result is None:
            raise RuntimeError("the load generator printed no result")
        return self.result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--etcd-down", type=float, default=30.0)
    p.add_argument("--nats-down", type=float, default=5.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--lease-ttl", type=float, default=10.0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-outage-") as d:
        workdir = Path(d)
        etcd, nats = Etcd(workdir), Nats(workdir)
        procs: list[KvmeshProcess] = []
        try:
            etcd.start()
            nats.start()
            env = {
                "KVMESH_DISCOVERY": "etcd", "KVMESH_ETCD_ENDPOINTS": etcd.endpoint, "KVMESH_NATS_URL": nats.url,
                "KVMESH_REQUEST_PLANE": "nats", "KVMESH_EVENT_PLANE": "zmq", "KVMESH_NAMESPACE": "outage",
                "KVMESH_LEASE_TTL": str(a.lease_ttl), "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
            }  # fmt: skip
            port = free_port()
            procs.append(KvmeshProcess(workdir, "frontend", "--http-port", str(port), "--canary-interval", "0", env=env))
            workers = [KvmeshProcess(workdir, "worker", "--speedup", "5", env=env) for _ in range(2)]
            procs += workers
            ids = [w.wait_ready()["lease_id"] for w in workers]
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc=procs[0].proc)
            load = LoadProcess(url, a.requests, workdir)
            load.started.wait(120)
            load.wait_more(50)
            etcd.kill()
            time.sleep(a.etcd_down)
            during_etcd = load.completed
            etcd.start()
            load.wait_more(50)
            nats.kill()
            time.sleep(a.nats_down)
            nats.start()
            result = load.finish()
            alive = all(w.proc.poll() is None for w in workers)
            keys = etcd.etcdctl("get", "--prefix", "/services/outage/backend/generate-", "--keys-only").split()
            registered = sorted(int(k.rsplit("-", 1)[1], 16) for k in keys) == sorted(ids)
        finally:
            for proc in reversed(procs):
                proc.stop()
            etcd.stop()
            nats.stop()
    print(f"etcd down {a.etcd_down:g} s, nats-server down {a.nats_down:g} s, lease TTL {a.lease_ttl:g} s, concurrency 8")
    print(f"{'sent':>6} {'completed':>9} {'identical':>9} {'failed':>6} {'stall (s)':>9}")
    print(f"{result['sent']:>6} {result['completed']:>9} {result['identical']:>9} {result['failed']:>6} {result['stall_s']:>9.1f}")
    print(f"completed by the end of the etcd outage: {during_etcd}; workers alive (same processes): {alive}; "
          f"both still registered under their ids: {registered}")  # fmt: skip
    for error in result["errors"][:3]:
        print("   ", error)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
