"""`kvmesh simulate` (issue 34): a short day on the virtual clock, decided by the live
policy objects. A broken policy must change the simulated outcome."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.health.migration import next_step
from kvmesh.health.state import HealthConfig
from kvmesh.simulate.faults import FaultKind, FaultRates, draw_schedule
from kvmesh.simulate.fleet import FleetSim, Policies, SimConfig
from kvmesh.simulate.report import render, summary

pytestmark = pytest.mark.timeout(120)

# a small, busy day: 400 groups for 2 hours at 50x the seed's rates
SMALL = SimConfig(workers=400, hours=2.0, failure_scale=50.0, seed=3)


def _day(config: SimConfig = SMALL, policies: Policies | None = None) -> dict:
    if config is SMALL and policies is None and _LIVE:
        return json.loads(_LIVE[0])  # the live day, simulated once per run (a fresh copy)
    out = FleetSim(config, policies).run()
    report = summary(config, out, 1.0)
    if config is SMALL and policies is None:
        _LIVE.append(json.dumps(report))
    return report


_LIVE: list[str] = []


def test_same_seed_same_report_and_nothing_lost() -> None:
    a, b = _day(), summary(SMALL, FleetSim(SMALL).run(), 1.0)
    a.pop("wall_s"), b.pop("wall_s"), a.pop("events_per_s"), b.pop("events_per_s")
    assert a == b
    assert a["lost"] == 0
    assert a["faults"].get("crash", 0) > 0 and a["faults"].get("sdc_tokens", 0) > 0
    assert a["requests"]["served"] == a["requests"]["arrived"] - sum(a["requests"]["shed"].values())
    assert a["migrations"].get("re_prefill", 0) > 0  # the crashed groups' streams moved
    assert a["planner_actions"].get("promote", 0) > 0  # hot spares took the lost groups' place


def test_a_broken_migration_policy_loses_requests() -> None:
    """The simulation decides with the live next_step: one that never moves a request
    loses every stream a fault touches."""

    def never_move(failure: BaseException, **kw: object) -> str:
        return "fail"

    live = _day()
    broken = _day(policies=Policies(HealthConfig(check_interval_s=SMALL.canary_interval_s), next_step=never_move))
    assert live["lost"] == 0 and broken["lost"] > 0
    assert set(broken["lost_by_cause"]) >= {"crash"}


def test_a_laxer_health_policy_lets_more_corruption_through() -> None:
    """The live HealthConfig decides how fast a corrupt group leaves: checks three times
    as far apart let about three times the corrupted tokens through."""
    live = _day()
    lax_config = SimConfig(**{**{f: getattr(SMALL, f) for f in SMALL.__dataclass_fields__}, "canary_interval_s": 90.0})
    lax = _day(lax_config)
    assert lax["corrupted_tokens"]["sdc_tokens"] > 2 * live["corrupted_tokens"]["sdc_tokens"]
    assert lax["time_to_detect"]["sdc_tokens"]["p50_s"] > live["time_to_detect"]["sdc_tokens"]["p50_s"]


def test_corrupt_groups_are_found_within_the_canary_budget() -> None:
    day = _day()
    detect = day["time_to_detect"]["sdc_tokens"]
    # the next round finds it (every check of it fails): at most one interval and one check
    assert detect["p99_s"] <= SMALL.canary_interval_s + SMALL.canary_s + 1e-6
    for kind, tokens in day["corrupted_tokens"].items():
        assert tokens <= day["corruption_bound_tokens"][kind]


def test_subtle_corruption_leaves_at_its_first_failed_check() -> None:
    """Issue 34's finding, through the simulation: with a corruption verdict ejecting at
    once, a subtle fault seen by half the checks is out within ten rounds at p99 (with
    three failed checks in a row needed, one round in eight: ~36 rounds)."""
    day = _day()
    detect = day["time_to_detect"]["sdc_logits"]
    assert detect["n"] > 5
    assert detect["p99_s"] <= 10 * SMALL.canary_interval_s  # one check in two: 0.5^10 < 0.1 %


def test_schedule_follows_the_rates() -> None:
    rng = random.Random(1)
    faults = draw_schedule(rng, FaultRates(), workers=10_000, tp=8, hours=24 * 30, scale=1.0)
    crashes = sum(1 for f in faults if f.kind is FaultKind.CRASH)
    # the seed: 80,000 GPUs x 3 %/year = 6.6 group failures a day
    assert 5.5 * 30 < crashes < 7.7 * 30
    assert all(a.at_s <= b.at_s for a, b in zip(faults, faults[1:]))


def test_render_lists_every_section() -> None:
    text = render(_day())
    for row in ("lost", "corrupted tokens", "time to detect", "migrations", "SLO attainment", "planner", "degradation"):
        assert row in text


def test_cli_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "day.json"
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli.main", "simulate", "--workers", "200", "--hours", "0.5",
         "--failure-scale", "20", "--json", str(out)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["config"]["workers"] == 200
    assert "SLO attainment" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvmesh.cli.main", "simulate", "--workers", "0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "workers" in bad.stderr
