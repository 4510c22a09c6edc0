"""`kvmesh replay`: trace loading and synthesis, the virtual-clock replay with router
feedback, the summary, and the command line (JSON, plot, errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cli.replay import main as replay_main
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.replay import (
    JSON_FIELDS,
    TRACE_BLOCK_TOKENS,
    ReplayConfig,
    TokenSynth,
    TraceError,
    arrivals,
    fleet_options,
    load_trace,
    make_policy,
    replay,
    simulate,
)
from kvmesh.replay.plot import MATPLOTLIB_HINT, have_matplotlib

MOCKER = MockerOptions(block_size=64, num_blocks=1024, max_num_batched_tokens=4096)
CONVERSATIONS, TURNS = 5, 3


def conversation_trace() -> list[dict[str, object]]:
    """5 conversations x 3 turns, each turn extending the last one's prompt, all sharing
    block id 0 (like the Mooncake conversation trace). With 4 workers, round robin sends
    each turn of a conversation to a different worker than the previous one."""
    rows = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            own = [1000 * (c + 1) + i for i in range(3 * (turn + 1))]
            ids = [0, *own]
            rows.append(
                {
                    "timestamp": turn * 3000 + c * 150,
                    "input_length": len(ids) * TRACE_BLOCK_TOKENS - 100,
                    "output_length": 12,
                    "hash_ids": ids,
                }
            )
    return rows


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "trace.jsonl", conversation_trace())


def config(**kw: object) -> ReplayConfig:
    args: dict[str, object] = {"policies": ("round_robin", "random", "kv", "kv-approx"), "mocker": MOCKER, "speed": 2.0}
    args.update(kw)
    return ReplayConfig(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- trace and synthesis


def test_token_synthesis_is_a_pure_function_of_the_hash_id() -> None:
    a, b = TokenSynth(2048), TokenSynth(2048, cache_blocks=1)
    for h in (0, 1, 7, 123456789):
        assert a.block(h) == b.block(h) and len(a.block(h)) == TRACE_BLOCK_TOKENS
        assert all(0 <= t < 2048 for t in a.block(h))
    assert a.block(1) != a.block(2)
    assert max(TokenSynth(100).block(5)) < 100


def test_prompts_share_exactly_their_common_leading_ids() -> None:
    synth = TokenSynth(2048)
    p1 = synth.prompt([0, 1, 2], 1200)
    p2 = synth.prompt([0, 1, 9, 10], 1900)
    assert len(p1) == 1200 and len(p2) == 1900
    assert p1[:1024] == p2[:1024] and p1[1024:1100] != p2[1024:1100]
    assert synth.prompt([0, 1], 600) == p1[:600]  # truncation cuts the last block


def test_arrivals_scale_time_and_build_fixed_length_requests(trace_file: Path) -> None:
    trace = load_trace(trace_file)
    out = list(arrivals(trace, TokenSynth(2048), speed=4.0))
    assert [t for t, _ in out][:3] == [0.0, 150 / 4, 300 / 4]
    first = out[0][1]
    assert first.request_id == "r0" and len(first.token_ids) == trace[0].input_length
    assert first.stop.max_tokens == 12 and first.stop.ignore_eos


def test_load_trace_window_and_limit(trace_file: Path) -> None:
    assert len(load_trace(trace_file)) == CONVERSATIONS * TURNS
    window = load_trace(trace_file, start_ms=3000, duration_ms=3000)
    assert [r.timestamp_ms for r in window] == [3000 + c * 150 for c in range(CONVERSATIONS)]
    assert len(load_trace(trace_file, start_ms=3000, limit=2)) == 2
    with pytest.raises(TraceError, match="no request in the window"):
        load_trace(trace_file, start_ms=1e9)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "cannot read trace"),
        ("", "has no requests"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\nnot json\n', ":2: not JSON"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [0]}\n', "missing field 'output_length'"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n', "timestamp"),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0]}\n', "needs 2 hash ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}\n', "hash_ids"),
        ("[1, 2]\n", "expected a JSON object"),
    ],
)
def test_bad_trace_files_raise_one_line_errors(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------- the replay


def test_replay_is_deterministic_and_completes_every_request(trace_file: Path) -> None:
    trace = load_trace(trace_file)
    first, second = replay(trace, config()), replay(trace, config())
    assert [r.to_json() for r in first] == [r.to_json() for r in second]
    assert [r.ttfts_ms for r in first] == [r.ttfts_ms for r in second]
    for r in first:
        assert r.requests == len(trace) and r.failed == 0
        assert r.ttft_p50_ms > 0 and r.throughput_tok_s > 0


def test_kv_routing_hits_the_cache_more_than_round_robin(trace_file: Path) -> None:
    results = {r.policy: r for r in replay(load_trace(trace_file), config())}
    rr, kv, approx = results["round_robin"], results["kv"], results["kv-approx"]
    assert kv.cache_hit_rate > rr.cache_hit_rate + 0.2
    assert approx.cache_hit_rate > rr.cache_hit_rate + 0.2
    assert kv.ttft_p50_ms < rr.ttft_p50_ms


def test_kv_events_and_token_times_reach_the_router(trace_file: Path) -> None:
    trace = load_trace(trace_file)
    policy = make_policy("kv", 4, block_size=MOCKER.block_size)
    records = simulate(arrivals(trace, TokenSynth(MOCKER.vocab_size)), policy, fleet_options(MOCKER, 4))
    core = policy.core  # type: ignore[attr-defined]
    assert core.indexer.num_blocks > 0  # fed by the workers' KV events
    assert len(core.load) == 0  # every first token and finish was reported
    turns: dict[int, list[int]] = {}  # every later turn went where its conversation's history was
    for rec in records:
        turns.setdefault(int(rec.request_id[1:]) % CONVERSATIONS, []).append(rec.worker_id)
    assert all(len(set(w)) == 1 for w in turns.values())


def test_real_clock_replay_completes(trace_file: Path) -> None:
    fast = MockerOptions(block_size=64, num_blocks=1024, speedup=50.0)
    cfg = config(policies=("round_robin", "kv"), clock="real", speed=50.0, mocker=fast)
    trace = load_trace(trace_file, limit=10)
    for r in replay(trace, cfg):
        assert r.requests == 10 and r.failed == 0 and r.ttft_p50_ms > 0


def test_bad_config_values_are_value_errors() -> None:
    for kw in ({"policies": ("fastest",)}, {"workers": 0}, {"speed": 0.0}, {"clock": "wall"}, {"policies": ()}):
        with pytest.raises(ValueError):
            config(**kw)


# ---------------------------------------------------------------------------- command line


def cli(*args: str) -> int:
    return replay_main([*args, "--no-progress", "--block-size", "64", "--num-blocks", "1024"])


def test_cli_prints_the_table_and_writes_exact_json(trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    assert cli(str(trace_file), "--policy", "round_robin,kv", "--speed", "2", "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "round_robin" in text and "TTFT p50" in text and "cache hit" in text
    data = json.loads(out.read_text())
    assert [d["policy"] for d in data] == ["round_robin", "kv"]
    for d in data:
        assert list(d) == list(JSON_FIELDS)
        assert d["requests"] == CONVERSATIONS * TURNS and 0 <= d["cache_hit_rate"] <= 1


def test_cli_plot_or_hint(trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "ttft.png"
    assert cli(str(trace_file), "--policy", "round_robin,kv", "--limit", "5", "--plot", str(png)) == 0
    err = capsys.readouterr().err
    if have_matplotlib():
        assert png.stat().st_size > 0
    else:
        assert MATPLOTLIB_HINT in err and not png.exists()


@pytest.mark.parametrize("name", ["missing.jsonl", "bad.jsonl"])
def test_cli_bad_trace_is_one_line_and_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    path = tmp_path / name
    if name == "bad.jsonl":
        path.write_text("{oops\n")
    assert cli(str(path)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvmesh replay: ") and str(path) in err and len(err.splitlines()) == 1


def test_cli_bad_option_is_exit_2(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(str(trace_file), "--policy", "round_robin,best") == 2
    assert "unknown policy 'best'" in capsys.readouterr().err
