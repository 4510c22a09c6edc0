"""TTFT CDF plot of a replay, with matplotlib when it is installed (it is optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvmesh.replay.report import PolicyResult

__all__ = ["MATPLOTLIB_HINT", "have_matplotlib", "plot_ttft_cdf"]

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
