"""The simulated day as a table and as JSON (the same figures; lost requests under
``lost``). Pure: an :class:`~kvmesh.simulate.fleet.Outcome` in, text or a dict out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.simulate.fleet import Outcome, SimConfig

__all__ = ["summary", "render"]


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _times(samples: dict[str, list[float]]) -> dict[str, dict[str, float | int | None]]:
    return {kind: {"n": len(v), "p50_s": _quantile(v, 0.5), "p99_s": _quantile(v, 0.99)} for kind, v in sorted(samples.items())}


def summary(config: SimConfig, out: Outcome, wall_s: float) -> dict[str, Any]:
    """Every figure of the report (what ``--json`` writes)."""
    attainment = [met / total if total else 1.0 for met, total in zip(out.slo_met, out.slo_total)]
    total = sum(out.slo_total)
    return {
        "config": {"workers": config.workers, "tp": config.tp, "gpus": config.workers * config.tp, "hours": config.hours,
                   "seed": config.seed, "failure_scale": config.failure_scale, "hot_spares": config.spares,
                   "canary_interval_s": config.canary_interval_s, "request_plane": config.request_plane},  # fmt: skip
        "requests": {"arrived": out.arrived, "served": out.served, "shed": {k: round(v) for k, v in sorted(out.shed.items())}},
        "lost": sum(out.lost.values()),
        "lost_by_cause": dict(sorted(out.lost.items())),
        "faults": dict(sorted(out.faults.items())),
        "corrupted_tokens": {k: round(v) for k, v in sorted(out.corrupted_tokens.items())},
        "corruption_bound_tokens": {k: round(v) for k, v in sorted(out.corruption_bound_tokens.items())},
        "undetected_at_end": dict(sorted(out.undetected.items())),
        "time_to_detect": _times(out.detect_s),
        "time_to_recover": _times(out.recover_s),
        "migrations": dict(sorted(out.migrations.items())),
        "slo_attainment": sum(out.slo_met) / total if total else 1.0,
        "slo_attainment_by_hour": [round(a, 6) for a in attainment],
        "capacity_lost_by_hour": [round(c, 6) for c in out.capacity_lost],
        "planner_actions": dict(sorted(out.planner_actions.items())),
        "degradation_seconds": {f"level_{k}": v for k, v in sorted(out.level_s.items())},
        "events": out.events,
        "wall_s": round(wall_s, 2),
        "events_per_s": round(out.events / wall_s, 1) if wall_s > 0 else None,
    }


def _fmt_times(times: dict[str, dict[str, float | int | None]]) -> str:
    parts = []
    for kind, t in times.items():
        p50, p99 = t["p50_s"], t["p99_s"]
        parts.append(f"{kind} n={t['n']} p50 {p50:.1f} s p99 {p99:.1f} s" if p50 is not None and p99 is not None else kind)
    return "; ".join(parts) or "-"


def render(s: dict[str, Any]) -> str:
    """The report as the CLI prints it."""
    c, r = s["config"], s["requests"]
    hours = s["slo_attainment_by_hour"]
    worst = min(range(len(hours)), key=hours.__getitem__) if hours else 0
    rows = [
        ("fleet", f"{c['workers']:,} groups × TP{c['tp']} = {c['gpus']:,} GPUs, {c['hours']:g} h, "
                  f"failure scale {c['failure_scale']:g}, {c['hot_spares']} hot spares, seed {c['seed']}"),
        ("requests", f"{r['arrived']:,} arrived, {r['served']:,} served, shed {sum(r['shed'].values()):,} "
                     f"{r['shed'] or ''}".rstrip()),
        ("lost", f"{s['lost']:,} {s['lost_by_cause'] or ''}".rstrip()),
        ("faults", ", ".join(f"{k} {v}" for k, v in s["faults"].items()) or "-"),
        ("corrupted tokens", ", ".join(f"{k} {v:,} (bound {s['corruption_bound_tokens'].get(k, 0):,})"
                                       for k, v in s["corrupted_tokens"].items()) or "0"),
        ("undetected at end", ", ".join(f"{k} {v}" for k, v in s["undetected_at_end"].items()) or "0"),
        ("time to detect", _fmt_times(s["time_to_detect"])),
        ("time to recover", _fmt_times(s["time_to_recover"])),
        ("migrations", ", ".join(f"{k} {v:,}" for k, v in s["migrations"].items()) or "0"),
        ("SLO attainment", f"{s['slo_attainment']:.5%} (worst hour {worst}: {hours[worst]:.4%})" if hours else "-"),
        ("capacity lost", f"max hourly {max(s['capacity_lost_by_hour'], default=0):.4%} of the fleet"),
        ("planner", ", ".join(f"{k} {v}" for k, v in s["planner_actions"].items()) or "-"),
        ("degradation", ", ".join(f"{k} {v:,.0f} s" for k, v in s["degradation_seconds"].items())),
        ("cost", f"{s['events']:,} events in {s['wall_s']} s wall ({s['events_per_s']} events/s)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
