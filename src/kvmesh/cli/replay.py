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
    """The ``replay`` subcommand's arguments: the trace, then every setting declared once
    (:class:`~kvmesh.replay.settings.ReplaySettings`: the replay's own and those it shares
    with the live system; the mocker workers' :class:`~kvmesh.engines.settings.MockerSettings`)."""
    from kvmesh.engines.settings import MockerSettings
    from kvmesh.replay.settings import ReplaySettings
    from kvmesh.settings import add_flags

    p.add_argument("trace", help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)")
    add_flags(p, ReplaySettings)
    add_flags(p, MockerSettings, exclude=("fault",))  # the same declarations as `kvmesh run --engine mocker`


def _config(ns: argparse.Namespace) -> ReplayConfig:
    from dataclasses import replace

    from kvmesh.engines.mocker.options import MockerOptions
    from kvmesh.engines.settings import MockerSettings
    from kvmesh.replay.runner import ReplayConfig
    from kvmesh.settings import resolve

    config = resolve(ReplayConfig, ns)
    mocker = MockerOptions.from_settings(resolve(MockerSettings, ns), block_size=config.block_size)
    return replace(config, mocker=mocker)


def run_replay(ns: argparse.Namespace) -> int:
    """Run ``kvmesh replay`` with parsed arguments; returns the exit status."""
    try:
        config = _config(ns)
    except ValueError as exc:
        return fail(str(exc), 2)
    if config.profile_capacity:
        from kvmesh.cli.replay_arms import run_profile

        return run_profile(ns.trace, config)
    if config.arms:
        from kvmesh.cli.replay_arms import run_arms

        return run_arms(ns.trace, config)
    from kvmesh.replay.plot import MATPLOTLIB_HINT, have_matplotlib, plot_ttft_cdf
    from kvmesh.replay.report import format_table, summarize
    from kvmesh.replay.runner import replay_policy

    trace = read_trace(ns.trace, config)
    if isinstance(trace, int):
        return trace
    plot = config.plot
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
            with _progress(name, len(trace), config.no_progress) as tick:
                records = replay_policy(name, trace, config, tick)
        except ValueError as exc:
            return fail(str(exc), 2)
        results.append(summarize(name, records))
        print(f"  {name}: replayed in {time.perf_counter() - start:.1f} s wall")
    print(format_table(results))
    status = write_json(config.json, results)
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
