"""deploy/grafana/kvmesh.json (and the alert rules): every query names metrics a live
frontend (with a worker) really exports on its /metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.helpers import REPO, InProcessStack

pytestmark = pytest.mark.timeout(60)

DASHBOARD = REPO / "deploy/grafana/kvmesh.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "summary": ("_sum", "_count", "")}


def exported_series(text: str) -> set[str]:
    """Series names a Prometheus text exposition declares (from its TYPE lines)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":  # newer prometheus_client writes the _total on the TYPE line
            name = name.removesuffix("_total")
        names.update(name + s for s in _SUFFIXES.get(kind, ("",)))
    return names


async def test_every_panel_queries_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    async with InProcessStack().running() as stack:
        async with httpx.AsyncClient(timeout=30) as client:
            text = (await client.get(stack.url + "/metrics")).text
    exported = exported_series(text)
    assert "kvmesh_worker_kv_blocks_used" in exported and "kvmesh_frontend_requests_total" in exported
    titles = set()
    for panel in dashboard["panels"]:
        titles.add(panel["title"])
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            names = set(re.findall(r"\bkvmesh_[a-z0-9_]+", expr))
            assert names, f"panel {panel['title']!r}: {expr!r} names no kvmesh metric"
            missing = names - exported
            assert not missing, f"panel {panel['title']!r} queries {sorted(missing)}, which kvmesh does not export"
    # the alert rules read exported metrics too
    rules = (REPO / "deploy/prometheus/kvmesh-alerts.yml").read_text()
    exprs_text = "\n".join(line for line in rules.splitlines() if not line.lstrip().startswith("#"))
    missing = set(re.findall(r"\bkvmesh_[a-z0-9_]+", exprs_text)) - exported
    assert not missing, f"kvmesh-alerts.yml reads {sorted(missing)}, which kvmesh does not export"
    # what the issue asks the dashboard to show
    for want in ("Request rate", "TTFT", "ITL", "503", "health", "breaker", "KV usage", "Prefix-cache", "Router decision",
                 "Prefill queue", "Migrations", "Degradation"):  # fmt: skip
        assert any(want.lower() in t.lower() for t in titles), want


def test_a_renamed_metric_would_be_caught() -> None:
    exported = exported_series("# TYPE kvmesh_a counter\n# TYPE kvmesh_b_total counter\n# TYPE kvmesh_h histogram\n")
    assert exported == {"kvmesh_a_total", "kvmesh_b_total", "kvmesh_h_bucket", "kvmesh_h_sum", "kvmesh_h_count"}
