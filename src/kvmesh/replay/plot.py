"""TTFT CDF plot of a replay, with matplotlib when it is installed (it is optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmesh.replay.goodput import ArmResult, Slo
from kvmesh.replay.report import PolicyResult

__all__ = ["MATPLOTLIB_HINT", "have_matplotlib", "plot_arms", "plot_ttft_cdf"]

MATPLOTLIB_HINT = "--plot needs matplotlib: pip install matplotlib"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_ttft_cdf(results: Sequence[PolicyResult], path: str | Path, title: str = "") -> None:
    """Write one CDF curve of TTFT per policy (log-scaled time axis) to ``path``.
    Raises ``ImportError`` without matplotlib (check :func:`have_matplotlib` first)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for r in results:
            xs = r.ttfts_ms
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{r.policy} (p50 {r.ttft_p50_ms:.0f} ms)")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(title or "TTFT CDF per routing policy")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_arms(results: Sequence[ArmResult], path: str | Path, slo: Slo, title: str = "") -> None:
    """Two panels, one curve per deployment arm: the CDF of TTFT and of the per-request
    mean ITL, with the SLOs as vertical lines; with a planner arm, a third: its workers
    over time and the arrival rate it saw and forecast. Raises ``ImportError`` without
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    planned = [r for r in results if r.timeline]
    fig, axes = plt.subplots(1, 3 if planned else 2, figsize=(18 if planned else 12, 4.5))
    ax_ttft, ax_itl = axes[0], axes[1]
    try:
        if planned:
            _plot_timeline(axes[2], planned)
        for r in results:
            label = f"{r.arm} ({r.goodput_rps:.2f} req/s good)"
            for ax, xs in ((ax_ttft, r.ttfts_ms), (ax_itl, r.itls_ms)):
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
        for ax, limit, what in ((ax_ttft, slo.ttft_ms, "time to first token"), (ax_itl, slo.itl_ms, "mean inter-token latency")):
            ax.axvline(limit, color="k", linestyle=":", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlabel(f"{what} (ms, log scale; dotted: SLO)")
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1)
            ax.grid(True, which="both", alpha=0.3)
        ax_itl.legend(loc="lower right", fontsize=8)
        fig.suptitle(title or "deployment arms")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def _plot_timeline(ax: Any, results: Sequence[ArmResult]) -> None:
    """Serving workers per planner arm (steps) and, on a second axis, the arrival rate
    each round saw and the rate the planner forecast (when it had a capacity profile)."""
    rates = ax.twinx()
    for r in results:
        t = [row[0] for row in r.timeline]
        ax.step(t, [row[1] + row[2] + row[3] for row in r.timeline], where="post", label=f"{r.arm} workers")
        rates.plot(t, [row[4] for row in r.timeline], alpha=0.3, linewidth=0.8, label=f"{r.arm} arrivals/s")
        if any(row[5] > 0 for row in r.timeline):
            rates.plot(t, [row[5] for row in r.timeline], linestyle="--", linewidth=1, label=f"{r.arm} forecast/s")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("serving workers")
    rates.set_ylabel("requests/s")
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()
    more = rates.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=7)
