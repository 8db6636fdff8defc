"""HTTP server metrics and spans for an aiohttp application, on the OpenTelemetry HTTP semantic conventions.

One middleware (:func:`middleware`, outermost in the application's list) gives every request:

- ``http.server.request.duration``, as the Prometheus histogram
  ``http_server_request_duration_seconds{http_request_method, http_route, http_response_status_code}``
  (prometheus_client's default registry, beside the services' other metrics). ``http_route`` is the
  route's template (``/api/v1/agent/{agent_id}/status``), never the raw path, and empty for a path no
  route matched (404) or a method none takes (405); a method outside HTTP's registered nine is
  ``_OTHER``; status codes are the few the server answers. Every label so comes from a bounded set.
  The duration runs from the middleware's start to the handler's return: a Server-Sent Events stream's
  whole length.
- with tracing on, a SERVER span named ``{method} {route}`` (``{method}`` alone without a route,
  ``HTTP`` for ``_OTHER``), child of the W3C ``traceparent`` the request carries (the global
  propagator), current while the handler runs, so the work the handler starts (a task: its stage
  spans, its ``trace_id``) is in the caller's trace. Attributes: ``http.request.method`` (and
  ``http.request.method_original`` for ``_OTHER``), ``http.route``, ``url.path``, ``url.query``,
  ``url.scheme``, ``server.address``, ``server.port``, ``client.address``, ``network.protocol.version``,
  ``user_agent.original``, ``http.response.status_code``; ``error.type`` and ERROR status only for a
  5xx answer (a server span's rule: a 4xx is the caller's mistake).

Source of names, attributes and buckets: OpenTelemetry semantic conventions for HTTP, "HTTP Server"
spans and metrics (stable since v1.23); the buckets are the conventions' advice, plus 30, 60 and 300 s
for streams.

Why not ``opentelemetry-instrumentation-aiohttp-server``: its latest release (0.66b1) pins
``opentelemetry-instrumentation``, ``-semantic-conventions`` and ``-util-http`` at 0.66b1 and the API at
1.45.1 exactly, against the 0.66b2 / 1.45.2 that the gRPC and httpx instrumentations in
requirements.lock pin; and it records its metrics through an OpenTelemetry MeterProvider, which
Switchyard does not run (its metrics are prometheus_client's).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Iterable

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Histogram

from switchyard import __version__

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
"""HTTP's registered methods (RFC 9110 and RFC 5789): the ``http_request_method`` values besides ``_OTHER``."""
OTHER_METHOD = "_OTHER"
CLIENT_CLOSED = 499
"""The status recorded for a request whose client left before an answer (errors.HTTP_STATUS of CANCELLED)."""
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30, 60, 300)

REQUEST_DURATION = Histogram(
    "http_server_request_duration_seconds",
    "Duration of HTTP server requests, seconds (OpenTelemetry http.server.request.duration): by method "
    "(_OTHER outside the registered nine), route template (empty: no route matched) and response status code.",
    ["http_request_method", "http_route", "http_response_status_code"],
    buckets=DURATION_BUCKETS,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _route(request: web.Request) -> str:
    """The route template that matched; for a method the route does not serve (405), the template of the route
    whose path matched; "" when no route's path did."""
    resource = request.match_info.route.resource
    if resource is not None:
        return resource.canonical
    if isinstance(request.match_info.http_exception, web.HTTPMethodNotAllowed):
        for candidate in request.app.router.resources():
            _, allowed = await candidate.resolve(request)
            if allowed:
                return candidate.canonical
    return ""


def observe_early(request: web.Request, status: int) -> None:
    """Count an answer given before the middleware ran (an ``Expect: 100-continue`` refused by its route's
    expect handler): its method, its route's template and status; no duration measured (0)."""
    resource = request.match_info.route.resource
    method = request.method if request.method in METHODS else OTHER_METHOD
    REQUEST_DURATION.labels(method, "" if resource is None else resource.canonical, str(status)).observe(0.0)


def observe_refused(status: int) -> None:
    """Count a request the HTTP parser refused before any route saw it (a malformed request line, an unknown
    method, headers too long): method ``_OTHER``, route "", its status; no duration measured (0)."""
    REQUEST_DURATION.labels(OTHER_METHOD, "", str(status)).observe(0.0)


def middleware(routes: Iterable[tuple[str, str]] = (), tracer_provider: Any = None,
               traced: Callable[[], bool] = lambda: True) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """The aiohttp middleware that measures and traces each request (see the module's docstring).

    Args:
        routes: ``(method, route template)`` pairs the application serves: their 200 series start at 0.
        tracer_provider: the provider of the spans; None: the global one.
        traced: whether to start spans, asked per request (the caller's "tracing on"); False: metrics only.
    """
    for method, route in routes:
        REQUEST_DURATION.labels(method, route, "200")
    tracer = trace.get_tracer("switchyard.http", __version__, tracer_provider)

    @web.middleware
    async def measure(request: web.Request, handler: Handler) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        start = loop.time()
        method = request.method if request.method in METHODS else OTHER_METHOD
        route = await _route(request)
        span = None
        token = None
        if traced():
            name = "HTTP" if method == OTHER_METHOD else f"{method} {route}".rstrip()
            span = tracer.start_span(name, propagate.extract(request.headers), SpanKind.SERVER,
                                     _request_attributes(request, method, route))
            token = otel_context.attach(trace.set_span_in_context(span))
        status = 500
        error_type = ""
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:  # aiohttp answers these with their status
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except BaseException as exc:  # aiohttp answers 500
            error_type = type(exc).__qualname__
            raise
        finally:
            REQUEST_DURATION.labels(method, route, str(status)).observe(loop.time() - start)
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 500 and status != CLIENT_CLOSED:
                    span.set_attribute("error.type", error_type or str(status))
                    span.set_status(Status(StatusCode.ERROR, error_type or str(status)))
                span.end()
            if token is not None:
                otel_context.detach(token)

    return measure


def _request_attributes(request: web.Request, method: str, route: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.path": request.path,
        "url.scheme": request.scheme,
        "network.protocol.version": f"{request.version.major}.{request.version.minor}",
    }
    if method == OTHER_METHOD:
        attributes["http.request.method_original"] = request.method
    if route:
        attributes["http.route"] = route
    if request.query_string:
        attributes["url.query"] = request.query_string
    host, _, port = (request.host or "").rpartition(":")
    if host and port.isdigit():
        attributes["server.address"], attributes["server.port"] = host, int(port)
    elif request.host:
        attributes["server.address"] = request.host
    if request.remote:
        attributes["client.address"] = request.remote
    agent = request.headers.get("User-Agent")
    if agent:
        attributes["user_agent.original"] = agent
    return attributes
