"""One metrics view of the fleet: a real ``kvmesh run`` with prefill and decode
workers shows every worker's metrics on its one ``/metrics``; the real Prometheus
server (Debian's ``prometheus``) scrapes it and answers queries over its HTTP API;
``promtool`` validates the alert rules."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import REPO, free_port, kvmesh_run

pytestmark = [pytest.mark.processes, pytest.mark.timeout(150)]

DISAGG = ("--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill-length", "30", "--canary-interval", "0")


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed (.ci/run installs the Debian package prometheus)"
    return path


def _series(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in Prometheus text."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def _wait(cond, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_alert_rules_pass_promtool() -> None:
    out = subprocess.run(
        [_tool("promtool"), "check", "rules", str(REPO / "deploy/prometheus/kvmesh-alerts.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_embedded_metrics_show_every_worker_and_prometheus_scrapes_them(tmp_path: Path) -> None:
    with kvmesh_run(tmp_path, *DISAGG, workers=1) as server:
        _wait(lambda: "1 decode + 1 prefill" in server.log(), 30, "the fleet")
        prompt = [(i * 13) % 1800 + 20 for i in range(200)]  # longer than 30 tokens: prefilled remotely
        body = {"model": "kvmesh-tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert "_created" not in text
        roles = {dict(re.findall(r'(\w+)="([^"]*)"', k))["role"] for k in _series(text, "kvmesh_worker_kv_blocks_total")}
        assert roles == {"decode", "prefill"}, text
        remote = _series(text, "kvmesh_disagg_remote_prefills_total")
        assert sum(v for k, v in remote.items() if 'role="decode"' in k) == 1, remote
        done = _series(text, "kvmesh_disagg_prefill_jobs_done_total")
        assert sum(v for k, v in done.items() if 'role="prefill"' in k) == 1, done
        received = _series(text, "kvmesh_disagg_kv_bytes_received_total")
        assert sum(received.values()) > 0
        assert sum(_series(text, "kvmesh_worker_output_tokens_total").values()) >= 4

        # the real Prometheus scrapes it
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{REPO / 'deploy/prometheus/kvmesh-alerts.yml'}']\n"
            "scrape_configs:\n"
            f"  - job_name: kvmesh\n    static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]\n"
        )
        log = open(tmp_path / "prometheus.log", "wb")
        prom = subprocess.Popen(
            [_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        api = f"http://127.0.0.1:{port}/api/v1"
        try:

            def up() -> bool:
                try:
                    targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
                except (httpx.HTTPError, ValueError, KeyError):
                    return False
                return bool(targets) and all(t["health"] == "up" for t in targets)

            _wait(up, 60, "Prometheus' target to be up")

            def query(q: str) -> list[dict]:  # type: ignore[type-arg]
                r = httpx.get(f"{api}/query", params={"query": q}, timeout=5).json()
                assert r["status"] == "success", r
                return r["data"]["result"]  # type: ignore[no-any-return]

            blocks = _wait(lambda: query("kvmesh_worker_kv_blocks_total"), 30, "worker series")
            assert {s["metric"]["role"] for s in blocks} == {"decode", "prefill"}
            assert all(s["metric"]["job"] == "kvmesh" and float(s["value"][1]) > 0 for s in blocks)
            remote = query('sum(kvmesh_disagg_remote_prefills_total{role="decode"})')
            assert float(remote[0]["value"][1]) == 1
            assert float(query("sum(kvmesh_frontend_requests_total)")[0]["value"][1]) >= 1
            rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
            assert any(r["name"] == "KvmeshCapacityDegraded" for g in rules for r in g["rules"])
        finally:
            prom.terminate()
            prom.wait(15)
            log.close()


def test_distributed_workers_serve_their_own_metrics_and_the_frontend_gathers_them(tmp_path: Path) -> None:
    from tests.helpers import KvmeshProcess, wait_healthy

    env = {"KVMESH_DISCOVERY": "file", "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "disc"), "KVMESH_NAMESPACE": "metricsview"}
    port = free_port()
    procs = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(port), "--canary-interval", "0", env=env)]
    try:
        cards = []
        for _ in range(2):
            procs.append(KvmeshProcess(tmp_path, "worker", "--speedup", "1e9", env=env))
            cards.append(procs[-1].wait_ready())
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc=procs[0].proc)
        ids = {f"{c['lease_id']:x}" for c in cards}
        for card in cards:  # each worker's own /metrics, at the address in its discovery record
            own = httpx.get(f"http://{card['metrics_address']}/metrics", timeout=10).text
            assert set(re.findall(r'kvmesh_worker_kv_blocks_total\{[^}]*worker_id="(\w+)"', own)) == {f"{card['lease_id']:x}"}

        def gathered() -> bool:
            text = httpx.get(url + "/metrics", timeout=10).text
            return set(re.findall(r'kvmesh_worker_kv_blocks_total\{[^}]*worker_id="(\w+)"', text)) == ids

        _wait(gathered, 30, "the frontend's /metrics to carry both workers")
    finally:
        for p in reversed(procs):
            p.stop()
