"""W3C trace context helpers (tracing off: no OpenTelemetry import needed)."""

from __future__ import annotations

import sys

from hypothesis import given
from hypothesis import strategies as st

from kvmesh.observability import tracing

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_parse_a_good_traceparent() -> None:
    assert tracing.parse_traceparent(GOOD) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert tracing.format_traceparent(*tracing.parse_traceparent(GOOD)) == GOOD  # type: ignore[misc]


def test_bad_traceparents_start_a_new_trace() -> None:
    bad = [
        None, "", GOOD[:-1], GOOD + "0", "01" + GOOD[2:], GOOD.replace("-", "_"), "00-" + "0" * 32 + GOOD[35:],
        GOOD[:36] + "0" * 16 + GOOD[52:], GOOD[:3] + "g" * 32 + GOOD[35:], GOOD[:10] + "\n" + GOOD[11:],
    ]  # fmt: skip
    for value in bad:
        assert tracing.parse_traceparent(value) is None, value
        fresh = tracing.new_trace(value)
        assert tracing.parse_traceparent(fresh) is not None
        assert fresh[3:35] != GOOD[3:35]


def test_new_trace_continues_the_callers_trace_with_a_new_span() -> None:
    out = tracing.new_trace(GOOD)
    assert out[3:35] == GOOD[3:35] and out[36:52] != GOOD[36:52] and out.endswith("-01")
    assert tracing.new_trace(None)[3:35] != tracing.new_trace(None)[3:35]


@given(st.text(max_size=80))
def test_a_log_line_never_carries_what_a_peer_made_up(value: str) -> None:
    got = tracing.trace_id_of(value)
    assert got == "-" or (len(got) == 32 and got.isalnum() and got.isascii())
    assert tracing.parse_traceparent(value) is None or len(value) == 55


def test_links() -> None:
    link = "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"
    assert tracing.parse_link(link) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    for bad in (None, "", link[:-1], link.replace("-", ":"), "0" * 32 + "-" + "0" * 16, "x" * 49):
        assert tracing.parse_link(bad) is None


def test_tracing_off_imports_no_opentelemetry() -> None:
    import subprocess

    code = "import kvmesh.frontend.app, kvmesh.worker.service, sys; print(any(m.startswith('opentelemetry') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
