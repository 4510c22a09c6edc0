"""The frontend's /metrics text without prometheus_client (issue 36): kvmesh's own
metric types and exposition (``observability/metrics_core.py``) write byte for byte
what ``prometheus_client`` writes for the same samples, and the frontend's start and
request path do not import ``prometheus_client`` at all."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge as PGauge
from prometheus_client import Histogram as PHistogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from kvmesh.observability.metrics import FrontendMetrics, PlannerMetrics, count_discovery_refusals, export_tenant_usage
from kvmesh.observability.metrics_core import (
    CONTENT_TYPE,
    Counter,
    Gauge,
    Histogram,
    MetricsRegistry,
    go_float,
    render,
)

pytestmark = pytest.mark.timeout(60)

disable_created_metrics()  # type: ignore[no-untyped-call]  # kvmesh writes no *_created series

_ODD = ("plain", 'quo"te', "back\\slash", "new\nline", "ünïcode", "")


def test_content_type_is_prometheus_clients() -> None:
    assert CONTENT_TYPE == CONTENT_TYPE_LATEST


def test_go_float_matches_prometheus_client() -> None:
    rng = random.Random(36)
    values = [0.0, -0.0, 1.0, -1.0, 0.1, 1e-9, 123456.0, 1234567.0, 1e6, 1e7, 12345678.9, 1e16, 1.5e300, -1e7,
              math.inf, -math.inf, math.nan, 2**53, 0.00025, 999999.99]  # fmt: skip
    values += [rng.uniform(-1e9, 1e9) for _ in range(500)] + [10 ** rng.uniform(-12, 30) for _ in range(500)]
    for v in values:
        assert go_float(v) == floatToGoString(v), v


def _exercise(counter: object, gauge: object, hist: object, plain_c: object, plain_g: object, plain_h: object) -> None:
    for i, value in enumerate(_ODD):
        counter.labels(value, str(i)).inc(i + 0.5)  # type: ignore[attr-defined]
        gauge.labels(value, "x").set(-i * 1234567.25)  # type: ignore[attr-defined]
        hist.labels(value, "y").observe(i * 0.3)  # type: ignore[attr-defined]
    counter.labels("plain", "0").inc()  # type: ignore[attr-defined]
    gauge.labels("plain", "x").inc(2)  # type: ignore[attr-defined]
    gauge.labels("plain", "x").dec(0.5)  # type: ignore[attr-defined]
    gauge.labels("fn", "x").set_function(lambda: 7)  # type: ignore[attr-defined]
    for v in (0.0, 0.001, 0.0025, 1e9, 0.7):  # below, on a bound, past the last
        hist.labels("plain", "y").observe(v)  # type: ignore[attr-defined]
    hist.labels("empty", "y")  # type: ignore[attr-defined]
    plain_c.inc(3)  # type: ignore[attr-defined]
    plain_g.set(math.inf)  # type: ignore[attr-defined]
    plain_h.observe(2.0)  # type: ignore[attr-defined]


def test_same_text_as_prometheus_client_for_the_same_operations() -> None:
    ours, theirs = MetricsRegistry(), CollectorRegistry()
    buckets = (0.001, 0.0025, 0.5, 1, 2.5, 30)
    doc = 'a "doc" with \\ and\nnewline'
    _exercise(
        Counter("c_events_total", doc, ["a", "b"], registry=ours), Gauge("g_level", doc, ["a", "b"], registry=ours),
        Histogram("h_seconds", doc, ["a", "b"], buckets=buckets, registry=ours),
        Counter("c_plain", "p", registry=ours), Gauge("g_plain", "p", registry=ours),
        Histogram("h_plain", "p", buckets=buckets, registry=ours),
    )  # fmt: skip
    _exercise(
        PCounter("c_events_total", doc, ["a", "b"], registry=theirs), PGauge("g_level", doc, ["a", "b"], registry=theirs),
        PHistogram("h_seconds", doc, ["a", "b"], buckets=buckets, registry=theirs),
        PCounter("c_plain", "p", registry=theirs), PGauge("g_plain", "p", registry=theirs),
        PHistogram("h_plain", "p", buckets=buckets, registry=theirs),
    )  # fmt: skip
    text = render(ours)
    assert text == generate_latest(theirs)  # type: ignore[arg-type]
    assert b'a="new\\nline"' in text and b"h_seconds_count" in text  # the cases are in it
    assert ours.get_sample_value("c_events_total", {"a": "plain", "b": "0"}) == theirs.get_sample_value(
        "c_events_total", {"a": "plain", "b": "0"}
    )


def _full_frontend() -> FrontendMetrics:
    fm = FrontendMetrics()
    m = fm.model("tiny")
    m.ttft.observe(0.002)
    m.itl.observe_many(0.0007, 5)
    m.duration.observe(0.2)
    m.inflight.inc()
    m.input_tokens.inc(128)
    m.routed(0xAB)
    m.finished("chat", "200")
    m.migrated("replay", "a", "b")
    m.migration_took("replay", 0.03)
    m.router.event_rejected("bad")
    m.router.repairs["dump"].inc()
    m.router.event_backlog.set_function(lambda: 4)
    fm.disconnects.inc()
    fm.check_duration.labels("1f", "canary", "ok").observe(0.01)
    fm.worker_status.labels("1f").set(2)
    fm.health_transitions.labels("1f", "unhealthy", 'a "cause"').inc()
    fm.shed.labels("standard").inc()
    fm.degradation_level.set(3)
    fm.workers.labels("tiny").set(1)
    count_discovery_refusals(fm.registry, {"too_large": 2})
    count_discovery_refusals(fm.registry, {"too_large": 2})  # once only
    export_tenant_usage(fm.registry, lambda: {"t\\1": {"requests": 1, "prompt_tokens": 2, "completion_tokens": 3,
                        "limited_requests": 0, "limited_tokens": 1, "limited_concurrent": 0, "in_flight": 1}})  # fmt: skip
    PlannerMetrics(fm.registry).decisions.labels("add", "decode").inc()  # kvmesh run --planner: same registry
    return fm


def test_frontend_metrics_text_is_what_prometheus_client_writes() -> None:
    fm = _full_frontend()
    text = fm.render()
    assert text == generate_latest(fm.registry)  # type: ignore[arg-type]  # prometheus_client renders our families
    for line in (b"# TYPE kvmesh_frontend_requests_total counter", b'kvmesh_router_decisions_total{model="tiny",worker="ab"} 1.0',
                 b"kvmesh_degradation_level 3.0", b'kvmesh_router_kv_event_backlog{model="tiny"} 4.0',
                 b'kvmesh_tenant_requests_total{tenant="t\\\\1"} 1.0', b"kvmesh_discovery_records_refused_total"):  # fmt: skip
        assert line in text


def test_the_same_families_as_prometheus_client_metrics() -> None:
    # the frontend's non-loop metrics, rebuilt with prometheus_client's types: same text
    fm, theirs = FrontendMetrics(), CollectorRegistry()
    pc = PCounter("kvmesh_frontend_client_disconnects", "Streams the client left early", registry=theirs)
    pg = PGauge("kvmesh_worker_status", "Health: 0 healthy, 1 suspicious, 2 unhealthy, 3 draining, 4 dead", ["worker_id"],
                registry=theirs)  # fmt: skip
    for ours, prom in ((fm.disconnects, pc), (fm.worker_status.labels("a"), pg.labels("a"))):
        ours.inc(2)
        prom.inc(2)
    wanted = generate_latest(theirs)
    got = b"".join(line + b"\n" for line in fm.render().splitlines() if b"disconnects" in line or b"worker_status" in line)
    assert got == wanted


def test_registry_refuses_a_name_twice_and_counters_go_up_only() -> None:
    r = MetricsRegistry()
    c = Counter("x", "d", ["l"], registry=r)
    with pytest.raises(ValueError):
        Gauge("x_total", "d", registry=r)
    with pytest.raises(ValueError):
        c.labels("a").inc(-1)
    with pytest.raises(ValueError):
        c.labels("a", "b")
    assert r.get_sample_value("x_total", {"l": "a"}) == 0.0  # the refused change not made
    c.labels("a").inc()
    assert r.get_sample_value("x_total", {"l": "a"}) == 1.0


_FRONTEND_PATH = """
import sys
import kvmesh.cli.main, kvmesh.cli.run
import kvmesh.assembly.frontend
from kvmesh.frontend.app import Frontend
from kvmesh.config import FrontendConfig
from kvmesh.preprocess.model import bundled_model_path
fe = Frontend(FrontendConfig(), None)
fe.registry.add_model(str(bundled_model_path()), None, True)
m = fe.metrics.model("kvmesh-tiny")
m.ttft.observe(0.01); m.finished("chat", "200"); fe.metrics.disconnects.inc()
assert b"kvmesh_frontend_requests_total" in fe.metrics.render()
from kvmesh.observability import worker_metrics  # /metrics with workers: their series too
from kvmesh.protocol import WorkerMetrics
assert b"kvmesh_worker_" in worker_metrics.render([("1", WorkerMetrics(worker_id=1))], {"1": "kvmesh-tiny"})
print(" ".join(n for n in ("prometheus_client", "http.server", "urllib.request", "wsgiref") if n in sys.modules))
"""


@pytest.mark.timeout(150)
def test_frontend_start_and_metrics_import_no_prometheus_client() -> None:
    out = subprocess.run([sys.executable, "-c", _FRONTEND_PATH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []


def test_worker_series_text_is_what_prometheus_client_families_write() -> None:
    # the frontend's /metrics worker series (and a worker's own endpoint) from kvmesh's
    # families: the same text as prometheus_client's CounterMetricFamily/GaugeMetricFamily
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from kvmesh.observability import worker_metrics
    from kvmesh.protocol import DisaggStats, WorkerMetrics

    samples = [("1f", WorkerMetrics(worker_id=0x1F, running=2, kv_blocks_total=10, requests=7, output_tokens=99)),
               ("2a", WorkerMetrics(worker_id=0x2A, mode="prefill", disagg=DisaggStats(mode="prefill", remote_prefills=3)))]  # fmt: skip
    models = {"1f": "tiny", "2a": 'odd "model"'}
    ours = worker_metrics.render(samples, models)

    class Theirs:
        def collect(self) -> object:
            for family in worker_metrics.families(samples, models=models):
                cls = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
                twin = cls(family.name, family.documentation, labels=list(family.labelnames))
                for s in family.samples:
                    twin.add_metric([s.labels[k] for k in family.labelnames], s.value)
                yield twin

    theirs = CollectorRegistry(auto_describe=False)
    theirs.register(Theirs())  # type: ignore[arg-type]  # a duck-typed collector
    assert ours == generate_latest(theirs) and b'model="odd \\"model\\""' in ours and b"kvmesh_disagg_" in ours
    assert worker_metrics.render([], models) == b""
