"""Tenants' limits across several frontends (issue 30, item 3): two real ``kvmesh
frontend`` processes with the same keys file, one worker, file discovery and the NATS
request and event planes; a tenant's rpm=10 holds across both frontends: of 20 requests
split over them, 10 are answered and 10 get a 429 with Retry-After and x-ratelimit-*."""

from __future__ import annotations

import time

import openai
import pytest

from tests.helpers import KvmeshProcess, free_port, wait_healthy

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

KEYS = "sk-acme-1 tenant=acme rpm=10\nsk-acme-2 tenant=acme\n"


def _until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_tenants_rpm_holds_across_two_frontends(tmp_path, nats):  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    env = {
        "KVMESH_DISCOVERY": "file",
        "KVMESH_FILE_DISCOVERY_DIR": str(tmp_path / "discovery"),
        "KVMESH_NATS_URL": nats.url,
        "KVMESH_REQUEST_PLANE": "nats",
        "KVMESH_EVENT_PLANE": "nats",
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_NAMESPACE": "tenantbudget",
    }
    ports = [free_port(), free_port()]
    worker = KvmeshProcess(tmp_path, "worker", "--speedup", "100", env=env)
    frontends = [KvmeshProcess(tmp_path, "frontend", "--http-port", str(p), "--api-keys-file", str(keys), env=env) for p in ports]
    try:
        worker.wait_ready(60)
        clients = []
        for port, key, proc in zip(ports, ("sk-acme-1", "sk-acme-2"), frontends):
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc=proc.proc)
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            _until(lambda c=client: bool(c.models.list().data), 30, "the worker in the frontend's models")
            clients.append(client)
        minute = int(time.time() // 60)
        ok, refused, remaining = 0, [], []
        for i in range(20):  # split across both frontends (and both keys of the tenant)
            try:
                raw = clients[i % 2].completions.with_raw_response.create(model="kvmesh-tiny", prompt="hi", max_tokens=2)
                remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
                ok += 1
            except openai.RateLimitError as exc:
                refused.append(exc.response)
        if int(time.time() // 60) != minute:  # the minute turned meanwhile: a new window's budget
            assert 10 <= ok <= 20
            return
        assert ok == 10, (ok, [r.text for r in refused])
        assert len(refused) == 10
        assert remaining == list(range(9, -1, -1))  # what is left in the fleet, not in one frontend
        for response in refused:
            assert response.status_code == 429 and "acme" in response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["x-ratelimit-limit-requests"] == "10"
            assert response.headers["x-ratelimit-remaining-requests"] == "0"
            assert response.headers["x-ratelimit-reset-requests"]
    finally:
        for proc in (*frontends, worker):
            proc.stop()
