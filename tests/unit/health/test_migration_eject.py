"""The health monitor's choice when it ejects a worker (kvmesh.health.monitor): hand the
streams off with their KV (the worker's ``handoff`` endpoint, targets booked from the
peers' load reports) or close the connection (re-prefill): corruption, no KV-transfer
server, a failed hand-off and streams left without KV all close it. Fakes only."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from kvmesh.errors import Disconnected
from kvmesh.health import monitor as monitor_module
from kvmesh.health.migration import HandedOff, HandOffReport
from kvmesh.health.monitor import HealthMonitor
from kvmesh.health.state import HealthConfig
from kvmesh.protocol import LoadReport
from kvmesh.runtime.names import HANDOFF, LOAD

pytestmark = pytest.mark.timeout(10)


class FakeClient:
    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.closed = False

    async def stream(self, endpoint, payload, ctx, decode=None):
        self.calls.append(endpoint)
        answer = self.answers[endpoint]
        if isinstance(answer, Exception):
            raise answer
        raw = msgspec.msgpack.encode(answer)
        yield decode(raw) if decode is not None else raw

    async def close(self) -> None:
        self.closed = True


def _instance(worker_id: int, client: FakeClient, kv: bool = True) -> SimpleNamespace:
    info = SimpleNamespace(worker_id=worker_id, kv=SimpleNamespace(layout=SimpleNamespace(block_size=16)) if kv else None)
    return SimpleNamespace(worker_id=worker_id, info=info, client=client)


def _monitor(victim: SimpleNamespace, peer: SimpleNamespace) -> HealthMonitor:
    monitor = HealthMonitor(SimpleNamespace(), HealthConfig(), timeout_s=2.0)
    monitor._instances = {victim.worker_id: victim, peer.worker_id: peer}
    return monitor


async def _evict(monitor: HealthMonitor, worker_id: int, reason: str) -> None:
    monitor._evict_streams(worker_id, reason)
    await asyncio.gather(*list(monitor._tasks))


PEER_LOAD = LoadReport(worker_id=2, active_blocks=10, total_blocks=100, num_waiting=0, num_running=1)


async def test_a_slow_worker_hands_off_and_its_requests_go_where_there_is_room() -> None:
    report = HandOffReport([HandedOff("p", "premium", 40), HandedOff("s", "standard", 40)])
    victim = _instance(1, FakeClient({HANDOFF: report}))
    peer = _instance(2, FakeClient({LOAD: PEER_LOAD}))
    monitor = _monitor(victim, peer)
    await _evict(monitor, 1, "check: timeout")
    assert victim.client.calls == [HANDOFF] and not victim.client.closed
    assert peer.client.calls == [LOAD]
    assert monitor.handoff_target(1, 40, exclude=[1]) == 2  # 90 free blocks: room for 3
    assert monitor.handoff_target(1, 16 * 200, exclude=[1]) is None  # no room: the router picks
    assert monitor.handoff_target(3, 40, exclude=[]) is None  # no hand-off from worker 3


@pytest.mark.parametrize("reason", ["check: wrong_tokens", "check: logit_out_of_range"])
async def test_a_corrupt_worker_is_cut_its_kv_never_offered(reason: str) -> None:
    victim = _instance(1, FakeClient({HANDOFF: HandOffReport()}))
    monitor = _monitor(victim, _instance(2, FakeClient({LOAD: PEER_LOAD})))
    await _evict(monitor, 1, reason)
    assert victim.client.calls == [] and victim.client.closed


async def test_a_worker_without_a_kv_transfer_server_is_cut() -> None:
    victim = _instance(1, FakeClient({HANDOFF: HandOffReport()}), kv=False)
    monitor = _monitor(victim, _instance(2, FakeClient({LOAD: PEER_LOAD})))
    await _evict(monitor, 1, "check: latency_spike")
    assert victim.client.calls == [] and victim.client.closed


async def test_a_failed_hand_off_or_streams_left_without_kv_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(monitor_module, "_CUT_GRACE_S", 0.0)
    failing = _instance(1, FakeClient({HANDOFF: Disconnected("gone")}))
    monitor = _monitor(failing, _instance(2, FakeClient({LOAD: PEER_LOAD})))
    await _evict(monitor, 1, "check: error")
    assert failing.client.calls == [HANDOFF] and failing.client.closed
    partial = _instance(1, FakeClient({HANDOFF: HandOffReport([HandedOff("a")], kept=1)}))
    monitor = _monitor(partial, _instance(2, FakeClient({LOAD: PEER_LOAD})))
    await _evict(monitor, 1, "check: error")
    assert partial.client.closed
