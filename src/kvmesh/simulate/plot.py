"""The simulated day as a picture: SLO attainment and capacity lost, hour by hour
(matplotlib, optional: imported only here)."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_day"]


def plot_day(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = list(range(len(report["slo_attainment_by_hour"])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(hours, [100 * a for a in report["slo_attainment_by_hour"]], marker="o")
    top.axhline(99.9, color="grey", linestyle="--", linewidth=1)
    top.set_ylabel("SLO attainment %")
    c = report["config"]
    top.set_title(f"{c['workers']:,} groups x TP{c['tp']}, failure scale {c['failure_scale']:g}: lost {report['lost']}")
    bottom.bar(hours, [100 * x for x in report["capacity_lost_by_hour"]])
    bottom.set_ylabel("capacity lost %")
    bottom.set_xlabel("hour")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
