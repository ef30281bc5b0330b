"""A real OTLP/HTTP trace receiver on loopback, for the tracing tests.

It is what a collector is to the gateway's exporter: an HTTP server that takes ``POST /v1/traces`` with a
protobuf ``ExportTraceServiceRequest`` body (gzip or deflate when the exporter compresses), decodes it with the
opentelemetry-proto package and answers ``ExportTraceServiceResponse``. The tests read the spans it received.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

SPAN_KINDS = {Span.SPAN_KIND_SERVER: "server", Span.SPAN_KIND_CLIENT: "client", Span.SPAN_KIND_INTERNAL: "internal"}


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]  # (name, time)
    error: bool
    resource: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # of the export request that carried it


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


def attributes_of(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs}


class OTLPReceiver:
    """``ThreadingHTTPServer`` on 127.0.0.1 with a kernel-chosen port; ``url`` is the traces endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                receiver.take(ExportTraceServiceRequest.FromString(body), dict(self.headers.items()))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The base URL (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``server.tracing.endpoint``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = attributes_of(list(resource_spans.resource.attributes))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=SPAN_KINDS.get(span.kind, str(span.kind)),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes=attributes_of(list(span.attributes)),
                            events=[(event.name, event.time_unix_nano) for event in span.events],
                            error=span.status.code == Status.STATUS_CODE_ERROR,
                            resource=resource,
                            headers=headers,
                        )
                    )
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> OTLPReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
