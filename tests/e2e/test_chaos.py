"""Three hosts on one machine (network namespaces, tests/netns.py) running a 3-member
etcd cluster, nats-server with JetStream, a frontend on host a and workers on b and c
(bench/chaos.py): each scenario streams requests while it breaks something, and no
request may fail or come back different from the undisturbed run.

Skipped (with the reason) where network namespaces cannot be made: not root, no
iproute2. The scenarios share one fleet and run in the order written."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.netns import Hosts, unavailable

REASON = unavailable()
pytestmark = [
    pytest.mark.processes,
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

LEASE_TTL = 3.0


def _chaos():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvmesh_bench_chaos", REPO / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


chaos = _chaos()


@pytest.fixture(scope="module")
def fleet():  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory(prefix="kvmesh-chaos-") as d, Hosts(Path(d)) as hosts:
        f = chaos.Fleet(hosts, Path(d), LEASE_TTL)
        f.start()
        yield f


def _clean(report) -> None:  # type: ignore[no-untyped-def]
    assert report.errors == [] and report.failed == 0, report.errors[:3]
    assert report.completed == report.sent > 0
    assert report.identical == report.completed, "a text differs from the undisturbed run's"
    assert report.notes.get("processes alive", True), "a worker process died"


def test_cut_host_c_streams_migrate_discovery_drops_it_and_it_rejoins(fleet) -> None:  # type: ignore[no-untyped-def]
    report = chaos.cut_c(fleet)
    print(report.row())
    _clean(report)
    # its lease ran out while cut off: one TTL, or two when c's member led (the new
    # leader extends every lease); + election, expiry checks and polling on a loaded box
    ttls = 2 if report.notes["etcd leader"] == "c" else 1
    assert report.notes["c dropped after (s)"] <= ttls * LEASE_TTL + 3
    assert report.workers_min == 1 and report.workers_max == 2
    assert report.notes["moved to b"] > 0, "nothing moved off c"
    # streams cut mid-way moved to b once their connections were found dead (TCP
    # keep-alive, ~5 s), not when c came back (TCP retransmits would resume them then):
    # c stays cut until every request under way at the cut, or sent before discovery
    # dropped c, has ended (or chaos.CUT_WAIT_S more): an order, not a stall length
    # (report.stall_s, printed in the row, is the bench's measure)
    assert report.notes["streams ended while c was cut"], "c's streams waited for it instead of moving to b"


def test_one_etcd_member_killed_and_restarted_no_failure_no_churn(fleet) -> None:  # type: ignore[no-untyped-def]
    report = chaos.etcd_member(fleet)
    print(report.row())
    _clean(report)
    assert report.notes["discovery unchanged"]
    assert report.workers_min == report.workers_max == 2, "the frontend's worker set churned"


def test_nats_restart_with_nats_request_plane_and_jetstream_loses_nothing(fleet) -> None:  # type: ignore[no-untyped-def]
    report = chaos.nats_restart(fleet)
    print(report.row())
    _clean(report)


def test_full_etcd_outage_for_3_ttls_fails_nothing_and_the_fleet_is_whole(fleet) -> None:  # type: ignore[no-untyped-def]
    report = chaos.etcd_outage(fleet)
    print(report.row())
    _clean(report)
    assert report.workers_min == report.workers_max == 2


def test_two_frontends_one_sigtermed_mid_load(fleet) -> None:  # type: ignore[no-untyped-def]
    report = chaos.two_frontends(fleet)
    print(report.row())
    _clean(report)
    assert report.notes["stopped frontend exit"] == 0
    assert report.notes["second frontend alive"]
