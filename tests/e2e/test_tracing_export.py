"""Real ``kvmesh run`` processes export their spans over OTLP/HTTP (protobuf) to a
receiver this test runs: one trace id spans the frontend's and the worker's spans."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import kvmesh_run
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]


def test_kvmesh_run_exports_one_trace_across_frontend_and_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORT_ENABLED", "1")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
        with kvmesh_run(tmp_path, workers=1) as server:
            body = {"model": "kvmesh-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            trace_id = r.headers["traceparent"][3:35]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
                if {"engine.generate", "POST /v1/chat/completions"} <= {s.name for s in spans}:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"spans of trace {trace_id} not received: {receiver.snapshot()}\n{server.log()}")
            # a refused request gets a trace of its own
            miss = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "nope"}, timeout=30)
            assert miss.status_code == 404 and miss.headers["traceparent"][3:35] != trace_id
    by_name = {s.name: s for s in spans}
    root, hop, gen = by_name["POST /v1/chat/completions"], by_name["request_plane.generate"], by_name["engine.generate"]
    assert root.service == "kvmesh-frontend" and hop.service == "kvmesh-frontend" and gen.service == "kvmesh-worker"
    assert hop.parent_span_id == root.span_id and gen.parent_span_id == hop.span_id
    assert gen.attributes["output_tokens"] == 5 and gen.attributes["model"] == "kvmesh-tiny"
    assert gen.attributes["disagg_role"] == "aggregated" and "ttft_ms" in gen.attributes
