"""LoopHistogram (issue 36): the frontend's lock-free latency histograms export exactly
what a ``prometheus_client.Histogram`` fed the same observations would, and the
per-token path (observe_many, the ITL) counts every token."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest

from kvmesh.observability.metrics import FrontendMetrics, LoopHistogram
from kvmesh.planner.signals import histogram_buckets

pytestmark = pytest.mark.timeout(30)

disable_created_metrics()  # type: ignore[no-untyped-call]  # kvmesh writes no *_created series; nor do these

_BOUNDS = (0.001, 0.5, 1, 2.5)
_VALUES = (0.0, 0.0001, 0.001, 0.3, 0.5, 0.5000001, 1, 2.5, 3, 100.0)


def _pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, LoopHistogram]:
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    return r1, Histogram("x_seconds", "doc", ["model"], buckets=_BOUNDS, registry=r1), r2, LoopHistogram(
        "x_seconds", "doc", ["model"], _BOUNDS, r2
    )


def test_same_exposition_as_prometheus_histogram() -> None:
    r1, prom, r2, loop = _pair()
    assert generate_latest(r1) == generate_latest(r2)  # no label set yet: HELP/TYPE only
    for v in _VALUES:  # on a bound, just past one, below the first, past the last
        prom.labels("m").observe(v)
        loop.labels("m").observe(v)
    prom.labels("idle")
    loop.labels("idle")
    assert generate_latest(r1) == generate_latest(r2)


def test_observe_many_counts_each_token() -> None:
    r1, prom, r2, loop = _pair()
    for v, n in ((0.0004, 3), (0.7, 1), (5.0, 4)):
        for _ in range(n):
            prom.labels("m").observe(v)
        loop.labels("m").observe_many(v, n)
    assert generate_latest(r1) == generate_latest(r2)
    bounds, counts = histogram_buckets(loop)
    assert bounds[-1] == float("inf") and counts[-1] == 8 and counts[0] == 3


def test_frontend_metrics_render_latencies() -> None:
    fm = FrontendMetrics()
    m = fm.model("tiny")
    m.ttft.observe(0.002)
    m.itl.observe_many(0.0007, 5)
    m.duration.observe(0.2)
    text = fm.render().decode()
    assert 'kvmesh_frontend_time_to_first_token_seconds_bucket{le="0.0025",model="tiny"} 1.0' in text
    assert 'kvmesh_frontend_inter_token_latency_seconds_count{model="tiny"} 5.0' in text
    assert 'kvmesh_frontend_inter_token_latency_seconds_bucket{le="0.0005",model="tiny"} 0.0' in text
    assert 'kvmesh_frontend_request_duration_seconds_sum{model="tiny"} 0.2' in text


def test_wrong_label_count_refused() -> None:
    with pytest.raises(ValueError):
        LoopHistogram("y_seconds", "doc", ["model"], _BOUNDS, CollectorRegistry()).labels("a", "b")


@pytest.mark.parametrize("gauge", [False, True])
def test_loop_counter_same_exposition_as_prometheus(gauge: bool) -> None:
    from prometheus_client import Counter, Gauge

    from kvmesh.observability.metrics import LoopCounter

    r1, r2 = CollectorRegistry(), CollectorRegistry()
    kind = Gauge if gauge else Counter
    prom = kind("kvmesh_x_requests", "doc", ["model", "status"], registry=r1)
    loop = LoopCounter("kvmesh_x_requests", "doc", ["model", "status"], r2, gauge=gauge)
    assert generate_latest(r1) == generate_latest(r2)
    for labels, n in ((("m", "200"), 3), (("m", "499"), 1), (("n", "200"), 2.5)):
        prom.labels(*labels).inc(n)
        loop.labels(*labels).inc(n)
    if gauge:
        prom.labels("m", "200").dec()
        loop.labels("m", "200").dec()
    prom.labels("idle", "200")
    loop.labels("idle", "200")
    assert generate_latest(r1) == generate_latest(r2)


def test_frontend_metrics_count_requests() -> None:
    fm = FrontendMetrics()
    m = fm.model("tiny")
    m.inflight.inc()
    m.finished("chat_completions", "200")
    m.finished("chat_completions", "200")
    m.routed(0xAB)
    m.input_tokens.inc(128)
    assert fm.registry.get_sample_value(
        "kvmesh_frontend_requests_total", {"model": "tiny", "endpoint": "chat_completions", "status": "200"}
    ) == 2
    assert fm.registry.get_sample_value("kvmesh_frontend_inflight_requests", {"model": "tiny"}) == 1
    assert fm.registry.get_sample_value("kvmesh_router_decisions_total", {"model": "tiny", "worker": "ab"}) == 1
    assert fm.registry.get_sample_value("kvmesh_frontend_input_tokens_total", {"model": "tiny"}) == 128
