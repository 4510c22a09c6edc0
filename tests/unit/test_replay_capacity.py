"""``kvmesh replay --profile-capacity``: the rate search's bounds (a capacity known by
construction is found within the tolerance), a mix no rate serves recorded rather than
ending the measurement, the profile's JSON (bounds, version; old files still load), the
planner's sizing at an infeasible mix, and the trace's prefix sharing carried by the
probes (measured from the hash ids, reproduced by the steady loads, and a prefill
capacity that rises with it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvmesh.cli.replay import main as replay_main
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.planner.forecast import LoadForecast
from kvmesh.planner.profile import CapacityPoint, CapacityProfile, dump_profile, load_profile, size_fleet
from kvmesh.protocol import DisaggThresholds
from kvmesh.replay.arms import DisaggModel
from kvmesh.replay.capacity import _ROLES, PrefixReuse, _Context, _Probe, max_rate, measure_profile, steady_load, trace_mixes, trace_reuse
from kvmesh.replay.goodput import Slo
from kvmesh.replay.trace import TraceRequest

OPTIONS = MockerOptions(block_size=64, num_blocks=4096, context_length=40_000, kv_bytes_per_token=65536, kv_bandwidth=25e9)


class _Known:
    """A capacity known by construction: every rate up to ``true`` passes."""

    def __init__(self, true: float) -> None:
        self.true = true
        self.calls = 0

    def __call__(self, rate: float) -> bool:
        self.calls += 1
        return rate <= self.true


@pytest.mark.parametrize("guess_ratio", [0.01, 0.3, 1.0, 1.7, 40.0])
def test_the_search_brackets_a_known_capacity_within_the_tolerance(guess_ratio: float) -> None:
    ok = _Known(7.3)
    b = max_rate(ok, 7.3 * guess_ratio, tolerance=1.05, floor=1e-4, limit=16)
    assert b.high is not None and b.low <= ok.true < b.high
    assert b.high / b.low <= 1.05  # the reported capacity (low) is at most 5 % under the truth
    assert ok.true / b.low <= 1.05
    assert ok.calls <= 16


def test_a_tighter_tolerance_costs_more_calls_and_is_tighter() -> None:
    loose, tight = _Known(3.0), _Known(3.0)
    a, b = max_rate(loose, 1.0, tolerance=1.19), max_rate(tight, 1.0, tolerance=1.01, limit=20)
    assert a.high is not None and b.high is not None
    assert b.high / b.low <= 1.01 < a.high / a.low <= 1.19
    assert tight.calls > loose.calls


def test_no_rate_passes_is_a_bound_not_an_error() -> None:
    ok = _Known(0.0)
    b = max_rate(ok, 5.0, floor=0.01)
    assert b.low == 0.0 and b.high == pytest.approx(0.01)  # failed even at the floor: infeasible
    assert ok.calls == 2  # the guess, then the floor


def test_the_grid_has_the_median_between_the_ends() -> None:
    rows = [TraceRequest(i, 0.0, 100 * (i + 1), 10 + i % 3, (0,)) for i in range(100)]
    inputs, outputs = trace_mixes(rows)
    assert len(inputs) == 3 and inputs[0] < inputs[1] < inputs[2]  # p10, p50, p90
    assert outputs == (11,)  # narrow: one point


# ---------------------------------------------------------------------------- prefix sharing


def _row(i: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(i, float(i), 512 * len(ids), 8, ids)


def test_the_traces_reuse_is_the_leading_run_already_seen() -> None:
    rows = [
        _row(1, (0, 1, 2)),
        _row(2, (0, 1, 2, 3)),  # continues row 1: 3 of its 4 blocks
        _row(3, (0, 5)),  # only the shared first block: not a continuation
        _row(4, (0, 1, 6, 7)),  # continues over 2 of 4
        _row(5, (9, 1, 2)),  # a seen id after an unseen one is no prefix
    ]
    reuse = trace_reuse(rows)
    assert reuse.share == pytest.approx(2 / 5)
    assert reuse.depth == pytest.approx((3 + 2) / (4 + 4))
    assert trace_reuse(rows[:1]) == PrefixReuse(0.0, 0.0)
    assert "40.0% of requests" in reuse.describe() and "62.5% of their blocks" in reuse.describe()


def test_the_steady_load_carries_the_reuse_it_is_given() -> None:
    plain = steady_load(4.0, 6000, 50, 600, seed=3)
    assert plain == steady_load(4.0, 6000, 50, 600, seed=3, reuse=PrefixReuse())  # no sharing: the loads as before
    assert trace_reuse(plain) == PrefixReuse(0.0, 0.0)
    assert all(r.hash_ids[0] == 0 for r in plain)
    shared = steady_load(4.0, 6000, 50, 600, seed=3, reuse=PrefixReuse(0.4, 0.75))
    got = trace_reuse(shared)
    assert 0.34 < got.share < 0.46 and 0.68 < got.depth < 0.8
    # the same lengths and arrivals: only the prompts' blocks differ
    assert [(r.timestamp_ms, r.input_length, r.output_length) for r in plain[:1]] == [
        (r.timestamp_ms, r.input_length, r.output_length) for r in shared[:1]
    ]
    for r in shared:  # every prompt has its length's blocks, chained ids (one position each)
        assert len(r.hash_ids) == -(-r.input_length // 512)
    positions: dict[int, int] = {}
    for r in shared:
        for k, h in enumerate(r.hash_ids):
            assert positions.setdefault(h, k) == k
    with pytest.raises(ValueError, match="within"):
        PrefixReuse(1.2, 0.5)


@pytest.mark.timeout(60)
def test_a_probe_with_shared_prefixes_carries_a_rate_the_plain_one_does_not() -> None:
    # one prefill worker (decode ample), every prompt remote, 4000-token prompts (~80 ms
    # each): at 13 req/s the plain load outruns it (TTFT p90 ~1.2 s), while half the
    # requests continuing an earlier prompt over 90 % of it leave it ~half the work
    slo = Slo(ttft_ms=400.0, itl_ms=200.0)
    _, arm, workers = _ROLES[0]

    def probe(reuse: PrefixReuse) -> _Probe:
        return _Probe(arm, workers, 4000, 4, slo, _Context(OPTIONS, _model(), 0.99, 150, 150, "kv", 0, reuse))

    plain, shared = probe(PrefixReuse()), probe(PrefixReuse(0.5, 0.9))
    assert plain(8.0) and shared(8.0)
    assert not plain(13.0) and "TTFT p90" in plain.why
    assert shared(13.0)


def test_the_profiles_note_says_what_sharing_it_was_measured_with() -> None:
    slo = Slo(ttft_ms=2000.0, itl_ms=200.0)
    profile = measure_profile((600,), (2,), OPTIONS, slo, _model(), requests=20, max_requests=40, tolerance=2.0,
                              reuse=PrefixReuse(0.5, 0.9))  # fmt: skip
    assert "prefix sharing: 50.0% of requests continue an earlier prompt over 90.0% of their blocks" in profile.note


# ---------------------------------------------------------------------------- an infeasible mix


def _model() -> DisaggModel:
    return DisaggModel(DisaggThresholds(max_local_prefill_length=0, max_prefill_queue_size=64, max_prefill_queue_tokens=1 << 30))


@pytest.mark.timeout(240)
def test_a_mix_no_rate_serves_is_recorded_and_the_measurement_goes_on(tmp_path: Path) -> None:
    # 500-token prompts prefill in ~24 ms, 8000-token ones in ~165 ms: a 100 ms TTFT SLO
    # is met for the first at some rate and for the second at none (a lone request misses it)
    slo = Slo(ttft_ms=100.0, itl_ms=100.0)
    said: list[str] = []
    profile = measure_profile((500, 8000), (4,), OPTIONS, slo, _model(), requests=20, max_requests=200,
                              progress=said.append, tolerance=1.1)  # fmt: skip
    small, big = profile.points
    assert min(small.prefill_rps, small.decode_rps, small.aggregated_rps) > 0 and not small.infeasible
    assert big.prefill_rps == big.decode_rps == big.aggregated_rps == 0.0
    assert "TTFT p90" in big.infeasible and "prefill:" in big.infeasible
    assert any("infeasible" in line for line in said)
    assert small.bounds is not None
    for low, high in small.bounds[:2]:  # the prefill and decode roles' brackets, within the tolerance
        assert high is not None and low < high <= 1.1 * low
    low, high = small.bounds[2]  # aggregated: up to the probe's ceiling (200 requests in two lifetimes)
    assert low == small.aggregated_rps and (high is None or low < high <= 1.1 * low)
    path = tmp_path / "profile.json"
    dump_profile(profile, path)
    again = load_profile(path)
    assert again == profile and again.version == 2
    # the planner: the infeasible mix is sized with the least measured capacity, flagged
    sizing = size_fleet(again, LoadForecast(10.0, 8000.0, 4.0))
    assert not sizing.attainable and "TTFT" in sizing.capacity.infeasible
    assert sizing.capacity.prefill_rps == small.prefill_rps
    assert size_fleet(again, LoadForecast(10.0, 500.0, 4.0)).attainable


# ---------------------------------------------------------------------------- the file


def _points(prefill: float = 4.0) -> tuple[CapacityPoint, ...]:
    return tuple(CapacityPoint(i, o, prefill, 8.0, 2.0) for i in (1000, 4000) for o in (30, 120))


def test_a_version_1_file_still_loads(tmp_path: Path) -> None:
    old = {"slo_ttft_ms": 2000.0, "slo_itl_ms": 35.0, "attainment": 0.99, "note": "",
           "points": [{"input_tokens": p.input_tokens, "output_tokens": p.output_tokens, "prefill_rps": p.prefill_rps,
                       "decode_rps": p.decode_rps, "aggregated_rps": p.aggregated_rps} for p in _points()]}  # fmt: skip
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path)
    assert profile.version == 1 and profile.points[0].bounds is None
    assert size_fleet(profile, LoadForecast(6.0, 2000.0, 60.0)).attainable


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"version": 3}, "version 3"),
        ({"points": [{"input_tokens": 1000, "output_tokens": 30, "prefill_rps": -1.0, "decode_rps": 1.0,
                      "aggregated_rps": 1.0}]}, "positive finite rates"),  # fmt: skip
    ],
)
def test_a_file_from_a_newer_kvmesh_or_with_bad_rates_is_refused(tmp_path: Path, edit: dict[str, object], message: str) -> None:
    path = tmp_path / "p.json"
    dump_profile(CapacityProfile(2000.0, 35.0, 0.99, _points(), version=2), path)
    data = json.loads(path.read_text())
    data.update(edit)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_profile(path)


@pytest.mark.timeout(240)
def test_cli_writes_a_profile_with_an_infeasible_mix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    lengths = [256 if i % 10 < 3 else 6000 for i in range(40)]
    rows = [{"timestamp": i * 100, "input_length": n, "output_length": 4, "hash_ids": list(range(i * 20, i * 20 + -(-n // 512)))}
            for i, n in enumerate(lengths)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "profile.json"
    status = replay_main([str(trace), "--no-progress", "--block-size", "64", "--slo-ttft-ms", "100", "--slo-tpot-ms", "100",
                          "--profile-tolerance", "1.2", "--profile-capacity", str(out)])  # fmt: skip
    text = capsys.readouterr()
    assert status == 0, text.err
    profile = load_profile(out)
    assert [p.input_tokens for p in profile.points] == [256, 6000]
    assert profile.points[1].aggregated_rps == 0.0 and profile.points[1].infeasible
    assert profile.points[0].aggregated_rps > 0 and math.isfinite(profile.points[0].aggregated_rps)
    assert "meet the SLOs at no rate" in text.out
    assert "no prefix shared beyond the first block" in profile.note  # this trace shares none: said, and measured so
