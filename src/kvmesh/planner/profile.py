"""Capacity profile of the workers, and fleet sizing from it: pure but for the file.

A profile says, for a grid of request mixes (mean prompt × output tokens), how many
requests per second **one** worker carries while the fleet still meets the SLO for
the profile's ``attainment`` share of requests: as a prefill worker (decode ample), as
a decode worker (prefill ample) and aggregated. ``kvmesh replay --profile-capacity
FILE`` measures one on the virtual-clock mocker (:mod:`kvmesh.replay.capacity`); the
planner loads it with ``--capacity-profile FILE`` (replay and live alike).

:func:`size_fleet` turns a :class:`~kvmesh.planner.forecast.LoadForecast` into worker
counts: the forecast rate over one worker's capacity at the forecast mix (interpolated
on the grid, log-linearly in both lengths), divided by ``headroom`` (< 1: the fleet is
sized to run below its measured limit). Outside the grid the profile never claims more
than it measured: shorter requests than its shortest get the edge's capacity (not an
extrapolation upward: a forecast's mean length of 0 at a shift would size one worker),
and longer ones at most the edge's tokens per second (capacity × edge ÷ length, e.g. a
3000-token answer a fifth of a 600-token one's), or less where the edge segment's
log-linear slope, extrapolated at most one segment, falls faster (a 100k-token prompt
is not given a 16k-token one's capacity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvmesh.planner.forecast import LoadForecast

__all__ = ["MAX_PROFILE_BYTES", "PROFILE_VERSION", "CapacityPoint", "CapacityProfile", "Sizing", "load_profile", "dump_profile", "size_fleet"]

MAX_PROFILE_BYTES = 1 << 20
PROFILE_VERSION = 2  # 2: per-role measured bounds, 0 req/s for a mix no rate serves at the SLOs (1 still loads)
_MAX_POINTS = 1024


class CapacityPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One mix and what one worker carries of it (requests/s at the SLO; 0: no rate
    meets the SLOs at this mix, ``infeasible`` says why)."""

    input_tokens: int
    output_tokens: int
    prefill_rps: float
    decode_rps: float
    aggregated_rps: float
    # per role (prefill, decode, aggregated): the measured (low, high) req/s, the SLOs held
    # at low and failed at high (None: none failed up to the search's limit)
    bounds: tuple[tuple[float, float | None], tuple[float, float | None], tuple[float, float | None]] | None = None
    infeasible: str = ""


class CapacityProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``points`` cover a full grid: every input length with every output length."""

    slo_ttft_ms: float
    slo_itl_ms: float
    attainment: float
    points: tuple[CapacityPoint, ...]
    note: str = ""  # how it was measured (workers' options, trace)
    version: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.version <= PROFILE_VERSION:
            raise ValueError(f"capacity profile version {self.version}: this kvmesh reads 1 to {PROFILE_VERSION}")
        if not (0 < self.attainment <= 1 and self.slo_ttft_ms > 0 and self.slo_itl_ms > 0):
            raise ValueError("a capacity profile needs 0 < attainment <= 1 and positive SLOs")
        if not 0 < len(self.points) <= _MAX_POINTS:
            raise ValueError(f"a capacity profile holds 1 to {_MAX_POINTS} points, got {len(self.points)}")
        for p in self.points:
            values = (p.prefill_rps, p.decode_rps, p.aggregated_rps)
            if min(p.input_tokens, p.output_tokens) < 1 or not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"a capacity point needs lengths >= 1 and positive finite rates (0: no rate serves), got {p}")
        grid = {(p.input_tokens, p.output_tokens) for p in self.points}
        if len(grid) != len(self.points) or len(grid) != len(self.inputs) * len(self.outputs):
            raise ValueError("a capacity profile's points must cover each input length with each output length once")

    @property
    def inputs(self) -> tuple[int, ...]:
        return tuple(sorted({p.input_tokens for p in self.points}))

    @property
    def outputs(self) -> tuple[int, ...]:
        return tuple(sorted({p.output_tokens for p in self.points}))

    def at(self, input_tokens: float, output_tokens: float) -> CapacityPoint:
        """One worker's capacity at this mix, interpolated (log-linear) on the grid, and
        never more than measured for lengths outside it (module docstring). Next to a
        mix no rate serves (0 req/s) a role gets its least measured capacity and the
        point says so in ``infeasible`` (the SLOs are not attainable there)."""
        ins, outs = self.inputs, self.outputs
        i, o = min(max(input_tokens, ins[0]), ins[-1]), min(max(output_tokens, outs[0]), outs[-1])
        # beyond the grid's long edge a worker carries no more tokens/s than at the edge
        scale = i / max(input_tokens, i) * o / max(output_tokens, o)
        inner = self._loglinear(i, o)
        if scale >= 1:
            return msgspec.structs.replace(inner, input_tokens=round(input_tokens), output_tokens=round(output_tokens))
        outer = self._loglinear(input_tokens, output_tokens)

        def value(name: str) -> float:
            return min(float(getattr(inner, name)) * scale, float(getattr(outer, name)))

        return CapacityPoint(round(input_tokens), round(output_tokens), value("prefill_rps"), value("decode_rps"),
                             value("aggregated_rps"), infeasible=inner.infeasible or outer.infeasible)  # fmt: skip

    def _loglinear(self, input_tokens: float, output_tokens: float) -> CapacityPoint:
        by = {(p.input_tokens, p.output_tokens): p for p in self.points}
        (i0, i1, wi), (o0, o1, wo) = _segment(self.inputs, input_tokens), _segment(self.outputs, output_tokens)
        near = [by[(i, o)] for i in {i0, i1 if wi else i0} for o in {o0, o1 if wo else o0}]
        zero = [p for p in near if not min(p.prefill_rps, p.decode_rps, p.aggregated_rps)]
        why = (zero[0].infeasible or "no rate meets the SLOs") if zero else ""

        def value(name: str) -> float:
            least = min((v for p in self.points if (v := float(getattr(p, name))) > 0), default=1e-3)
            if any(not getattr(p, name) for p in near):
                return least

            def g(i: int, o: int) -> float:  # an infeasible corner here has no weight
                return math.log(max(float(getattr(by[(i, o)], name)), least))

            low = g(i0, o0) * (1 - wo) + g(i0, o1) * wo
            high = g(i1, o0) * (1 - wo) + g(i1, o1) * wo
            return math.exp(low * (1 - wi) + high * wi)

        return CapacityPoint(round(input_tokens), round(output_tokens), value("prefill_rps"), value("decode_rps"),
                             value("aggregated_rps"), infeasible=why)  # fmt: skip


def _segment(axis: Sequence[int], v: float) -> tuple[int, int, float]:
    """The grid segment for ``v`` and its weight along it (log scale; beyond the long
    edge the edge segment, extrapolated at most one segment's length)."""
    if len(axis) == 1:
        return axis[0], axis[0], 0.0
    i = 0
    while i < len(axis) - 2 and v > axis[i + 1]:
        i += 1
    a, b = axis[i], axis[i + 1]
    w = (math.log(max(v, 1.0)) - math.log(a)) / (math.log(b) - math.log(a))
    return a, b, min(max(w, -1.0), 2.0)


def load_profile(path: str | Path) -> CapacityProfile:
    """Read a profile (at most 1 MiB); ValueError saying what is wrong with it."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read the capacity profile {p}: {exc.strerror or exc}") from None
    if len(data) > MAX_PROFILE_BYTES:
        raise ValueError(f"the capacity profile {p} is larger than {MAX_PROFILE_BYTES} bytes")
    try:
        return msgspec.json.decode(data, type=CapacityProfile)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"the capacity profile {p} is not valid: {exc}") from None


def dump_profile(profile: CapacityProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


@dataclass(frozen=True, slots=True)
class Sizing:
    """Workers the forecast needs per role (each at least 1), and the capacity used
    (``capacity.infeasible``: the profile says no fleet meets the SLOs at this mix)."""

    prefill: int
    decode: int
    aggregated: int
    capacity: CapacityPoint

    @property
    def attainable(self) -> bool:
        return not self.capacity.infeasible


def size_fleet(profile: CapacityProfile, forecast: LoadForecast, headroom: float = 0.85) -> Sizing:
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be within (0, 1], got {headroom}")
    cap = profile.at(max(forecast.input_tokens, 1.0), max(forecast.output_tokens, 1.0))

    def need(rps: float) -> int:
        return max(1, math.ceil(forecast.rate_rps / (rps * headroom) - 1e-9))

    return Sizing(need(cap.prefill_rps), need(cap.decode_rps), need(cap.aggregated_rps), cap)
