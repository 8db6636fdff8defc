"""gRPC aio interceptors that trace every RPC, on OpenTelemetry's and grpc.aio's public APIs.

Private to :mod:`switchyard.common.telemetry`, whose ``server_interceptors`` and
``client_interceptors`` are the factories.

Spans follow the OpenTelemetry semantic conventions for RPC (gRPC):

- name ``{rpc.service}/{rpc.method}`` (``agent.AgentService/RunTask``), kind
  SERVER or CLIENT, attributes ``rpc.system`` ``grpc``, ``rpc.service``,
  ``rpc.method``, ``rpc.grpc.status_code``, and ``server.address`` /
  ``server.port`` on the client side;
- status: a client span is ERROR for every non-OK code; a server span only for
  UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE and DATA_LOSS
  (:data:`~switchyard.common.errors.SERVER_FAULT_CODES`), the codes that say the
  server failed rather than the caller. An exception escaping a servicer is sent
  as UNKNOWN and marks the server span so. A cancelled RPC is recorded as
  CANCELLED, one that ran out of time as DEADLINE_EXCEEDED.
- context: W3C ``traceparent`` metadata, through the globally configured
  propagator; the server span is the current span while the servicer runs.

Why not the stock interceptors of ``opentelemetry-instrumentation-grpc``: they
attach the span's context inside async generators and detach it when the
generator is closed. A cancelled stream's generator is closed later by
asyncio's async-generator finaliser, in another task, so the detach fails
("Failed to detach context": ValueError, the token was created in a different
Context) and the span ends late or never. Here nothing is ever detached across
a ``yield``: a server stream attaches its span once, in the RPC's own task,
whose context ends with it, and both sides end their span from the RPC's done
callback, which grpc runs exactly once whether the RPC finished, failed or was
cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from switchyard import __version__
from switchyard.common.errors import SERVER_FAULT_CODES

RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
_UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")  # probes and grpcurl would flood traces
_pending: set[asyncio.Task[None]] = set()  # client span finishers, kept alive until they run


def _tracer(tracer_provider: Any) -> trace.Tracer:
    return trace.get_tracer("switchyard.grpc", __version__, tracer_provider)


def _traced(method: str) -> bool:
    return not method.startswith(_UNTRACED_PREFIXES)


def _names(method: str) -> tuple[str, dict[str, Any]]:
    """``/pkg.Service/Method`` -> span name and the rpc.* attributes."""
    service, _, name = method.lstrip("/").partition("/")
    return f"{service}/{name}", {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def record_status(span: trace.Span, code: grpc.StatusCode, details: str | None, *, client: bool) -> None:
    """``code`` on an RPC's span (``rpc.grpc.status_code``), and status ERROR for every non-OK code on a client
    span, for a server-fault code only on a server span; also what the dispatcher writes on each request's
    ``dispatcher.generate`` span (a SERVER span per request of a GenerateStream, which no interceptor ends)."""
    span.set_attribute(RPC_GRPC_STATUS_CODE, code.value[0])
    if code != grpc.StatusCode.OK and (client or code in SERVER_FAULT_CODES):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))


# --------------------------------------------------------------------------- server


class _ServerRpc:
    """One traced server RPC: its span, ended once with the code the caller receives."""

    def __init__(self, tracer: trace.Tracer, method: str, context: grpc.aio.ServicerContext) -> None:
        name, attributes = _names(method)
        parent = propagate.extract(dict(context.invocation_metadata() or ()))
        self.span = tracer.start_span(name, parent, SpanKind.SERVER, attributes)
        self.context = trace.set_span_in_context(self.span, parent)
        self._servicer_context = context
        self._ended = False
        # grpc runs done callbacks when the RPC terminates. Before the servicer has finished, that
        # means the caller went away (cancel, deadline, lost connection); it also ends the span of
        # a stream whose generator no one closes.
        context.add_done_callback(lambda _: self.end(asyncio.CancelledError()))

    def attach(self) -> object:
        return otel_context.attach(self.context)

    def end(self, exc: BaseException | None = None) -> None:
        """End the span with the RPC's code: from the servicer context, ``exc`` or the cancellation."""
        if self._ended:
            return
        self._ended = True
        context = self._servicer_context
        details: str | None = None
        if isinstance(exc, asyncio.CancelledError) or context.cancelled():
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        elif exc is not None and not isinstance(exc, (grpc.aio.AbortError, GeneratorExit)):
            code, details = grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"  # what grpc sends
            self.span.record_exception(exc)
        else:
            code, details = context.code() or grpc.StatusCode.OK, context.details()
        record_status(self.span, code, details if isinstance(details, str) else None, client=False)
        self.span.end()


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per unary-unary and unary-stream RPC (the kinds Switchyard serves)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not _traced(method) or handler.request_streaming:
            return handler
        tracer = self._tracer
        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                rpc = _ServerRpc(tracer, method, context)
                token = rpc.attach()
                try:
                    response = await behavior(request, context)
                except BaseException as exc:
                    rpc.end(exc)
                    raise
                finally:
                    otel_context.detach(token)
                rpc.end()
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        behavior_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            rpc = _ServerRpc(tracer, method, context)
            # grpc.aio runs each RPC in a task of its own, with a context of its own: the span stays
            # attached there for the servicer's whole run and is never detached, since the context
            # ends with the task (a detach from asyncio's generator finaliser, in another task, fails).
            otel_context.attach(rpc.context)
            try:
                async for response in behavior_stream(request, context):
                    yield response
            except BaseException as exc:
                rpc.end(exc)
                raise
            rpc.end()

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)


