"""``kvmesh replay --arms``: parsing, SLO/goodput accounting, the disaggregated fleet
on the virtual clock (transfer time, queue bounds, pipelining, same tokens as
aggregated), the planner arm, the shifting trace and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.cli.replay import main as replay_main
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord
from kvmesh.protocol import DisaggThresholds, PreprocessedRequest, StopConditions
from kvmesh.replay.arms import Arm, DisaggModel, PlannerSettings, default_router, parse_arms, run_arm
from kvmesh.replay.goodput import ARM_JSON_FIELDS, Slo, arrival_window_s, mean_itl_ms, meets, summarize_arm
from kvmesh.replay.synth import Phase, shifting_trace
from kvmesh.replay.trace import TokenSynth, arrivals, load_trace

OPTIONS = MockerOptions(block_size=64, num_blocks=4096, context_length=40_000, kv_bytes_per_token=65536, kv_bandwidth=25e9)


def _request(rid: str, prompt: int, out: int = 8, salt: int = 0) -> PreprocessedRequest:
    tokens = [(i * 31 + salt * 7919) % 2000 + 5 for i in range(prompt)]
    return PreprocessedRequest(request_id=rid, model="m", token_ids=tokens, stop=StopConditions(max_tokens=out, ignore_eos=True))


def _burst(n: int, prompt: int, gap_ms: float = 50.0, out: int = 8) -> list[tuple[float, PreprocessedRequest]]:
    return [(i * gap_ms, _request(f"r{i}", prompt, out, salt=i)) for i in range(n)]


def _run(arm: str, stream, workers: int = 2, options: MockerOptions = OPTIONS, **kw):  # type: ignore[no-untyped-def]
    (parsed,) = parse_arms(arm, workers)
    return run_arm(parsed, stream, options, workers, default_router("kv", options), **kw)


# ---------------------------------------------------------------------------- parsing


def test_arms_parse_any_split_of_the_workers() -> None:
    arms = parse_arms("aggregated, disagg:3p1d,disagg:2p2d,planner", 4)
    assert arms == (
        Arm("aggregated"),
        Arm("disagg:3p1d", 3, 1),
        Arm("disagg:2p2d", 2, 2),
        Arm("planner", 2, 2, planner=True),
    )
    assert parse_arms("disagg:5p3d,planner:1p7d", 8)[1] == Arm("planner:1p7d", 1, 7, planner=True)


@pytest.mark.parametrize(
    "text, message",
    [
        ("disagg:3p2d", "= --workers 4"),
        ("disagg:0p4d", "at least 1 prefill"),
        ("disagg:4p0d", "at least 1 prefill"),
        ("disagg:2x2", "unknown arm"),
        ("split", "unknown arm"),
        ("aggregated,aggregated", "twice"),
        (" , ", "at least one arm"),
    ],
)
def test_bad_arms_are_one_line_value_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_arms(text, 4)


# ---------------------------------------------------------------------------- SLO accounting


def _record(rid: str, arrival: float, times: list[float], reason: str | None = "length") -> RequestRecord:
    r = RequestRecord(rid, 0, arrival, 10, token_ids=list(range(len(times))), token_times_ms=times)
    r.finish_reason = reason  # type: ignore[assignment]
    r.finish_ms = times[-1] if times else None
    return r


def test_a_request_counts_when_ttft_and_mean_itl_both_meet_the_slo() -> None:
    slo = Slo(ttft_ms=100.0, itl_ms=10.0)
    good = _record("a", 0.0, [100.0, 105.0, 120.0])  # TTFT 100, mean ITL 10: both on the limit
    slow_first = _record("b", 0.0, [101.0, 102.0])
    # one 25 ms gap but a mean of (40 - 10) / 3 = 10 ms: the mean is what counts
    bursty = _record("c", 0.0, [10.0, 11.0, 12.0, 40.0])
    slow_mean = _record("d", 0.0, [10.0, 21.0, 32.0])
    one_token = _record("e", 0.0, [50.0])  # no gap: meets any ITL SLO
    failed = _record("f", 0.0, [10.0, 11.0], reason="error")
    assert [meets(r, slo) for r in (good, slow_first, bursty, slow_mean, one_token, failed)] == [
        True, False, True, False, True, False,
    ]  # fmt: skip
    assert mean_itl_ms(bursty) == pytest.approx(10.0) and mean_itl_ms(one_token) is None


def test_goodput_is_good_requests_over_the_shared_arrival_window() -> None:
    slo = Slo(ttft_ms=100.0, itl_ms=10.0)
    records = [
        _record("a", 0.0, [50.0, 55.0]),
        _record("b", 1000.0, [1050.0, 1055.0]),
        _record("c", 2000.0, [2500.0, 2505.0]),  # TTFT 500: misses
        _record("d", 3000.0, [3010.0, 3015.0]),
    ]
    window = arrival_window_s([r.arrival_ms for r in records])
    assert window == pytest.approx(3.0 * 4 / 3)  # N requests cover N gaps
    result = summarize_arm("x", records, slo, window)
    assert (result.good, result.completed, result.requests) == (3, 4, 4)
    assert result.goodput_rps == pytest.approx(3 / 4.0)
    assert result.slo_met_fraction == pytest.approx(0.75)
    assert result.ttft_p50_ms == pytest.approx(50.0) and result.itl_p50_ms == pytest.approx(5.0)
    out = result.to_json()
    assert list(out)[: len(ARM_JSON_FIELDS)] == list(ARM_JSON_FIELDS)
    assert arrival_window_s([5.0, 5.0]) is None


# ---------------------------------------------------------------------------- the fleet


def test_disaggregated_arm_serves_every_request_with_the_aggregated_tokens() -> None:
    stream = _burst(12, 3000)
    agg = _run("aggregated", stream)
    dis = _run("disagg:1p1d", stream)
    assert [r.request_id for r in dis.records] == [f"r{i}" for i in range(12)]
    assert all(r.finish_reason == "length" for r in dis.records)
    assert dis.counters["remote_prefills"] > 0
    assert dis.counters["remote_prefills"] + dis.counters["local_prefills"] == 12
    assert [r.token_ids for r in dis.records] == [r.token_ids for r in agg.records]
    again = _run("disagg:1p1d", stream)  # deterministic
    assert [r.token_times_ms for r in again.records] == [r.token_times_ms for r in dis.records]


def test_kv_transfer_time_is_bytes_over_bandwidth() -> None:
    stream = [(0.0, _request("r0", 6400, out=2))]
    fast = _run("disagg:1p1d", stream)
    slow = _run("disagg:1p1d", stream, options=replace(OPTIONS, kv_bandwidth=2.5e9))
    # 6399 tokens to compute: 100 blocks of 64 tokens × 64 KiB written
    nbytes = 100 * 64 * 65536
    expected = nbytes / 2.5e9 * 1000 - nbytes / 25e9 * 1000
    ttft = [r.records[0].ttft_ms for r in (fast, slow)]
    assert ttft[1] - ttft[0] == pytest.approx(expected, rel=1e-6)  # type: ignore[operator]
    assert fast.counters["kv_bytes"] == nbytes
    # and the compute is the aggregated worker's prefill physics (full-budget passes)
    assert ttft[0] > OPTIONS.remote_prefill_ms(6399) + nbytes / 25e9 * 1000


def test_the_queue_bound_holds_in_jobs_and_in_tokens() -> None:
    stream = _burst(20, 4000, gap_ms=5.0)
    by_jobs = _run("disagg:1p1d", stream, model=DisaggModel(DisaggThresholds(1000, 3)))
    assert by_jobs.counters["queue_max"] == 3 and by_jobs.counters["local_by_queue"] > 0
    tokens = DisaggThresholds(1000, 100, max_prefill_queue_tokens=7000)  # 3999-token jobs: taken at 0 and 3999 ahead
    by_tokens = _run("disagg:1p1d", stream, model=DisaggModel(tokens))
    assert by_tokens.counters["queue_max"] == 2 and by_tokens.counters["local_by_queue"] > 0
    assert all(r.finish_reason == "length" for r in by_tokens.records)


def test_pipelined_writes_finish_a_burst_sooner() -> None:
    slow_link = replace(OPTIONS, kv_bandwidth=2e9)  # a write takes about as long as the compute
    stream = _burst(6, 4000, gap_ms=1.0)
    model = DisaggThresholds(1000, 100)
    piped = _run("disagg:1p1d", stream, options=slow_link, model=DisaggModel(model, pipeline=True))
    plain = _run("disagg:1p1d", stream, options=slow_link, model=DisaggModel(model, pipeline=False))
    assert piped.counters["remote_prefills"] == plain.counters["remote_prefills"] == 6
    last_first_token = [max(r.token_times_ms[0] for r in run.records) for run in (piped, plain)]
    assert last_first_token[0] < last_first_token[1]


def test_planner_arm_moves_workers_on_a_shifting_load_and_logs_why() -> None:
    rows = shifting_trace((Phase(20.0, 16_000, 40), Phase(20.0, 1_000, 1_000)), rate=8.0, seed=1)
    trace = load_trace_rows(rows)
    options = replace(OPTIONS, num_blocks=24576)
    stream = list(arrivals(trace, TokenSynth(options.vocab_size)))
    settings = PlannerSettings(interval_s=1.0, window_s=5.0)
    run = _run("planner:1p3d", stream, workers=4, options=options, planner=settings)
    moves = [d for d in run.decisions if " move " in d]
    assert moves, run.decisions
    assert all("prefill_pressure=" in d and "ttft_p90_ms=" in d and "queue_tokens=" in d for d in moves)
    assert run.counters["moves"] >= 1
    assert all(r.finish_reason == "length" for r in run.records)


def load_trace_rows(rows: list[dict[str, object]]):  # type: ignore[no-untyped-def]
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    try:
        return load_trace(f.name)
    finally:
        Path(f.name).unlink()


def test_shifting_trace_has_a_prefill_heavy_then_a_decode_heavy_phase() -> None:
    rows = shifting_trace((Phase(10.0, 16_000, 40), Phase(10.0, 1_000, 2_000)), rate=5.0, seed=3)
    assert rows == shifting_trace((Phase(10.0, 16_000, 40), Phase(10.0, 1_000, 2_000)), rate=5.0, seed=3)
    first = [r for r in rows if int(r["timestamp"]) < 10_000]  # type: ignore[call-overload]
    second = [r for r in rows if int(r["timestamp"]) >= 10_000]  # type: ignore[call-overload]
    assert first and second
    assert min(int(r["input_length"]) for r in first) > max(int(r["input_length"]) for r in second)  # type: ignore[call-overload]
    assert max(int(r["output_length"]) for r in first) < min(int(r["output_length"]) for r in second)  # type: ignore[call-overload]


# ---------------------------------------------------------------------------- command line


def _trace(tmp_path: Path) -> Path:
    rows = shifting_trace((Phase(4.0, 6_000, 20), Phase(4.0, 800, 60)), rate=3.0, seed=2)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_arms_write_one_json_object_per_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arms.json"
    status = replay_main([
        str(_trace(tmp_path)), "--workers", "4", "--block-size", "64", "--num-blocks", "4096", "--no-progress",
        "--arms", "aggregated,disagg:3p1d,disagg:2p2d,planner", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "100",
        "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    text = capsys.readouterr().out
    assert "SLOs: TTFT <= 5000 ms, mean ITL <= 100 ms" in text and "goodput disagg:3p1d / aggregated" in text
    arms = json.loads(out.read_text())
    assert [a["arm"] for a in arms] == ["aggregated", "disagg:3p1d", "disagg:2p2d", "planner"]
    for a in arms:
        assert set(ARM_JSON_FIELDS) <= set(a)
        assert a["goodput_rps"] > 0 and 0 < a["slo_met_fraction"] <= 1
        assert a["ttft_p50_ms"] <= a["ttft_p99_ms"] and a["itl_p50_ms"] <= a["itl_p99_ms"]
        assert math.isfinite(a["goodput_rps"])
    assert arms[1]["remote_prefills"] > 0 and arms[0]["remote_prefills"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "disagg:3p3d"], "= --workers 4"),
        (["--arms", "aggregated", "--slo-tpot-ms", "0"], "--slo-tpot-ms must be positive"),
        (["--arms", "nope"], "unknown arm"),
    ],
)
def test_cli_bad_arms_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    status = replay_main([str(_trace(tmp_path)), "--workers", "4", "--no-progress", *args])
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- issue 32: cost, scaling, the day


def _day_stream(seconds: float = 60.0, trough: float = 0.5, peak: float = 8.0):  # type: ignore[no-untyped-def]
    from kvmesh.replay.synth import Day, day_trace

    trace = load_trace_rows(day_trace(Day(seconds, trough, peak, 2_000, 60), seed=4))
    return list(arrivals(trace, TokenSynth(OPTIONS.vocab_size)))


def _hand_profile():  # type: ignore[no-untyped-def]
    from kvmesh.planner.profile import CapacityPoint, CapacityProfile

    pts = tuple(CapacityPoint(i, o, 4.0, 8.0, 2.0) for i in (1000, 4000) for o in (30, 120))
    return CapacityProfile(5000.0, 100.0, 0.99, pts)


@pytest.mark.timeout(120)
def test_fixed_arms_hold_their_workers_for_the_makespan() -> None:
    stream = _day_stream(20.0, 2.0, 4.0)
    for arm in ("aggregated", "disagg:1p1d"):
        run = _run(arm, stream, workers=2)
        first = min(r.arrival_ms for r in run.records)
        last = max(r.finish_ms for r in run.records if r.finish_ms is not None)
        assert run.worker_seconds == pytest.approx(2 * (last - first) / 1000.0)


@pytest.mark.timeout(120)
def test_planner_scales_an_aggregated_fleet_with_a_day_and_counts_its_worker_seconds() -> None:
    from kvmesh.planner.core import PlannerConfig

    stream = _day_stream(60.0, 0.5, 5.0)  # 1 worker at the trough, 3 at the peak (2 req/s each, headroom 0.85)
    cfg = PlannerConfig(slo_ttft_ms=5000.0, slo_itl_ms=100.0, profile=_hand_profile(), hold_rounds=2, cooldown_s=4.0)
    settings = PlannerSettings(interval_s=1.0, window_s=5.0, config=cfg, min_workers=1, start_s=2.0)
    run = _run("planner:aggregated", stream, workers=4, planner=settings)
    assert run.counters["starts"] >= 2 and run.counters["stops"] >= 2, run.decisions
    assert all(r.finish_reason == "length" for r in run.records)  # a stopped worker drained: nothing lost
    first = min(r.arrival_ms for r in run.records)
    last = max(r.finish_ms for r in run.records if r.finish_ms is not None)
    makespan = (last - first) / 1000.0
    assert makespan < run.worker_seconds < 3 * makespan  # it scaled down between the peaks: not 4 the whole time
    sizes = [row[3] for row in run.timeline]
    assert max(sizes) >= 3 and sizes[0] == 1 and sizes[-1] <= 2
    assert any(row[5] > 0 for row in run.timeline)  # the forecast, per tick
    assert any("forecast_rps=" in d and " start -> aggregated" in d for d in run.decisions)


def test_arms_json_reports_worker_seconds_and_goodput_per_worker_hour(tmp_path: Path) -> None:
    from kvmesh.replay.goodput import COST_JSON_FIELDS

    records = [_record("a", 0.0, [100.0, 110.0]), _record("b", 1000.0, [1100.0, 1110.0])]
    res = summarize_arm("planner", records, Slo(), arrival_window_s([0.0, 1000.0]), {"starts": 2, "stops": 1}, (), {},
                        worker_seconds=1800.0)  # fmt: skip
    d = res.to_json()
    assert set(COST_JSON_FIELDS) <= set(d)
    assert d["worker_seconds"] == 1800.0 and d["goodput_per_worker_hour"] == pytest.approx(4.0)  # 2 good in 0.5 h
    assert (d["starts"], d["stops"]) == (2, 1)


def test_cli_planner_arm_takes_min_workers_and_a_capacity_profile(tmp_path: Path) -> None:
    from kvmesh.planner.profile import dump_profile

    profile = tmp_path / "p.json"
    dump_profile(_hand_profile(), profile)
    out = tmp_path / "arms.json"
    status = replay_main([
        str(_trace(tmp_path)), "--workers", "3", "--block-size", "64", "--num-blocks", "4096", "--no-progress",
        "--arms", "aggregated,planner:aggregated", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "100",
        "--min-workers", "1", "--capacity-profile", str(profile), "--planner-start", "1", "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    fixed, planner = json.loads(out.read_text())
    assert fixed["worker_seconds"] > planner["worker_seconds"] > 0
    assert planner["planner_timeline"] and fixed["planner_timeline"] == []
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert replay_main([str(_trace(tmp_path)), "--arms", "planner", "--capacity-profile", str(bad)]) == 2
    assert replay_main([str(_trace(tmp_path)), "--arms", "planner", "--workers", "2", "--min-workers", "3"]) == 2
    assert replay_main([str(_trace(tmp_path)), "--arms", "planner", "--planner-headroom", "0"]) == 2


def test_day_trace_rises_tenfold_to_its_middle_and_falls_back() -> None:
    from kvmesh.replay.synth import Day, day_rate, day_trace

    day = Day(200.0, 1.0, 10.0)
    assert day_rate(day, 0.0) == pytest.approx(1.0) and day_rate(day, 100.0) == pytest.approx(10.0)
    rows = day_trace(day, seed=5)
    assert rows == day_trace(day, seed=5)
    ts = [int(r["timestamp"]) / 1000.0 for r in rows]  # type: ignore[call-overload]
    edges = sum(1 for t in ts if t < 20 or t >= 180)
    middle = sum(1 for t in ts if 80 <= t < 120)
    assert middle > 4 * edges / 2  # 40 s at ~9.6/s against 40 s at ~1.2/s
    assert abs(len(rows) - 1100) < 150  # the integral of the curve: 200 s x 5.5/s
    assert all(0.75 * 4000 <= int(r["input_length"]) <= 1.25 * 4000 for r in rows)  # type: ignore[call-overload]
