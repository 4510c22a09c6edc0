"""The ``peer`` KV-tier arms on the virtual clock (``kvmesh replay --arms g1,peer``; issue 33).

The ``kv`` router decides as always; then :func:`~kvmesh.router.peer.plan_peer_fetch`
(the live router's cost: the peer's blocks × the block's bytes ÷ the mocker's
``--kv-bandwidth`` + 1 ms against those tokens at the timing model's prefill rate) says
whether the chosen worker reads the longer prefix another worker holds. When it does,
the chosen worker reserves the prompt's blocks and commits the peer's run as computed
before the request is queued (what :class:`~kvmesh.disagg.engine.DisaggEngine` does
with the blocks it read), so it prefills only the rest.

Simplifications, stated with the figures: the router's index is exact here (events
arrive at once), so the peer still holds what it names; the transfer's time is not put
on the request (at the default 4,096 bytes per token and 25 GB/s a 512-token block
takes 84 µs: ``bytes_from_peers`` says how much moved).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engines.mocker.options import MockerOptions
from kvmesh.engines.mocker.sim import RoutePolicy, VirtualWorker
from kvmesh.protocol import KvEndpoint, KvLayout, PreprocessedRequest
from kvmesh.replay.policies import KvPolicy
from kvmesh.router.peer import PeerFetchSettings, plan_peer_fetch

__all__ = ["PeerMoves", "peer_route", "peer_settings"]


@dataclass
class PeerMoves:
    """What the arm's peer fetches moved."""

    fetches: int = 0
    blocks: int = 0


def peer_settings(options: MockerOptions) -> PeerFetchSettings:
    """The router's cost with the workers' own rates: the KV link and the prefill model."""
    return PeerFetchSettings(link_gbps=options.kv_bandwidth / 1e9, prefill_tokens_per_ms=1.0 / options.prefill_coeffs[1])


def peer_route(policy: KvPolicy, options: MockerOptions, moves: PeerMoves) -> RoutePolicy:
    """``policy``'s decisions, each followed by a peer fetch where the cost says so."""
    bs = options.block_size
    layout = KvLayout(
        "mocker", bs, options.num_blocks, (bs, options.kv_bytes_per_token), "uint8", options.kv_block_bytes, 8,
        options.kv_bandwidth,
    )  # fmt: skip
    endpoints: dict[int, KvEndpoint] = {}
    settings = peer_settings(options)

    def endpoint_of(worker_id: int) -> KvEndpoint:
        return endpoints.setdefault(worker_id, KvEndpoint(f"sim:{worker_id}", layout, True))

    def route(request: PreprocessedRequest, t_ms: float, workers: Sequence[VirtualWorker]) -> int:
        decision = policy.core.route(request.request_id, request.token_ids, t_ms / 1000.0)
        hint = plan_peer_fetch(decision.candidates, decision.worker_id, endpoint_of, bs, settings)
        if hint is not None:
            adopted = _adopt(workers[decision.worker_id], request, hint.blocks)
            moves.fetches += adopted > 0
            moves.blocks += adopted
        return decision.worker_id

    return route


def _adopt(worker: VirtualWorker, request: PreprocessedRequest, blocks: int) -> int:
    """Commit the prompt's first ``blocks`` blocks on ``worker`` as read from a peer;
    the blocks it did not hold itself (0: no room, or it holds them)."""
    sched = worker.scheduler
    bs = worker.options.block_size
    want = min(blocks, (len(request.token_ids) - 1) // bs)
    seq = sched.reserve_request(request)
    if seq is None:
        return 0
    first = seq.num_computed // bs
    if want <= first:
        sched.release(request.request_id)
        return 0
    sched.commit_reserved(request.request_id, want * bs)
    return want - first
