"""TTFT CDF plot of a replay, with matplotlib when it is installed (it is optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
    mean ITL, with the SLOs as vertical lines. Raises ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(12, 4.5))
    try:
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
