"""OpenTelemetry spans recorded with the SDK's in-memory exporter: the tree of one
request (HTTP → route → request plane → engine.generate), the seed's attributes, the
link across a real SIGKILL migration and across a real remote prefill, and the trace id
in headers and logs with tracing off."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.observability import tracing
from tests.helpers import InProcessStack, KvmeshProcess, free_port

pytestmark = pytest.mark.timeout(120)

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_provider(None)


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def _wait_for(cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_one_request_is_one_tree_with_the_seed_attributes(spans: InMemorySpanExporter) -> None:
    async with InProcessStack().running() as stack:
        body = {"model": "kvmesh-tiny", "prompt": "hello", "max_tokens": 6, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=body, headers={"traceparent": CALLER}) as r:
                assert r.status_code == 200
                header = r.headers["traceparent"]
                lines = [line async for line in r.aiter_lines()]
        assert "data: [DONE]" in lines
        await _wait_for(lambda: by_name(list(spans.get_finished_spans()), "POST /v1/completions"))
    got = list(spans.get_finished_spans())
    (root,) = by_name(got, "POST /v1/completions")
    (route,) = by_name(got, "route")
    (hop,) = by_name(got, "request_plane.generate")
    (gen,) = by_name(got, "engine.generate")
    trace_id = int(CALLER[3:35], 16)
    # one trace, continuing the caller's; the header names the root span
    assert {s.context.trace_id for s in got} == {trace_id}
    assert parent_id(root) == int(CALLER[36:52], 16)
    assert header == tracing.format_traceparent(trace_id, root.context.span_id, 1)
    assert parent_id(route) == root.context.span_id and parent_id(hop) == root.context.span_id
    assert parent_id(gen) == hop.context.span_id
    assert route.attributes["worker_id"] == hop.attributes["worker_id"]
    a = gen.attributes
    assert a["model"] == "kvmesh-tiny" and a["input_tokens"] > 0 and a["disagg_role"] == "aggregated"
    assert a["output_tokens"] == 6 and a["finish_reason"] == "length" and a["cancelled"] is False
    assert a["ttft_ms"] >= 0 and a["itl_max_ms"] >= a["itl_p99_ms"] >= a["itl_p50_ms"] >= 0 and a["avg_itl_ms"] >= 0
    assert root.attributes["http.status_code"] == 200


async def test_an_engine_error_marks_the_span_failed(spans: InMemorySpanExporter) -> None:
    from kvmesh.engines.adapter import AbortMonitor, run_generate
    from kvmesh.errors import InvalidArgument
    from kvmesh.protocol import OutputChunk, PreprocessedRequest
    from kvmesh.runtime.context import Context

    class Failing:
        mode = "decode"

        async def generate(self, request: PreprocessedRequest, ctx: Context) -> AsyncIterator[OutputChunk]:
            yield OutputChunk(token_ids=[5])
            raise InvalidArgument("no such thing")

        async def abort(self, ctx: Context) -> None:
            return None

    request = PreprocessedRequest("r", "m", [1, 2, 3], trace_context=CALLER)
    with pytest.raises(InvalidArgument):
        async for _ in run_generate(Failing(), request, Context("r"), AbortMonitor(Failing())):  # type: ignore[arg-type]
            pass
    (gen,) = spans.get_finished_spans()
    assert gen.attributes["error_kind"] == "invalid_argument" and gen.attributes["disagg_role"] == "decode"
    assert gen.status.status_code.name == "ERROR"
    assert gen.attributes["output_tokens"] == 1


async def test_tracing_off_still_gives_a_trace_id_in_header_and_logs() -> None:
    assert not tracing.enabled()
    async with InProcessStack().running() as stack:
        body = {"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 2, "stream": False, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(stack.url + "/v1/completions", json=body, headers={"traceparent": CALLER})
            assert r.status_code == 200
            parsed = tracing.parse_traceparent(r.headers["traceparent"])
            assert parsed is not None and parsed[0] == int(CALLER[3:35], 16)
            # no caller context: a fresh trace per request
            r2 = await client.post(stack.url + "/v1/completions", json=body)
            bad = await client.post(stack.url + "/v1/completions", json={"model": "nope"}, headers={"traceparent": "junk"})
        assert bad.status_code in (400, 404) and tracing.trace_id_of(bad.headers["traceparent"]) != "-"
        assert tracing.trace_id_of(r2.headers["traceparent"]) not in ("-", CALLER[3:35])
    # a malformed header starts a new trace rather than failing the request
    assert tracing.parse_traceparent("00-zz-bad") is None
    # a log line records the trace id of the task it is written in
    record = logging.LogRecord("kvmesh", logging.INFO, __file__, 1, "m", None, None)

    async def in_request() -> None:
        tracing.set_log_trace_id("ab" * 16)
        tracing._filter.filter(record)  # noqa: SLF001

    await asyncio.get_running_loop().create_task(in_request())
    assert record.trace_id == "ab" * 16  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- migration


@contextlib.contextmanager
def _worker_process(tmp_path: Path, port: int) -> Iterator[KvmeshProcess]:
    # its spans go nowhere (it is SIGKILLed before an export); recording them is what stamps the link
    env = {"OTEL_EXPORT_ENABLED": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    proc = KvmeshProcess(tmp_path, "worker", "--static", "--port", str(port), "--speedup", "1", env=env)
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


@pytest.mark.timeout(180)
async def test_sigkill_migration_links_the_next_engine_span(
    spans: InMemorySpanExporter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream on a worker process that is SIGKILLed mid-stream continues on an
    in-process worker; that worker's engine.generate links to the dead one's span."""
    from kvmesh.protocol import InstanceInfo
    from kvmesh.runtime.tcp_client import TcpClient

    port = free_port()
    with _worker_process(tmp_path, port) as victim:
        card = victim.wait_ready()
        async with InProcessStack(speedup=1.0).running() as stack:
            registry = stack.frontend.registry
            entry = registry.models["kvmesh-tiny"]
            survivor = entry.instances.all()[0]
            # only the victim serves at first: detach the in-process worker, then attach it back later
            info = InstanceInfo(card["lease_id"], card["address"], stack.service.config, card.get("model_path", ""))
            await registry.attach(info, TcpClient(card["address"]))
            registry.remove_instance(survivor.worker_id)
            for handler in logging.getLogger().handlers:
                handler.addFilter(tracing._filter)  # noqa: SLF001 - what tracing.setup() installs
            caplog.set_level(logging.INFO, logger="kvmesh.frontend")
            body = {"model": "kvmesh-tiny", "prompt": "tell me", "max_tokens": 60, "ignore_eos": True, "stream": True}
            texts: list[str] = []
            done = False
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            texts.append(line)
                            if len(texts) == 5:  # mid-stream: the survivor back, the victim killed
                                await registry.attach(survivor.info, survivor.client)
                                victim.signal(signal.SIGKILL)
                        assert line != "event: error", line
                        done = done or line == "data: [DONE]"
                    assert done
            await _wait_for(lambda: by_name(list(spans.get_finished_spans()), "POST /v1/completions"))
    got = list(spans.get_finished_spans())
    (root,) = by_name(got, "POST /v1/completions")
    hops = by_name(got, "request_plane.generate")
    assert len(hops) == 2 and hops[0].status.status_code.name == "ERROR"
    (migration,) = by_name(got, "migration")
    assert migration.attributes["method"] == "re_prefill"
    assert migration.attributes["source_worker"] == f"{card['lease_id']:x}"
    (gen,) = by_name(got, "engine.generate")  # the survivor's (the victim's died with it)
    assert parent_id(gen) == hops[1].context.span_id
    (link,) = gen.links
    assert link.context.trace_id == root.context.trace_id
    assert link.context.span_id not in {s.context.span_id for s in got}  # the victim's span, in the dead process
    assert gen.attributes["migration_span_id"] == f"{link.context.span_id:016x}"
    assert gen.attributes["migration_trace_id"] == f"{root.context.trace_id:032x}"
    # the frontend's log line about the move carries the trace id
    moved = [r for r in caplog.records if "moving it" in r.getMessage()]
    assert moved and all(getattr(r, "trace_id", None) == f"{root.context.trace_id:032x}" for r in moved)


