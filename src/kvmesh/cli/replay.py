"""``kvmesh replay TRACE``: replay a Mooncake-format trace against N mocker workers
under one or more routing policies and compare TTFT, ITL, cache hits and throughput.

Hook-up (``kvmesh.cli.main``)::

    replay = sub.add_parser("replay", help="...")
    add_replay_args(replay)
    ...
    if ns.command == "replay":
        from kvmesh.cli.replay import run_replay
        return run_replay(ns)

Exit status: 0 done, 1 the trace (or an output file) could not be read/written, 2 a
bad option value; each failure is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.cli.replay_output import PROG, fail, read_trace, write_json

if TYPE_CHECKING:
    from kvmesh.replay.runner import ReplayConfig

__all__ = ["add_replay_args", "main", "run_replay"]


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """The ``replay`` subcommand's arguments (defaults match the mocker's, except the
    512-token blocks of Mooncake traces)."""
    from kvmesh.engines.settings import MockerSettings
    from kvmesh.replay.settings import ReplaySettings
    from kvmesh.settings import add_flags

    p.add_argument("trace", help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)")
    add_flags(p, ReplaySettings)  # --policy, --workers, --clock, --speed; the KV router's section
    w = p.add_argument_group("trace slice")
    w.add_argument("--limit", type=int, default=None, help="replay at most N requests (the earliest of the window)")
    w.add_argument("--start-ms", type=float, default=0.0, help="skip requests before this trace timestamp")
    w.add_argument("--duration-ms", type=float, default=None, help="only requests within this long after --start-ms")
    m = p.add_argument_group("mocker workers")
    m.add_argument("--block-size", type=int, default=512, help="KV block size in tokens (default 512, the trace's)")
    add_flags(p, MockerSettings, exclude=("fault",))  # the same declarations as `kvmesh run --engine mocker`
    a = p.add_argument_group("deployment arms (instead of --policy; the router is --router)")
    a.add_argument("--arms", default=None,
                   help="comma-separated: aggregated, disagg:<P>p<D>d (P + D = --workers), planner[:<P>p<D>d]")  # fmt: skip
    a.add_argument("--router", default="kv", choices=("kv", "kv-approx", "round_robin", "random"),
                   help="the router in front of the (decode) workers of every arm (default kv)")  # fmt: skip
    a.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="TTFT SLO (default 2000)")
    a.add_argument("--slo-itl-ms", type=float, default=35.0, help="mean inter-token latency SLO (default 35)")
    a.add_argument("--kv-bytes-per-token", type=int, default=65536, help="modelled KV per token (default 64 KiB)")
    a.add_argument("--kv-bandwidth", type=float, default=25e9, help="KV transfer link, bytes/s (default 25e9)")
    a.add_argument("--max-local-prefill-length", type=int, default=1000, help="prefill locally up to this many new tokens")
    a.add_argument("--max-prefill-queue-size", type=int, default=2, help="... or while the prefill queue holds this many jobs")
    a.add_argument("--max-prefill-queue-tokens", type=int, default=0, help="... or this many tokens (0: no token bound)")
    a.add_argument("--no-pipeline", action="store_true", help="prefill workers write KV before computing the next job")
    a.add_argument("--planner-interval-s", type=float, default=1.0, help="planner rounds, virtual seconds (default 1)")
    a.add_argument("--planner-window-s", type=float, default=10.0, help="TTFT/ITL window the planner sees (default 10)")
    a.add_argument("--planner-hold-rounds", type=int, default=3, help="rounds a signal must hold (default 3)")
    a.add_argument("--planner-cooldown-s", type=float, default=10.0, help="seconds between role moves (default 10)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", default=None, help="write the per-policy (per-arm) results as a JSON list")
    o.add_argument("--plot", metavar="OUT.png", default=None,
                   help="write a TTFT CDF per policy (with --arms: TTFT and ITL CDFs per arm; needs matplotlib)")  # fmt: skip
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config(ns: argparse.Namespace) -> ReplayConfig:
    from kvmesh.engines.mocker.options import MockerOptions
    from kvmesh.engines.settings import MockerSettings
    from kvmesh.replay.runner import ReplayConfig
    from kvmesh.settings import resolve

    mocker = MockerOptions.from_settings(resolve(MockerSettings, ns), block_size=ns.block_size)
    return resolve(ReplayConfig, ns, given={"mocker": mocker})


def run_replay(ns: argparse.Namespace) -> int:
    """Run ``kvmesh replay`` with parsed arguments; returns the exit status."""
    if getattr(ns, "arms", None):
        from kvmesh.cli.replay_arms import run_arms

        try:
            base = _config(ns)
        except ValueError as exc:
            return fail(str(exc), 2)
        return run_arms(ns, base)
    from kvmesh.replay.plot import MATPLOTLIB_HINT, have_matplotlib, plot_ttft_cdf
    from kvmesh.replay.report import format_table, summarize
    from kvmesh.replay.runner import replay_policy

    try:
        config = _config(ns)
    except ValueError as exc:
        return fail(str(exc), 2)
    trace = read_trace(ns)
    if isinstance(trace, int):
        return trace
    plot = ns.plot
    if plot is not None and not have_matplotlib():
        print(f"{PROG}: {MATPLOTLIB_HINT} (skipping the plot)", file=sys.stderr)
        plot = None
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0
    print(
        f"replaying {len(trace)} requests ({span_s:.1f} s of trace at speed {config.speed:g}) "
        f"on {config.workers} mocker workers, {config.clock} clock"
    )
    results = []
    for name in config.policies:
        start = time.perf_counter()
        try:
            with _progress(name, len(trace), ns.no_progress) as tick:
                records = replay_policy(name, trace, config, tick)
        except ValueError as exc:
            return fail(str(exc), 2)
        results.append(summarize(name, records))
        print(f"  {name}: replayed in {time.perf_counter() - start:.1f} s wall")
    print(format_table(results))
    status = write_json(ns.json, results)
    if status is not None:
        return status
    if plot is not None:
        try:
            plot_ttft_cdf(results, plot, title=f"TTFT CDF: {len(trace)} requests, {config.workers} workers")
        except OSError as exc:
            return fail(f"cannot write {plot}: {exc.strerror or exc}", 1)
        print(f"TTFT CDF written to {plot}")
    return 0


class _progress:
    """A tqdm bar over finished requests (or nothing), as a context manager yielding
    the per-request tick."""

    def __init__(self, name: str, total: int, disabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=name, unit="req", disable=disabled, leave=False, file=sys.stderr)

    def __enter__(self) -> Callable[[], None]:
        bar = self._bar

        def tick() -> None:
            bar.update(1)

        return tick

    def __exit__(self, *exc: object) -> None:
        self._bar.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvmesh.cli.replay`` (the same as ``kvmesh replay``)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Replay a request trace against mocker workers")
    add_replay_args(parser)
    return run_replay(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
