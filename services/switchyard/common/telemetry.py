"""Tracing set-up shared by the three services: OpenTelemetry, OTLP over gRPC.

Configured only from the standard ``OTEL_*`` environment variables (see
:mod:`switchyard.common.envs`):

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``):
  where the OTLP gRPC exporter sends spans, e.g. ``http://127.0.0.1:4317``
  (Jaeger all-in-one). Unset means tracing is off.
- ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: tracing off.
- ``OTEL_SERVICE_NAME``: the resource ``service.name`` (default: the service's
  own name: orchestrator, retrieval, dispatcher). Leave it unset for
  ``switchyard up``, which passes its environment to all three processes.
  Other resource attributes come from ``OTEL_RESOURCE_ATTRIBUTES``.
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: read by the SDK
  (default ``parentbased_always_on``).

A value the SDK would ignore with a warning (an unknown sampler, a ratio out of
0-1, an exporter or protocol other than OTLP over gRPC) or crash on is refused
at start-up by name (:func:`check_tracing_environment`).

Tracing off installs nothing: no tracer provider (``trace.get_tracer`` hands
out the API's no-op tracer), no interceptors, no exporter thread.

Trace context crosses gRPC as W3C ``traceparent`` metadata through the
interceptors of :mod:`switchyard.common.grpc_tracing` (public OpenTelemetry
and grpc.aio APIs only), so a traceparent sent by a client becomes the parent
of the task's server span. RPC span status follows the semantic conventions:
a client span is an error for every non-OK code, a server span only for a
server-fault code (:data:`~switchyard.common.errors.SERVER_FAULT_CODES`); a
caller's mistake (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED...) is
recorded as ``rpc.grpc.status_code`` only on the server. Stage spans follow
the server rule: an exception escaping ``tracer.start_as_current_span(...)``
marks ERROR only when it maps to a server-fault code (:func:`make_tracer_provider`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import threading
import urllib.parse
from typing import Any, Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from switchyard import __version__
from switchyard.common import grpc_tracing
from switchyard.common.envs import read_standard, read_standard_named
from switchyard.common.errors import SERVER_FAULT_CODES, status_for

log = logging.getLogger(__name__)

_lock = threading.Lock()
_provider: Any = None  # the SDK TracerProvider once setup_tracing turned tracing on
_shutdown: Callable[[], None] | None = None


def _noop() -> None:
    return None


class _NoSpan(contextlib.ContextDecorator):
    """What a stage span costs while tracing is off: entering yields the API's invalid span."""

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> bool:
        return False


_NO_SPAN = _NoSpan()


def _tracing_off() -> bool:
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


