"""``kvmesh replay``'s own settings, each declared once (flag, default, help, check:
:mod:`kvmesh.settings`). Light on purpose: the CLI adds these flags to its parser
without importing the replay machinery (:class:`~kvmesh.replay.runner.ReplayConfig`
adds the mocker workers' options and checks the policy names)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.settings import at_least, check, non_negative, positive, setting, split_commas

__all__ = ["CLOCKS", "ReplaySettings"]

CLOCKS = ("virtual", "real")
_ROUTER = "KV router"


@dataclass(frozen=True)
class ReplaySettings:
    """What to replay the trace with; ``seed`` drives ``random`` and the KV router's tie-breaking."""

    policies: tuple[str, ...] = setting(
        ("round_robin", "kv"), "comma-separated policies to compare: round_robin, random, kv, kv-approx",
        flag="--policy", parse=split_commas, metavar="LIST",
    )  # fmt: skip
    workers: int = setting(4, "mocker workers", check=at_least(1))
    clock: str = setting("virtual", "virtual (fast, deterministic) or real time", choices=CLOCKS)
    speed: float = setting(1.0, "arrival-time scale: 2 replays the trace twice as fast", check=positive)
    overlap_weight: float = setting(1.0, "weight of prefill blocks in the cost", check=non_negative, group=_ROUTER)
    router_temperature: float = setting(0.0, "0: lowest cost wins; > 0: softmax sampling", check=non_negative, group=_ROUTER)
    seed: int = setting(0, "seed of the random policy and the router's tie-breaking", group=_ROUTER)

    def __post_init__(self) -> None:
        check(self)
