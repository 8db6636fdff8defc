"""A real OTLP/gRPC trace receiver for tests: the collector's TraceService on 127.0.0.1:0.

Processes under test export to it with ``OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint``
exactly as they would to Jaeger or an OpenTelemetry Collector. It runs a
thread-pool gRPC server, so sync and async tests can use it alike::

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        ...
        spans = receiver.wait_for(lambda spans: any(s.name == "engine.decode" for s in spans))
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened. Ids are lowercase hex ("" for no parent)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    """(trace_id, span_id) of each linked span."""
    link_attributes: tuple[dict[str, Any], ...]
    status_code: int
    """0 unset, 1 ok, 2 error (opentelemetry.proto.trace.v1.Status.StatusCode)."""
    events: tuple[str, ...]
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def is_error(self) -> bool:
        return self.status_code == trace_pb2.Status.STATUS_CODE_ERROR


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of an export request, with its resource's ``service.name``."""
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        service=service,
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes=_attributes(span.attributes),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        link_attributes=tuple(_attributes(link.attributes) for link in span.links),
                        status_code=span.status.code,
                        events=tuple(event.name for event in span.events),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        resource=resource,
                    )
                )
    return out


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver") -> None:
        self._receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext):  # noqa: N802
        self._receiver._add(flatten(request))
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """In-process OTLP/gRPC trace receiver on ``127.0.0.1`` (port 0 by default).

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``, the value for ``OTEL_EXPORTER_OTLP_ENDPOINT``
            (the ``http`` scheme makes the exporter use a plaintext channel).
    """

    def __init__(self, port: int = 0) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        if self.port == 0:
            raise RuntimeError(f"OTLP receiver could not bind 127.0.0.1:{port}")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        """A copy of every span received so far, in arrival order."""
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Block until ``done(spans)`` is true; return the spans.

        Raises:
            TimeoutError: not true within ``timeout_s``; the message lists the span names received.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{s.service}:{s.name}" for s in self._spans})
                    raise TimeoutError(f"OTLP receiver: condition not met in {timeout_s} s; received {names}")
                self._cond.wait(left)
            return list(self._spans)


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    """Spans grouped by span name."""
    groups: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        groups.setdefault(span.name, []).append(span)
    return groups


__all__ = ["OtlpReceiver", "ReceivedSpan", "by_name", "flatten"]