class StageTracer:
    """The tracer the services use for their stage spans.

    It delegates to ``opentelemetry.trace.get_tracer(name)`` once a tracer
    provider is installed (by :func:`setup_tracing` or anyone else); until
    then it skips span creation and context switching altogether. The API's
    own no-op tracer costs about 5 us a span (measured:
    ``tools/tracing_overhead.py``); this check costs a few hundred ns, so
    tracing off costs nothing measurable.
    """

    def __init__(self, name: str) -> None:
        self._inner = trace.get_tracer(name)

    def start_as_current_span(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """As ``Tracer.start_as_current_span``; a shared no-op context while tracing is off."""
        if _tracing_off():
            return _NO_SPAN
        return self._inner.start_as_current_span(name, *args, **kwargs)

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> trace.Span:
        """As ``Tracer.start_span``; the invalid (non-recording) span while tracing is off."""
        if _tracing_off():
            return trace.INVALID_SPAN
        return self._inner.start_span(name, *args, **kwargs)


QUEUE_ATTRIBUTE = "switchyard.queue"
"""The span attribute naming the queue a wait was spent in: the ``queue`` label of
``switchyard_queue_wait_seconds`` (orchestration, retrieval, inference; the submitted backlog's waits are observed
there too, with no span of their own)."""


def start_queue_wait_span(
    tracer: StageTracer, name: str, queue: str, start_ns: int, context: Any = None,
    attributes: dict[str, Any] | None = None,
) -> trace.Span:
    """The span of a wait in ``queue`` from ``start_ns`` (wall clock), under ``context`` (default: the
    current span); the caller ends it when the wait ended. Every service's queue-wait span carries
    :data:`QUEUE_ATTRIBUTE`, so one query finds the waits of every queue alike."""
    return tracer.start_span(name, context, start_time=start_ns,
                             attributes={QUEUE_ATTRIBUTE: queue, **(attributes or {})})


def get_tracer(name: str) -> StageTracer:
    """The tracer for a module's stage spans (see :class:`StageTracer`)."""
    return StageTracer(name)


# OpenTelemetry SDK configuration spec, "General SDK Configuration": the samplers every SDK knows by name
# (the Python SDK's too); the jaeger_remote and xray ones it does not build.
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
_RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")
_BOOLEANS = ("true", "false")
MAX_EXPORT_TIMEOUT_S = 600.0
"""The longest ``OTEL_EXPORTER_OTLP_TIMEOUT`` taken, seconds: a larger one is almost surely milliseconds."""


def _exporters(value: str) -> set[str]:
    """The exporter names of an ``OTEL_TRACES_EXPORTER`` value (a comma-separated list), lower case."""
    return {part.strip().lower() for part in value.split(",")}


def _check_endpoint(value: str) -> str | None:
    """Why ``value`` is not an OTLP gRPC endpoint (``http[s]://host[:port]`` or ``host:port``), or None."""
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme in ("http", "https"):
        return None if parsed.hostname else "a URL with no host"
    host, _, port = value.rpartition(":")
    if host and port.isdigit() and "/" not in value:
        return None  # host:port, which the gRPC exporter takes as its target
    return "expected http://host:port, https://host:port or host:port (OTLP over gRPC; Jaeger listens on 4317)"


def check_tracing_environment() -> None:
    """Refuse ``OTEL_*`` values the SDK would ignore, warn about or crash on, before anything starts.

    The SDK's own answer to a bad value is a warning and a default that is not what was asked: an
    unknown sampler, or a ratio of ``abc`` or ``5``, samples every trace; ``OTEL_TRACES_EXPORTER=zipkin``
    or ``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`` still exports OTLP over gRPC, to a port that does
    not speak it; ``OTEL_EXPORTER_OTLP_TIMEOUT=abc`` is a traceback from the exporter. Checked only
    as Switchyard uses them: OTLP over gRPC is the one exporter.

    Raises:
        ValueError: naming the variable, its value and what is expected.
    """
    def read(name: str) -> tuple[str, str] | None:
        found = read_standard_named(name)
        return (found[0], found[1].strip()) if found else None

    def refuse(found: tuple[str, str], expected: str) -> None:
        raise ValueError(f"environment variable {found[0]}={found[1]!r}: {expected}")

    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE"):
        if (found := read(name)) and found[1].lower() not in _BOOLEANS:
            refuse(found, "expected 'true' or 'false'")
    if (found := read("OTEL_TRACES_EXPORTER")) and _exporters(found[1]) not in ({"otlp"}, {"none"}):
        refuse(found, "expected 'otlp' or 'none' (Switchyard exports spans over OTLP only: Jaeger receives it, "
                      "an OpenTelemetry Collector forwards it to any other backend)")
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        if (found := read(name)) and found[1].lower() != "grpc":
            refuse(found, "expected 'grpc' (Switchyard's exporter speaks OTLP over gRPC, port 4317 by default)")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        if (found := read(name)) and (problem := _check_endpoint(found[1])):
            refuse(found, problem)
    for name in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"):
        if found := read(name):
            try:
                seconds = float(found[1])
            except ValueError:
                seconds = math.nan
            if not 0 < seconds <= MAX_EXPORT_TIMEOUT_S:
                # The specification gives this variable in milliseconds; the Python exporter reads seconds
                # (opentelemetry-exporter-otlp-proto-grpc: float(OTEL_EXPORTER_OTLP_TIMEOUT)), so the spec's
                # 10000 would wait 2.8 hours for each export.
                refuse(found, f"expected the exporter's wait for each export in seconds, above 0 and at most "
                              f"{MAX_EXPORT_TIMEOUT_S:g} (the Python exporter reads seconds, not the "
                              f"specification's milliseconds: 10 for its default)")
    for name in ("OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"):
        if (found := read(name)) and found[1].lower() not in ("gzip", "deflate", "none"):
            refuse(found, "expected 'gzip', 'deflate' or 'none'")
    sampler = read("OTEL_TRACES_SAMPLER")
    if sampler and sampler[1].lower() not in _SAMPLERS:
        refuse(sampler, f"expected one of {', '.join(_SAMPLERS)}")
    if (found := read("OTEL_TRACES_SAMPLER_ARG")) and sampler and sampler[1].lower() in _RATIO_SAMPLERS:
        try:
            ok = 0.0 <= float(found[1]) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            refuse(found, f"expected the share of traces {sampler[1]} samples, a number from 0 to 1")


def tracing_configured() -> bool:
    """Whether the environment asks for tracing: an OTLP endpoint is set and the SDK is not disabled."""
    if (read_standard("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return False
    if _exporters(read_standard("OTEL_TRACES_EXPORTER") or "otlp") == {"none"}:
        return False
    return bool(read_standard("OTEL_EXPORTER_OTLP_ENDPOINT") or read_standard("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def tracing_enabled() -> bool:
    """Whether :func:`setup_tracing` turned tracing on in this process."""
    return _provider is not None


def _install(provider: TracerProvider) -> None:
    global _provider
    trace.set_tracer_provider(provider)
    _provider = provider


def install_provider(provider: TracerProvider) -> None:
    """Turn tracing on in this process with ``provider`` (built by :func:`make_tracer_provider`, with
    its own span processors) instead of the OTLP exporter: for embedding Switchyard's services in a
    process that exports spans its own way, and for tests that run a whole stack in one process.
    The global tracer provider can be set once per process."""
    with _lock:
        _install(provider)


def setup_tracing(service_name: str) -> Callable[[], None]:
    """Turn tracing on for this process when the environment asks for it.

    Installs a global SDK tracer provider (:func:`make_tracer_provider`) with resource ``service.name``
    (``OTEL_SERVICE_NAME`` or ``service_name``), ``service.namespace=switchyard``
    and ``service.version``; the sampler from ``OTEL_TRACES_SAMPLER``; and a
    ``BatchSpanProcessor`` feeding the OTLP gRPC span exporter (endpoint,
    headers, TLS and timeout from ``OTEL_EXPORTER_OTLP_*``).

    Calling it again in the same process returns the first call's shutdown.

    Args:
        service_name: orchestrator, retrieval or dispatcher.

    Returns:
        ``shutdown()``: flushes pending spans and stops the exporter; safe to
        call more than once. A no-op when tracing is off.

    Raises:
        ValueError: a bad ``OTEL_*`` value (:func:`check_tracing_environment`).
    """
    global _shutdown
    with _lock:
        if _shutdown is not None:
            return _shutdown
        check_tracing_environment()
        if not tracing_configured():
            log.debug("tracing off: no OTEL_EXPORTER_OTLP_ENDPOINT, or OTEL_SDK_DISABLED=true")
            return _noop
        # Imported here so that a process with tracing off never loads the exporter (grpc, protobuf).
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_NAMESPACE, SERVICE_VERSION
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = read_standard("OTEL_SERVICE_NAME") or service_name
        resource = Resource.create({SERVICE_NAME: name, SERVICE_NAMESPACE: "switchyard", SERVICE_VERSION: __version__})
        provider = make_tracer_provider(resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _install(provider)
        endpoint = read_standard("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or read_standard("OTEL_EXPORTER_OTLP_ENDPOINT")
        log.info("tracing on: service.name=%s, OTLP gRPC to %s, sampler %s", name, endpoint,
                 provider.sampler.get_description())  # its repr is '<...ParentBased object at 0x...>

        done = threading.Event()

        def shutdown() -> None:
            if done.is_set():
                return
            done.set()
            provider.shutdown()  # flushes the batch processor, then closes the exporter
            log.info("tracing: spans flushed, exporter closed")

        _shutdown = shutdown
        return shutdown


class _CurrentSpan:
    """``start_as_current_span``'s block, as the SDK's ``use_span`` runs it, without its two
    generator-based context managers.

    Entering starts the span (or none: see :class:`_ServerFaultRuleTracer`) and makes it current;
    an exception (an ``Exception``, not ``GeneratorExit``) escaping the block is recorded on the span
    and sets ERROR only by :func:`record_exception_status`. Also a decorator, of functions and
    coroutine functions: a span per call, as the API's ``start_as_current_span`` decorates.
    """

    __slots__ = ("_tracer", "_name", "_args", "_span", "_token", "_owned")

    def __init__(self, tracer: _ServerFaultRuleTracer, name: str, args: tuple[Any, ...]) -> None:
        self._tracer = tracer
        self._name = name
        self._args = args  # context, kind, attributes, links, start_time, record_exception, set_status, end
        self._span: trace.Span = trace.INVALID_SPAN
        self._token: object = None
        self._owned = False

    def __enter__(self) -> trace.Span:
        context, kind, attributes, links, start_time, record_exception, _, _ = self._args
        tracer = self._tracer
        if context is None and (parent := tracer._unsampled_parent()) is not None:
            self._span, self._owned = parent, False  # a child would be dropped: none is built
            return parent
        self._span = tracer._inner.start_span(self._name, context, kind, attributes, links or (), start_time,
                                              record_exception)
        self._owned = True
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if not self._owned:
            return False
        span, (_, _, _, _, _, record_exception, set_status, end) = self._span, self._args
        try:
            otel_context.detach(self._token)
            if isinstance(exc, Exception) and span.is_recording():
                if record_exception:
                    span.record_exception(exc)
                if set_status:
                    record_exception_status(span, exc)
        finally:
            if end:
                span.end()
        return False

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        tracer, name, args = self._tracer, self._name, self._args
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*a: Any, **k: Any) -> Any:
                with _CurrentSpan(tracer, name, args):
                    return await fn(*a, **k)
            return run_async

        @functools.wraps(fn)
        def run(*a: Any, **k: Any) -> Any:
            with _CurrentSpan(tracer, name, args):
                return fn(*a, **k)
        return run


def _drops_unsampled_children(sampler: Any) -> bool:
    """Whether ``sampler`` drops every child of an unsampled parent, local or remote: the
    ``parentbased_*`` samplers of ``OTEL_TRACES_SAMPLER`` (OpenTelemetry SDK spec, "ParentBased")."""
    description = sampler.get_description() if sampler is not None else ""
    return (description.startswith("ParentBased{")
            and "remoteParentNotSampled:AlwaysOffSampler" in description
            and "localParentNotSampled:AlwaysOffSampler" in description)


class _ServerFaultRuleTracer(trace.Tracer):
    """An SDK tracer whose ``start_as_current_span`` applies :func:`record_exception_status`.

    The SDK marks a span ERROR for any exception escaping its ``with`` block;
    this one records the exception as usual but sets ERROR only when the
    exception maps (:func:`~switchyard.common.errors.status_for`) to a
    server-fault code, so a queue saturated for this caller or a bad field
    does not paint the trace red.

    Under a ``parentbased_*`` sampler, a span started as a child of the
    current span while that one is unsampled would be dropped by the sampler:
    this tracer does not build it. ``start_as_current_span`` then leaves the
    current span current, and ``start_span`` answers a non-recording span with
    its context. At 10 % sampling that is 9 spans in 10 the engine's steps and
    the stages no longer pay for.
    """

    def __init__(self, inner: trace.Tracer, drops_unsampled_children: bool) -> None:
        self._inner = inner
        self._drops = drops_unsampled_children

    def _unsampled_parent(self) -> trace.Span | None:
        if not self._drops:
            return None
        span = trace.get_current_span()
        ctx = span.get_span_context()
        return span if ctx.is_valid and not ctx.trace_flags.sampled else None

    def start_span(self, name: str, context: Any = None, *args: Any, **kwargs: Any) -> trace.Span:
        if context is None and (parent := self._unsampled_parent()) is not None:
            return trace.NonRecordingSpan(parent.get_span_context())
        return self._inner.start_span(name, context, *args, **kwargs)

    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Any = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Any = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Any:
        return _CurrentSpan(self, name, (context, kind, attributes, links, start_time, record_exception,
                                         set_status_on_exception, end_on_exit))


class _ServerFaultRuleTracerProvider(TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _ServerFaultRuleTracer(super().get_tracer(*args, **kwargs), _drops_unsampled_children(self.sampler))


def make_tracer_provider(resource: Resource | None = None) -> TracerProvider:
    """An SDK ``TracerProvider`` whose tracers follow the server-fault rule for span status.

    Sampler from ``OTEL_TRACES_SAMPLER``; add span processors to it. Spans
    started with ``start_as_current_span`` are marked ERROR by an escaping
    exception only if it maps to a server-fault gRPC code (see
    :func:`record_exception_status`). :func:`setup_tracing` installs one;
    tests build their own around an in-memory exporter.
    """
    return _ServerFaultRuleTracerProvider(resource=resource or Resource.create({}))


def record_exception_status(span: trace.Span, exc: BaseException) -> None:
    """Status of a span that ``exc`` escaped: ERROR only for a server fault.

    The gRPC code is :func:`~switchyard.common.errors.status_for` ``(exc)``;
    it is recorded as ``switchyard.status_code`` (its name) either way.
    Codes in :data:`~switchyard.common.errors.SERVER_FAULT_CODES` (UNKNOWN,
    DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS) set
    status ERROR; the caller's faults (INVALID_ARGUMENT, NOT_FOUND,
    RESOURCE_EXHAUSTED, UNAUTHENTICATED, ...) leave it unset. A
    ``context.abort`` (``grpc.aio.AbortError``) carries no code; the RPC's
    server span records the aborted code, so the stage span is left alone.
    """
    if isinstance(exc, grpc.aio.AbortError):
        return
    code, _details = status_for(exc)
    span.set_attribute("switchyard.status_code", code.name)
    if code in SERVER_FAULT_CODES:
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def current_trace_id() -> str:
    """The current span's trace id as 32 lowercase hex characters, or "" when there is none.

    This is the id to search for in Jaeger; the orchestrator puts it on the
    final event.
    """
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return trace.format_trace_id(context.trace_id)


# --------------------------------------------------------------------------- interceptors and channels
# Factories here; the interceptors live in grpc_tracing.


def server_interceptors(tracer_provider: Any = None) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for ``grpc.aio.server(interceptors=...)``: one SERVER span per RPC.

    The span is the child of the ``traceparent`` in the request metadata, and
    the current span while the servicer runs, so spans the servicer starts
    nest under it. Health and reflection RPCs are not traced.

    Args:
        tracer_provider: a provider to use (tests); None means the global
            one, and an empty list when :func:`setup_tracing` left tracing off.
    """
    if tracer_provider is None and not tracing_enabled():
        return []
    return [grpc_tracing.server_interceptor(tracer_provider)]


def client_interceptors(tracer_provider: Any = None, target: str = "") -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors: one CLIENT span per RPC (:func:`switchyard.common.channels.open_channel` adds them).

    Each call injects the current context as W3C ``traceparent`` metadata. An
    empty list when tracing is off (and no ``tracer_provider`` is given).
    """
    if tracer_provider is None and not tracing_enabled():
        return []
    return grpc_tracing.client_interceptors(tracer_provider, target)


__all__ = [
    "client_interceptors",
    "current_trace_id",
    "make_tracer_provider",
    "record_exception_status",
    "server_interceptors",
    "install_provider",
    "setup_tracing",
    "tracing_configured",
    "tracing_enabled",
]