# ---------------------------------------------------------------------------- remote prefill


async def test_remote_prefill_is_a_child_and_a_link(spans: InMemorySpanExporter) -> None:
    from kvmesh.engines.adapter import AbortMonitor, run_generate
    from kvmesh.runtime.context import Context
    from tests.integration.test_disagg_inprocess import cluster, request

    req = request("long", 700)
    req.trace_context = CALLER
    async with cluster(prefill_workers=1) as c:
        async for _ in run_generate(c.decode, req, Context("long"), AbortMonitor(c.decode)):
            pass
        assert c.decode.disagg_stats().remote_prefills == 1
    got = list(spans.get_finished_spans())
    gens = by_name(got, "engine.generate")
    (decode,) = [s for s in gens if s.attributes["disagg_role"] == "decode"]
    (prefill,) = [s for s in gens if s.attributes["disagg_role"] == "prefill"]
    (remote,) = by_name(got, "remote_prefill")
    assert parent_id(decode) == int(CALLER[36:52], 16)
    assert parent_id(remote) == decode.context.span_id and parent_id(prefill) == remote.context.span_id
    assert prefill.attributes["kv_transfer_bytes"] > 0 and prefill.attributes["queue_wait_ms"] >= 0
    assert remote.attributes["queue_depth"] >= 0 and remote.attributes["wait_ms"] > 0
    (link,) = decode.links
    assert link.context.span_id == prefill.context.span_id
    assert link.attributes["migration_span_id"] == f"{prefill.context.span_id:016x}"
    assert json.dumps(dict(decode.attributes))  # every attribute is a plain value


