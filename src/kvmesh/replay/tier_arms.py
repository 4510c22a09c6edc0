"""KV-tier arms on the virtual clock: ``kvmesh replay TRACE --arms g1,g1+g2,g1+g2+g3``.

Each arm replays the trace on ``--workers`` mocker workers with the same device pool
(``--num-blocks``) and router, and the KV tiers it names below it
(:mod:`kvmesh.engines.batching.tiers`): ``g1`` the device pool alone, ``g1+g2`` with the
host-memory tier (``--host-kv-blocks``), ``g1+g2+g3`` with the disk tier too
(``--disk-kv-blocks``); onboarding is charged at ``--host-kv-gbps`` / ``--disk-kv-gbps``
(:meth:`~kvmesh.engines.mocker.options.MockerOptions.tiered_step_ms`). The tier sizes are
the engines' own flags: an arm naming a tier of size 0 is refused. ``peer`` (or any arm
with ``+peer``: ``g1+g2+peer``) adds a prefix read from a peer worker when the router's
cost says so (:mod:`kvmesh.replay.peer_arm`).

Each arm's result (:class:`TierArmResult`) adds to the deployment arms' fields
(:class:`~kvmesh.replay.goodput.ArmResult`): ``cache_hit_rate`` (prompt tokens served
from any tier ÷ prompt tokens), and per tier ``tier_hits`` (blocks), ``tier_hit_rate``
(hit tokens ÷ prompt tokens), ``bytes_written`` (written down into G2/G3) and
``bytes_onboarded`` (brought up from them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvmesh.engines.batching.tiers import G1, G2, G3, TIERS
from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RequestRecord, WorkerUsage
from kvmesh.protocol import PreprocessedRequest
from kvmesh.kv.tiers import hit_weights
from kvmesh.replay.arms import default_router
from kvmesh.replay.goodput import ArmResult, Slo, arrival_window_s, summarize_arm
from kvmesh.replay.peer_arm import PeerMoves, peer_route
from kvmesh.replay.policies import KvPolicy, ReplayPolicy
from kvmesh.router.core import RouterSettings
from kvmesh.replay.sim import fleet_options, simulate

__all__ = [
    "TIER_ARMS", "TierArm", "TierArmResult", "format_tier_arms", "is_tier_arms", "parse_tier_arms", "run_tier_arm",
    "tier_router",
]  # fmt: skip

# arm name -> the lower tiers it has
TIER_ARMS: dict[str, tuple[int, ...]] = {"g1": (), "g1+g2": (G2,), "g1+g2+g3": (G2, G3)}
_PEER = "+peer"  # an arm's suffix: prefixes read from peers too ("peer" alone: g1+peer)
_NAMES = {G1: "g1", G2: "g2", G3: "g3"}


@dataclass(frozen=True, slots=True)
class TierArm:
    name: str
    host_blocks: int = 0
    disk_blocks: int = 0
    peer: bool = False  # prefixes read from peer workers (replay/peer_arm.py)

    def options(self, base: MockerOptions) -> MockerOptions:
        """The workers' options under this arm."""
        return replace(base, host_kv_blocks=self.host_blocks, disk_kv_blocks=self.disk_blocks)


def is_tier_arms(text: str) -> bool:
    """Whether ``--arms`` names tier arms (any of :data:`TIER_ARMS`)."""
    return any(_tiers_of(t.strip())[0] in TIER_ARMS for t in text.split(","))


def _tiers_of(name: str) -> tuple[str, bool]:
    """An arm's tier part and whether it reads prefixes from peers."""
    if name == "peer":
        return "g1", True
    return (name[: -len(_PEER)], True) if name.endswith(_PEER) else (name, False)


def parse_tier_arms(text: str, options: MockerOptions) -> tuple[TierArm, ...]:
    """``g1,g1+g2,g1+g2+g3`` → arms sized by ``options``; ValueError with a one-line reason."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if len(set(names)) != len(names):
        raise ValueError(f"--arms names an arm twice: {text}")
    arms = []
    for name in names:
        base, peer = _tiers_of(name)
        tiers = TIER_ARMS.get(base)
        if tiers is None:
            raise ValueError(
                f"unknown tier arm {name!r} (g1, g1+g2, g1+g2+g3, peer or +peer; not mixed with deployment arms)"
            )
        if G2 in tiers and options.host_kv_blocks <= 0:
            raise ValueError(f"arm {name} needs a host tier: set --host-kv-blocks")
        if G3 in tiers and options.disk_kv_blocks <= 0:
            raise ValueError(f"arm {name} needs a disk tier: set --disk-kv-blocks")
        host, disk = (options.host_kv_blocks if G2 in tiers else 0), (options.disk_kv_blocks if G3 in tiers else 0)
        arms.append(TierArm(name, host, disk, peer))
    return tuple(arms)


@dataclass
class TierArmResult(ArmResult):
    """An arm's figures with its KV tiers' (see the module docstring)."""

    cache_hit_rate: float = 0.0
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_hit_rate: dict[str, float] = field(default_factory=dict)
    bytes_written: dict[str, int] = field(default_factory=dict)
    bytes_onboarded: dict[str, int] = field(default_factory=dict)
    peer_fetches: int = 0  # requests whose prefix was read from a peer (peer arms)
    bytes_from_peers: int = 0

    def to_json(self) -> dict[str, object]:
        d = super().to_json()
        d["cache_hit_rate"] = None if math.isnan(self.cache_hit_rate) else self.cache_hit_rate
        d["tier_hits"] = dict(self.tier_hits)
        d["tier_hit_rate"] = dict(self.tier_hit_rate)
        d["bytes_written"] = dict(self.bytes_written)
        d["bytes_onboarded"] = dict(self.bytes_onboarded)
        d["peer_fetches"] = self.peer_fetches
        d["bytes_from_peers"] = self.bytes_from_peers
        return d


def tier_router(name: str, options: MockerOptions, seed: int = 0) -> Callable[[int], ReplayPolicy]:
    """The arms' router factory: ``kv`` prices a G2/G3 hit from the workers' own model
    (:func:`~kvmesh.kv.tiers.hit_weights` of their KV bytes per token, prefill rate and
    tier bandwidths); any other router is :func:`~kvmesh.replay.arms.default_router`'s."""
    if name != "kv":
        return default_router(name, options, seed)
    rate = 1000.0 / options.prefill_coeffs[1]  # tokens/s: the timing model's linear term
    weights = hit_weights(options.kv_bytes_per_token, rate, options.host_kv_gbps, options.disk_kv_gbps)
    settings = RouterSettings(block_size=options.block_size, mode="kv", seed=seed, tier_weights=weights)
    return lambda n: KvPolicy(n, settings)


