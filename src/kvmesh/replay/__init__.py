"""Trace replay: how much KV-aware routing gains on a real request trace.

Loads a Mooncake-format trace (:mod:`.trace`), synthesizes token ids that share the
prefixes the trace's hash ids say they share, replays the requests against N mocker
workers under each routing policy (:mod:`.policies`) on the virtual clock
(:mod:`.sim`, default) or the real one (:mod:`.realtime`), and summarizes TTFT, ITL,
prefix-cache hit rate and throughput per policy (:mod:`.report`, :mod:`.plot`).
``kvmesh replay`` (:mod:`kvmesh.cli.replay`) is the command line.

The names below are imported on first use: every ``kvmesh`` command builds the
``replay`` parser from :mod:`.settings`, and importing this package must not load the
mocker, numpy and the grammar engine into each of them (issue 36).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.lazy import lazy_names

if TYPE_CHECKING:
    from kvmesh.replay.policies import POLICIES, make_policy
    from kvmesh.replay.report import JSON_FIELDS, PolicyResult, format_table, summarize
    from kvmesh.replay.runner import CLOCKS, ReplayConfig, replay, replay_policy
    from kvmesh.replay.sim import fleet_options, simulate
    from kvmesh.replay.trace import TRACE_BLOCK_TOKENS, TokenSynth, TraceError, TraceRequest, arrivals, load_trace

__all__ = [
    "CLOCKS",
    "JSON_FIELDS",
    "POLICIES",
    "TRACE_BLOCK_TOKENS",
    "PolicyResult",
    "ReplayConfig",
    "TokenSynth",
    "TraceError",
    "TraceRequest",
    "arrivals",
    "format_table",
    "load_trace",
    "make_policy",
    "replay",
    "replay_policy",
    "fleet_options",
    "simulate",
    "summarize",
]

_HOME = {
    "policies": ("POLICIES", "make_policy"),
    "report": ("JSON_FIELDS", "PolicyResult", "format_table", "summarize"),
    "runner": ("CLOCKS", "ReplayConfig", "replay", "replay_policy"),
    "sim": ("fleet_options", "simulate"),
    "trace": ("TRACE_BLOCK_TOKENS", "TokenSynth", "TraceError", "TraceRequest", "arrivals", "load_trace"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


__getattr__ = lazy_names(__name__, _MODULE_OF)  # one of ``__all__``, from its module (imported now, once)