# --------------------------------------------------------------------------- client


class _ClientSpans:
    """One CLIENT span per call, child of the current span; ``traceparent`` sent in the metadata."""

    def __init__(self, tracer: trace.Tracer, target: str) -> None:
        self._tracer = tracer
        self._server: dict[str, Any] = {}
        host, _, port = target.rpartition(":")
        if host and port.isdigit() and "," not in target and "///" not in target:
            self._server = {"server.address": host.strip("[]"), "server.port": int(port)}

    async def _intercept(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if not _traced(method):
            return await continuation(details, request)
        name, attributes = _names(method)
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes={**attributes, **self._server})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
        details = grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )
        try:
            call = await continuation(details, request)
        except grpc.aio.AioRpcError as exc:
            record_status(span, exc.code(), exc.details(), client=True)
            span.end()
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.end()
            raise
        call.add_done_callback(lambda done: _finish_later(span, done))
        return call



# grpc.aio files an interceptor under the first call kind it subclasses, so one class per kind.
class _UnaryUnaryClient(_ClientSpans, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[override]
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStreamClient(_ClientSpans, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[override]
        return await self._intercept(continuation, client_call_details, request)


def _finish_later(span: trace.Span, call: grpc.aio.Call) -> None:
    """A done callback cannot await ``call.code()``; the (already known) status is read in a task."""

    async def finish() -> None:
        try:
            code, details = await call.code(), await call.details()
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "cancelled"
        record_status(span, code, details, client=True)
        span.end()

    try:
        task = asyncio.get_running_loop().create_task(finish())
    except RuntimeError:  # no loop any more (interpreter shutdown): end without a code
        span.end()
        return
    _pending.add(task)
    task.add_done_callback(_pending.discard)


# --------------------------------------------------------------------------- factories


def server_interceptor(tracer_provider: Any = None) -> grpc.aio.ServerInterceptor:
    """The server interceptor on ``tracer_provider`` (None: the global one); health and reflection untraced."""
    return _ServerInterceptor(_tracer(tracer_provider))


def client_interceptors(tracer_provider: Any = None, target: str = "") -> list[grpc.aio.ClientInterceptor]:
    """The client interceptor (unary-unary and unary-stream calls) on ``tracer_provider``."""
    tracer = _tracer(tracer_provider)
    return [_UnaryUnaryClient(tracer, target), _UnaryStreamClient(tracer, target)]