def run_tier_arm(
    arm: TierArm,
    arrivals: Iterable[tuple[float, PreprocessedRequest]],
    options: MockerOptions,
    workers: int,
    make_router: Callable[[int], ReplayPolicy],
    slo: Slo,
    on_done: Callable[[], None] | None = None,
) -> TierArmResult:
    """Replay ``arrivals`` under ``arm`` and summarize it."""
    opts = arm.options(options)
    usage: list[WorkerUsage] = []
    policy, moves, route = make_router(workers), PeerMoves(), None
    if arm.peer:
        if not isinstance(policy, KvPolicy):
            raise ValueError(f"arm {arm.name} reads prefixes from peers as the kv router decides: use --router kv")
        route = peer_route(policy, opts, moves)
    records = simulate(arrivals, policy, fleet_options(opts, workers), on_done, usage, route)
    base = summarize_arm(arm.name, records, slo, arrival_window_s([r.arrival_ms for r in records]))
    result = TierArmResult(**vars(base))
    _add_tier_figures(result, records, usage, opts, moves)
    return result


def _add_tier_figures(
    result: TierArmResult,
    records: Sequence[RequestRecord],
    usage: Sequence[WorkerUsage],
    opts: MockerOptions,
    moves: PeerMoves | None = None,
) -> None:
    prompt = sum(r.prompt_tokens for r in records)
    hits = {t: sum(u.tiers.hits[t] for u in usage) for t in TIERS}
    block = opts.kv_block_bytes
    peer_tokens = moves.blocks * opts.block_size if moves is not None else 0  # read from peers: not computed either
    result.cache_hit_rate = (sum(r.cached_tokens for r in records) + peer_tokens) / prompt if prompt else math.nan
    if moves is not None and moves.fetches:
        result.peer_fetches, result.bytes_from_peers = moves.fetches, moves.blocks * block
        result.tier_hit_rate["peer"] = peer_tokens / prompt if prompt else 0.0
    result.tier_hits = {_NAMES[t]: n for t, n in hits.items()}
    result.tier_hit_rate.update({_NAMES[t]: (n * opts.block_size / prompt if prompt else 0.0) for t, n in hits.items()})
    result.bytes_written = {_NAMES[t]: block * sum(u.tiers.written[t] for u in usage) for t in (G2, G3)}
    result.bytes_onboarded = {_NAMES[t]: block * sum(u.tiers.onboarded[t] for u in usage) for t in (G2, G3)}


def format_tier_arms(results: Sequence[TierArmResult]) -> str:
    """A table, one row per arm, then each arm against the first (device-only) one."""
    head = f"{'arm':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}{'hit rate':>9}"
    head += f"{'G1 hit':>8}{'G2 hit':>8}{'G3 hit':>8}{'GB down':>9}{'GB up':>8}"
    lines = [head]
    for r in results:
        rate = r.tier_hit_rate
        down = sum(r.bytes_written.values()) / 1e9
        up = sum(r.bytes_onboarded.values()) / 1e9
        lines.append(
            f"{r.arm:<10}{r.ttft_p50_ms:>10.0f}{r.ttft_p99_ms:>10.0f}{r.itl_p99_ms:>9.1f}{r.cache_hit_rate:>9.1%}"
            f"{rate.get('g1', 0):>8.1%}{rate.get('g2', 0):>8.1%}{rate.get('g3', 0):>8.1%}{down:>9.2f}{up:>8.2f}"
        )
    for r in results:
        if r.peer_fetches:
            lines.append(
                f"{r.arm}: {r.peer_fetches} prompts read a prefix from a peer ({r.bytes_from_peers / 1e9:.2f} GB, "
                f"{r.tier_hit_rate.get('peer', 0):.1%} of prompt tokens)"
            )
    if len(results) > 1:
        ref = results[0]
        for r in results[1:]:
            lines.append(
                f"{r.arm} vs {ref.arm}: TTFT p50 {_ratio(ref.ttft_p50_ms, r.ttft_p50_ms)}× better, hit rate "
                f"{_ratio(r.cache_hit_rate, ref.cache_hit_rate)}×, ITL p99 {_ratio(r.itl_p99_ms, ref.itl_p99_ms)}×"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and math.isfinite(a) and math.isfinite(b) else "n/a"
