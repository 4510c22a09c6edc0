"""The peer KV-tier arm (replay/peer_arm.py, issue 33) on the virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cli.replay import main as replay_main
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import VirtualWorker
from kvmesh.protocol import PreprocessedRequest, StopConditions
from kvmesh.replay.peer_arm import _adopt, peer_settings
from kvmesh.router.peer import fetch_pays

pytestmark = pytest.mark.timeout(120)

BS = 16


def _request(rid: str, n: int) -> PreprocessedRequest:
    return PreprocessedRequest(rid, "m", [(i * 7) % 900 + 10 for i in range(n)], stop=StopConditions(max_tokens=2, ignore_eos=True))


def _ttft(adopt_blocks: int) -> tuple[float, int]:
    worker = VirtualWorker(MockerOptions(block_size=BS, num_blocks=512, speedup=1.0))
    req = _request("r", 1600)
    adopted = _adopt(worker, req, adopt_blocks) if adopt_blocks else 0
    record = worker.submit(req, 0.0)
    worker.run_until_idle()
    ttft = record.ttft_ms
    assert ttft is not None
    return ttft, adopted


def test_an_adopted_prefix_is_not_prefilled_on_the_virtual_clock() -> None:
    plain, _ = _ttft(0)
    fetched, adopted = _ttft(90)  # 1,440 of the 1,600 tokens read from a peer
    assert adopted == 90
    assert fetched < plain / 2


def test_the_arm_prices_with_the_workers_own_rates() -> None:
    opts = MockerOptions()
    s = peer_settings(opts)
    assert s.link_gbps == opts.kv_bandwidth / 1e9
    assert fetch_pays(8, opts.block_size, opts.kv_block_bytes, s)
    slow = MockerOptions(kv_bandwidth=1e6)  # 1 MB/s: a read costs more than the prefill
    assert not fetch_pays(8, slow.block_size, slow.kv_block_bytes, peer_settings(slow))


def _shared_prefix(tmp_path: Path) -> Path:
    """One prompt warms an 8-block prefix; then 12 prompts with it arrive together: the
    router spreads them by load, so the other worker lacks the prefix its peer holds."""
    rows = [{"timestamp": 0, "input_length": 64 * 9, "output_length": 4, "hash_ids": list(range(8)) + [50]}]
    for k in range(12):
        tail = [100 + 8 * k + j for j in range(8)]
        rows.append({"timestamp": 2000, "input_length": 64 * 16, "output_length": 40, "hash_ids": list(range(8)) + tail})
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_peer_arm_reads_prefixes_and_says_how_much(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arms.json"
    status = replay_main([
        str(_shared_prefix(tmp_path)), "--workers", "2", "--block-size", "64", "--num-blocks", "256", "--no-progress",
        "--arms", "g1,peer", "--json", str(out),
    ])  # fmt: skip
    assert status == 0
    assert "prompts read a prefix from a peer" in capsys.readouterr().out
    arms = {a["arm"]: a for a in json.loads(out.read_text())}
    g1, peer = arms["g1"], arms["peer"]
    assert g1["peer_fetches"] == 0 and peer["peer_fetches"] > 0
    assert peer["bytes_from_peers"] > 0 and peer["bytes_from_peers"] % (64 * 4096) == 0
    assert peer["cache_hit_rate"] > g1["cache_hit_rate"] and peer["completed"] == 13
    assert peer["ttft_p50_ms"] < g1["ttft_p50_ms"]  # the read prefix was not prefilled


def test_cli_peer_arm_needs_the_kv_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = replay_main([str(_shared_prefix(tmp_path)), "--no-progress", "--arms", "g1,peer", "--router", "round_robin"])
    assert status == 2
    assert "use --router kv" in capsys.readouterr().err
