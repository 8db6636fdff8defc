"""gRPC aio interceptors for tracing: opentelemetry-instrumentation-grpc's, with the
server-fault rule for span status on both sides.

Private to :mod:`switchyard.common.telemetry`, whose ``server_interceptors`` and
``client_interceptors`` are the public factories.

The rule, after the instrumentation's own server side: only the codes in
:data:`~switchyard.common.errors.SERVER_FAULT_CODES` mark a span ERROR. The stock
aio client interceptors mark every non-OK code (their ``add_error_details_to_span``
and unary done callback), and the stock aio server interceptor leaves an
exception that escapes the servicer, which the caller receives as UNKNOWN,
unmarked. The subclasses below override exactly those two places.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import _aio_client, _aio_server
from opentelemetry.instrumentation.grpc import filters as grpc_filters
from opentelemetry.instrumentation.grpc.version import __version__ as _instrumentation_version
from opentelemetry.trace import Status, StatusCode

from switchyard.common.errors import SERVER_FAULT_CODES

RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
"""Attribute name from the OpenTelemetry semantic conventions for RPC spans."""
_INSTRUMENTATION_NAME = "opentelemetry.instrumentation.grpc"
_SCHEMA_URL = "https://opentelemetry.io/schemas/1.11.0"


def _traced_rpcs() -> Callable[[Any], bool]:
    """Filter: every RPC except health checks and reflection (probes and grpcurl would flood traces)."""
    return grpc_filters.negate(
        grpc_filters.any_of(
            grpc_filters.service_prefix("grpc.health."),
            grpc_filters.service_prefix("grpc.reflection."),
        )
    )


def _tracer(tracer_provider: Any) -> trace.Tracer:
    return trace.get_tracer(_INSTRUMENTATION_NAME, _instrumentation_version, tracer_provider, schema_url=_SCHEMA_URL)


def _record_code(span: trace.Span, code: grpc.StatusCode, details: str | None) -> None:
    """Record ``code`` on ``span``; mark the span ERROR only for a server-fault code."""
    span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
    if code in SERVER_FAULT_CODES:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))


class _ServerFaultStatus(_aio_client._BaseAioClientInterceptor):
    """Client-side status rule: only server-fault codes mark the span ERROR."""

    @staticmethod
    def add_error_details_to_span(span: trace.Span, exc: BaseException) -> None:
        if isinstance(exc, grpc.RpcError):
            _record_code(span, exc.code(), exc.details())
            if exc.code() in SERVER_FAULT_CODES:
                span.record_exception(exc)
            return
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.record_exception(exc)

    async def _wrap_unary_response(self, continuation: Callable[[], Awaitable[Any]], span: trace.Span) -> Any:
        try:
            call = await continuation()
            code = await call.code()
            details = await call.details()
        except grpc.aio.AioRpcError as exc:
            self.add_error_details_to_span(span, exc)
            span.end()
            raise
        _record_code(span, code, details)
        self._call_response_hook(span, details)
        span.end()
        return call


class _UnaryUnaryClient(_ServerFaultStatus, _aio_client.UnaryUnaryAioClientInterceptor):
    pass


class _UnaryStreamClient(_ServerFaultStatus, _aio_client.UnaryStreamAioClientInterceptor):
    pass


class _StreamUnaryClient(_ServerFaultStatus, _aio_client.StreamUnaryAioClientInterceptor):
    pass


class _StreamStreamClient(_ServerFaultStatus, _aio_client.StreamStreamAioClientInterceptor):
    pass


def _mark_uncaught(exc: BaseException) -> None:
    """An exception that escapes a servicer (not ``context.abort``) reaches the caller as UNKNOWN."""
    if isinstance(exc, grpc.aio.AbortError):
        return  # the context wrapper already recorded the aborted code
    _record_code(trace.get_current_span(), grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")


class _Server(_aio_server.OpenTelemetryAioServerInterceptor):
    """The stock aio server interceptor, plus: an uncaught exception marks the span ERROR (UNKNOWN)."""

    def _intercept_aio_server_unary(self, behavior: Callable[..., Awaitable[Any]], handler_call_details: Any) -> Any:
        async def marked(request: Any, context: Any) -> Any:
            try:
                return await behavior(request, context)
            except Exception as exc:
                _mark_uncaught(exc)
                raise

        return super()._intercept_aio_server_unary(marked, handler_call_details)

    def _intercept_aio_server_stream(self, behavior: Callable[..., AsyncIterator[Any]], handler_call_details: Any) -> Any:
        async def marked(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for response in behavior(request, context):
                    yield response
            except Exception as exc:
                _mark_uncaught(exc)
                raise

        return super()._intercept_aio_server_stream(marked, handler_call_details)


def server_interceptor(tracer_provider: Any = None) -> grpc.aio.ServerInterceptor:
    """The aio server interceptor on ``tracer_provider`` (None: the global one); health and reflection untraced."""
    return _Server(_tracer(tracer_provider), filter_=_traced_rpcs())


def client_interceptors(tracer_provider: Any = None) -> list[grpc.aio.ClientInterceptor]:
    """The four aio client interceptors (unary/stream x unary/stream) on ``tracer_provider``."""
    tracer, filter_ = _tracer(tracer_provider), _traced_rpcs()
    return [cls(tracer, filter_=filter_) for cls in (_UnaryUnaryClient, _UnaryStreamClient, _StreamUnaryClient, _StreamStreamClient)]
