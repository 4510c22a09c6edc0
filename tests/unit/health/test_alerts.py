"""deploy/prometheus/kvmesh-alerts.yml: valid YAML (when PyYAML is installed) with the
design's three alerts on kvmesh_-prefixed metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

ALERTS = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "kvmesh-alerts.yml"
NAMES = {"KvmeshHighWorkerFailureRate", "KvmeshCapacityDegraded", "KvmeshSilentCorruption"}


def test_alert_file_names_three_alerts_on_kvmesh_metrics() -> None:
    text = ALERTS.read_text()
    assert "\t" not in text
    names = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("- alert:")}
    assert NAMES <= names  # the design's three (seed 003), and the fleet alerts of issue 14
    for metric in ("kvmesh_worker_status", "kvmesh_degradation_level", "kvmesh_health_check_duration_seconds_count"):
        assert metric in text
    assert "dynamo_" not in text


def test_alert_file_parses_as_yaml() -> None:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(ALERTS.read_text())
    rules = {r["alert"]: r for group in doc["groups"] for r in group["rules"]}
    assert NAMES <= set(rules)
    assert rules["KvmeshHighWorkerFailureRate"]["for"] == "2m"
    assert rules["KvmeshCapacityDegraded"]["for"] == "5m"
    assert rules["KvmeshCapacityDegraded"]["labels"]["severity"] == "critical"
    assert 'result=~"wrong_tokens|logit_out_of_range"' in rules["KvmeshSilentCorruption"]["expr"]
    for rule in rules.values():
        assert rule["expr"] and rule["annotations"]["summary"]
