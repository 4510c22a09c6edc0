"""A small OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` (decoded with the OpenTelemetry proto package); the spans
are kept in memory with their service name."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    links: list[tuple[str, str]] = field(default_factory=list)


def _value(v) -> object:  # type: ignore[no-untyped-def]
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("content-length", "0"))
                if self.path != "/v1/traces" or not 0 <= length <= MAX_BODY:
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(length))
                receiver._add(request)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                            {a.key: _value(a.value) for a in s.attributes},
                            [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        )
                    )  # fmt: skip
        with self.lock:
            self.spans.extend(got)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