# ---------------------------------------------------------------------------- NATS request plane


async def test_the_trace_crosses_the_nats_request_plane(spans: InMemorySpanExporter, nats) -> None:  # type: ignore[no-untyped-def]
    """HTTP → request over a NATS subject (response over call-home TCP) → worker: one tree."""
    from kvmesh.config import FrontendConfig, WorkerConfig
    from kvmesh.engines.settings import MockerSettings
    from kvmesh.frontend.app import Frontend
    from kvmesh.frontend.server import bind_http
    from kvmesh.frontend.serving import make_server
    from kvmesh.protocol import InstanceInfo
    from kvmesh.runtime.nats import CallHomeServer, NatsRequestClient, NatsRequestServer, connect_nats
    from kvmesh.worker.main import build_engine
    from kvmesh.worker.service import WorkerService

    lease = 0x7ACE
    worker_nc, caller_nc = await connect_nats(nats.url), await connect_nats(nats.url)
    engine, path = build_engine(WorkerConfig(engine_options=MockerSettings(speedup=1e9)))
    service = WorkerService(engine, NatsRequestServer(worker_nc, "ns", "backend", lease), validate=True)
    config = await service.start()
    home = CallHomeServer()
    client = NatsRequestClient(caller_nc, home, "ns", "backend", lease, connect_timeout=5.0, response_timeout=5.0)
    frontend = Frontend(FrontendConfig(http_port=0, keepalive_s=0.2, canary_interval_s=0))
    await frontend.registry.attach(InstanceInfo(lease, "", config, path, transport="nats"), client)
    sock = bind_http("127.0.0.1", 0)
    server = make_server(frontend.app)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        body = {"model": "kvmesh-tiny", "prompt": "over nats", "max_tokens": 3, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions", json=body)
        assert r.status_code == 200, r.text
    finally:
        server.should_exit = True
        await task
        await service.shutdown(grace_s=2)
        await client.close()
        await home.close()
        await worker_nc.close()
        await caller_nc.close()
    got = list(spans.get_finished_spans())
    (root,) = by_name(got, "POST /v1/completions")
    (hop,) = by_name(got, "request_plane.generate")
    (gen,) = by_name(got, "engine.generate")
    assert hop.attributes["transport"] == "nats"
    assert parent_id(hop) == root.context.span_id and parent_id(gen) == hop.context.span_id
    assert gen.context.trace_id == root.context.trace_id == int(r.headers["traceparent"][3:35], 16)
    assert gen.attributes["output_tokens"] == 3
