"""GatewayClient: chat completions against an OpenAI-compatible server, one base URL or a pool of replicas.

- The endpoints (``base_url``, or ``model_gateway.pool``'s list or DNS name) and
  which one takes each attempt: :mod:`switchyard.gateway.pool` and
  :mod:`switchyard.gateway.picker` (load- and prefix-aware, with bounded load).
  An attempt that fails on one endpoint before its first token is made again
  on another at once, before any retry wait; after a token, nothing is retried.
- One pooled httpx client per endpoint (``model_gateway.max_connections``), explicit
  connect/read/write/pool timeouts, plus ``total_timeout_s`` per completion.
  Its transport is aiohttp's pool by default (``model_gateway.http_transport``,
  :mod:`switchyard.gateway.transport`: every aiohttp error arrives as an httpx
  one, so the error table is the same); proxied requests use httpx's own.
  HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY are honoured, as
  :mod:`switchyard.gateway.proxy` reads them (an entry it cannot parse is
  skipped, never fatal).
- A circuit breaker per upstream model and endpoint (:mod:`switchyard.gateway.cooldown`):
  a model failing ``cooldown.failures`` times in a row is skipped for
  ``cooldown.cooldown_s``, its requests going straight to the fallback.
- Retries (tenacity, exponential backoff with jitter) and fallback to
  ``model_gateway.fallback_model`` happen only before the first streamed item:
  once a token or tool call has been handed to the caller, a failure is raised
  as is, so no token is ever repeated.
- The key is read from ``model_gateway.api_key_env`` on every call and never
  appears in a log, span, message or metric.
- Every chat request carries W3C trace context (``traceparent``: the call's ``gateway.chat_completions``
  span, where tracing is on), ``X-Agent-Id``, ``X-Priority`` (core, normal, batch) and
  ``X-Request-Id`` headers (the request's id, ``<id>~<n>`` while another call in flight holds it,
  :meth:`GatewayClient._claim_request_id`; ``<id>-<n>`` for the n-th HTTP request of one call,
  :func:`attempt_request_id`); with ``forward_priority`` the priority also goes in the
  server's own field (:mod:`switchyard.gateway.servers`; the flavour is learnt per
  endpoint). An optional field an endpoint refuses (400/422 naming it) is dropped for
  that endpoint, logged once, and the request sent again without it: nothing had
  streamed yet.
- A stream is finished by ``data: [DONE]`` or, without it, by a clean end after a
  ``finish_reason`` (:mod:`switchyard.gateway.decode`); a whole chat completion answering
  the stream request (a server or proxy that ignores ``stream``), under any Content-Type, ``text/event-stream``
  included, is a finished answer too: a body that does not open as events is read whole, whatever its label.
  Each stream's ending is counted once in ``switchyard_upstream_stream_endings_total``: those it was not read to
  (a read timeout, the deadline, its caller leaving) included, so the endings add up to the streams opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from urllib.parse import quote
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
import httpx
from httpx_sse import ServerSentEvent
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from switchyard.common.priority import PriorityClass
from switchyard.common import telemetry
from switchyard.common.config import UpstreamConfig
from switchyard.common.errors import SERVER_FAULT_CODES
from switchyard.common.request_ids import LiveRequestIds
from switchyard.gateway import models as model_names
from switchyard.gateway.classify import (
    error_for_status,
    error_for_transport,
    is_model_not_found,
    model_key,
    upstream_message,
    url_key,
    wrong_root,
)
from switchyard.gateway.decode import StreamDecoder
from switchyard.gateway.errors import (
    EndpointMarkedDown,
    EndpointNotFound,
    GatewayError,
    ModelCoolingDown,
    ModelNotFound,
    NoEndpointUp,
    StreamBroken,
    StreamProtocolError,
    UpstreamTimeout,
    snippet,
)
from switchyard.gateway.keys import ApiKey, load_api_key, require_usable
from switchyard.gateway import servers
from switchyard.common.metrics import OTHER
from switchyard.gateway.metrics import (
    ENDPOINT_FAILOVERS,
    GATEWAY_REQUESTS,
    GATEWAY_TTFT,
    UPSTREAM_STREAM_ENDINGS,
    start_at_zero,
)
from switchyard.gateway.pool import Endpoint, EndpointPool, PoolLimit, prompt_key
from switchyard.gateway.proxy import client_settings, proxy_for
from switchyard.gateway.redact import redact, safe_url
from switchyard.gateway.resilience import with_fallback
from switchyard.gateway.sse import iter_events, opening, opens_as_events
from switchyard.gateway.transport import UpstreamTransport, get_whole
from switchyard.gateway.events import ChatRequest, Finished, Reasoning, StreamEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

_OPTIONAL_FIELDS = ("priority", "stream_options")
"""Body fields a request works without: dropped for an endpoint that refuses them."""

_RENAMED_FIELDS = {"max_tokens": "max_completion_tokens"}
"""Body fields an endpoint may refuse naming the one to send instead: the OpenAI API answers ``max_tokens`` for
its reasoning models (o1, o3, gpt-5) 400 "Unsupported parameter: 'max_tokens' is not supported with this model.
Use 'max_completion_tokens' instead.", the name every OpenAI-compatible server also takes."""


DRAIN_AFTER_DONE_S = 1.0
"""How long the rest of a body is read after its ``data: [DONE]`` (:meth:`GatewayClient._finish_body`), seconds: a
server ends its body right after the marker, and a proxy or server that holds it open longer has its connection
closed rather than held (a connection held for ``read_timeout_s`` per call, no longer counted in flight, would
reach ``max_connections`` at about 17 calls/s an endpoint)."""

_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%") + " "


def header_value(text: str) -> str:
    """``text`` (a caller's id: any Unicode the edge accepts) as an HTTP header value, told apart from every other
    id: itself when it is visible ASCII with inner spaces only and no ``%``; else its UTF-8 percent-encoded
    (RFC 3986, section 2.1), ``%`` as ``%25`` and a space at either end as ``%20`` (a receiver strips those).
    Header values are ASCII (RFC 9110, section 5.5; obs-text is obsolete) and httpx refuses any other
    character."""
    if text.isascii() and text.isprintable() and "%" not in text and text == text.strip(" "):
        return text
    encoded = quote(text, safe=_HEADER_SAFE)
    inner = encoded.strip(" ")
    lead = len(encoded) - len(encoded.lstrip(" "))
    return "%20" * lead + inner + "%20" * (len(encoded) - len(inner) - lead)


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The ``X-Request-Id`` of a call's ``attempt``-th HTTP request (1, 2, ...): ``request_id`` for the first,
    ``<request_id>-<attempt>`` for each later one (a retry, another endpoint, the fallback model, a refused field
    resent), so the server's log names each and no two requests it may hold at once share an id. vLLM,
    ``transformers serve`` and TGI key their requests by this header: vLLM answers a second request with a live
    one's id 400 "Request id ... already running", and ``transformers serve`` streams nothing more to one of
    the two, so a retry sent while the server still held the attempt it replaces hung or failed. A request id
    ``<task_id>:<turn>`` ends in its turn's number, so no attempt's id is another request's."""
    return request_id if attempt <= 1 else f"{request_id}-{attempt}"


def _end(decoder: StreamDecoder) -> list[StreamEvent]:
    """``decoder.end()``, counting the stream's ending (done_marker, finish_reason or cut)."""
    try:
        events = decoder.end()
    except StreamBroken:
        UPSTREAM_STREAM_ENDINGS.labels("cut").inc()
        raise
    UPSTREAM_STREAM_ENDINGS.labels(decoder.ending or "cut").inc()
    return events


async def _one(body: bytes) -> AsyncIterator[bytes]:
    """A body read whole, as the chunks of one."""
    yield body


async def _no_events() -> AsyncIterator[ServerSentEvent]:
    """The events left of an answer read whole (:meth:`StreamDecoder.whole_answer`): none."""
    return
    yield


def _count_error(decoder: StreamDecoder, error: GatewayError) -> None:
    """Count a stream that ``error`` ended while it was read: one that carried an error object, or a chunk that
    cannot be read (its decoder says so), as ``error``; one that ran past the call's deadline as ``timeout``, or as
    ``cancelled`` where the deadline was the caller's (it gave up, as a cancel does). Other errors were counted
    where they were found (:func:`_end`: a body that ended cut)."""
    if decoder.failed:
        UPSTREAM_STREAM_ENDINGS.labels("error").inc()
    elif isinstance(error, UpstreamTimeout):
        UPSTREAM_STREAM_ENDINGS.labels("cancelled" if error.callers_deadline else "timeout").inc()


def _count_broken(error: GatewayError) -> None:
    """Count a stream whose body could not be read on (its transport's ``error``): the connection broke (``cut``),
    or the body went silent past ``read_timeout_s`` (``timeout``)."""
    if isinstance(error, StreamBroken):
        UPSTREAM_STREAM_ENDINGS.labels("cut").inc()
    elif isinstance(error, UpstreamTimeout):
        UPSTREAM_STREAM_ENDINGS.labels("timeout").inc()


def _count_left(call: "_Call") -> None:
    """Count a stream no longer read before it ended: ``cancelled`` (its caller left, or stopped reading, or ran
    out of its own deadline), or ``timeout`` where the call's deadline that ended it was
    ``model_gateway.total_timeout_s`` (:func:`~switchyard.gateway.resilience.with_fallback` cancels the attempt
    at it)."""
    timed_out = asyncio.get_running_loop().time() >= call.deadline and not call.callers_deadline
    UPSTREAM_STREAM_ENDINGS.labels("timeout" if timed_out else "cancelled").inc()


class _ReadDeadline:
    """A call's deadline over the reads of its stream after the first item.

    The deadline was checked only as an event came: a server that stalled after its first token went on for
    ``read_timeout_s`` (60 s) past a caller's 1 s deadline, and one that kept the stalled stream alive with
    comments (``: ping``, as sse-starlette's servers send every 15 s), blank lines or ``id:`` lines, which carry
    no event, went on for ever, past ``model_gateway.total_timeout_s`` too. A timer per read (``asyncio.timeout``)
    costs 5 us a chunk, twice a chunk's JSON; this is one timer per call. When the deadline passes while the
    stream's task waits on the body, the timer cancels that task (:meth:`timed_out` then tells that cancel from
    the caller's); while the caller holds an item (:meth:`hold`, the stream suspended at its ``yield``), nothing
    of the caller's is cancelled, and the next read refuses (:meth:`read`). The stream is read in the task that
    made this."""

    __slots__ = ("_task", "_cancelling", "_holding", "_late", "_fired", "_timer")

    def __init__(self, deadline: float) -> None:
        task = asyncio.current_task()
        assert task is not None, "a stream is read in a task"
        self._task, self._cancelling = task, task.cancelling()
        self._holding = self._late = self._fired = False
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        if self._holding:
            self._late = True
        else:
            self._fired = True
            self._task.cancel()

    def hold(self) -> None:
        """An item came: the caller holds it until the next :meth:`read`."""
        self._holding = True

    def read(self) -> None:
        """The caller asks for the next item.

        Raises:
            TimeoutError: the deadline passed while the caller held the last one.
        """
        self._holding = False
        if self._late:
            raise TimeoutError

    def timed_out(self) -> bool:
        """Whether a CancelledError the read raised is this deadline's (then taken back: the task is no longer
        cancelled), not the caller's."""
        return self._fired and self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._timer.cancel()


@dataclass
class _Call:
    """Per-call state shared by the attempts: key, bearer token, deadline, span."""

    key: ApiKey
    token: str | None
    deadline: float
    span: Span
    request_id: str
    budget: str = ""
    """What set ``deadline``, for the error message."""
    set_by: str = ""
    """Who set ``deadline``, for the refusals that cite it: ``model_gateway.total_timeout_s = 60``, ``its caller,
    from orchestrator.task_time_limit_s.chat = 600`` (the caller's :attr:`ChatRequest.deadline_source`), or ``its
    caller``."""
    sent: int = 0
    """HTTP requests sent so far for this call (retries, other endpoints, the fallback model, a field resent)."""
    callers_deadline: bool = False
    """``deadline`` is the caller's (``ChatRequest.timeout_s``), not ``model_gateway.total_timeout_s``."""


@dataclass
class _OpenStream:
    """A 200 SSE response read up to its first event(s), and the endpoint streaming it."""

    response: httpx.Response
    events: AsyncIterator[ServerSentEvent]
    decoder: StreamDecoder
    first: list[StreamEvent]
    ended: bool
    endpoint: Endpoint
    counted: bool = False
    """Its tokens were counted for the endpoint's limit already (a whole answer: :meth:`EndpointPool.on_whole_answer`);
    not its ending (``switchyard_upstream_stream_endings_total``), which :meth:`GatewayClient._stream_chat` tracks."""


class GatewayClient:
    """Chat completions through ``model_gateway``; see the module docstring for the rules.

    Args:
        config: the ``model_gateway`` section of queue.json.
        tracer: OpenTelemetry tracer for the ``gateway.chat_completions`` spans (default: global).
        transport: httpx transport override (tests of the connection pool); default: ``http_transport``'s.
    """

    def __init__(
        self,
        config: UpstreamConfig,
        *,
        tracer: Tracer | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.url_source = url_key(config)
        """What names the upstream URLs in the set-up (:func:`switchyard.gateway.classify.url_key`): the key a
        fix of an unreachable or wrong URL names."""
        self._tracer = tracer or telemetry.get_tracer(__name__)
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_keepalive_connections,
        )

        def make_http(url: str) -> httpx.AsyncClient:
            settings = client_settings(url)
            chosen = transport
            if chosen is None and config.http_transport == "aiohttp":
                chosen = UpstreamTransport(verify=settings["verify"], limits=limits)
            return httpx.AsyncClient(
                base_url=url + "/",
                timeout=httpx.Timeout(
                    connect=config.connect_timeout_s,
                    read=config.read_timeout_s,
                    write=config.write_timeout_s,
                    pool=config.pool_timeout_s,
                ),
                limits=limits,
                transport=chosen,  # proxied URLs get httpx's own proxy transport (mounted from settings["proxy"])
                **settings,
            )

        self.pool = EndpointPool(config, make_http)
        """The endpoints and the picker (one endpoint: ``base_url``)."""
        start_at_zero({model_names.model_label(m, config) for m in model_names.configured_models(config)} | {OTHER},
                      [model_names.model_label(m, config) for m in self.models_for("")[1:]])
        self._request_ids = LiveRequestIds()
        """Request ids of this client's calls in flight: no two go upstream under one."""
        self._relists: set[asyncio.Task[None]] = set()
        self._drains: set[asyncio.Task[None]] = set()
        """Reads of bodies whose stream ended at ``[DONE]`` before the body did (:meth:`_finish_body`)."""
        self._closed = False  # aclose began: a body whose stream ended is closed, not drained
        self._served: tuple[tuple[frozenset[str] | None, ...] | None, tuple[str, ...]] = (None, ())
        """The endpoints' model lists (each :attr:`Endpoint.models`, in the pool's order) :meth:`served_names` last
        built its names from, and those names."""
        self.pool.on_answer = self._relist_soon  # an endpoint back after it could not be reached: read again

    @property
    def refused_fields(self) -> set[str]:
        """The optional body fields any endpoint of the pool refused (:attr:`Endpoint.refused`: dropped, what they
        carried lost; a field sent under another name instead, :data:`_RENAMED_FIELDS`, loses nothing and is not
        one)."""
        return set().union(*(e.refused for e in self.pool.endpoints.values())) - set(_RENAMED_FIELDS)

    @property
    def concurrency_limit(self) -> PoolLimit:
        """The dispatcher's admission limit: the sum of the endpoints' (one endpoint: its own)."""
        return self.pool.limit

    async def aclose(self) -> None:
        """Close every endpoint's connection pool (and stop the reads of model lists under way; an endpoint that
        answers from now on starts none: it would read through a closed connection pool)."""
        self.pool.on_answer = None
        self._closed = True
        for task in (*self._relists, *self._drains):
            task.cancel()
        await asyncio.gather(*self._relists, *self._drains, return_exceptions=True)
        await self.pool.aclose()

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ public calls

    def url(self, path: str) -> str:
        """Full URL of ``path`` under the base URL, e.g. ``url("models")``."""
        return f"{self.config.base_url}/{path}"

    def _label(self, model: str) -> str:
        return model_names.model_label(model, self.config)

    def models_for(self, requested: str) -> list[str]:
        """Upstream ids to try for client-facing ``requested``: the mapped primary, then the fallback."""
        cfg = self.config
        primary = model_names.resolve(requested, cfg.model_map, cfg.default_model)
        chain = [primary]
        if cfg.fallback_model:
            fallback = model_names.resolve(cfg.fallback_model, cfg.model_map, cfg.default_model)
            if fallback != primary:
                chain.append(fallback)
        return chain

    async def list_models(self, endpoint: Endpoint | None = None) -> list[str]:
        """Model ids from ``GET /v1/models`` of ``endpoint`` (default: the first endpoint up), its whole answer
        within ``read_timeout_s``.

        Raises:
            GatewayError: transport failure (a ReadTimeout past ``read_timeout_s``), non-2xx answer, or a body without
                ``data[].id``.
        """
        key = load_api_key(self.config.api_key_env)
        token = require_usable(key, required=self.config.api_key_required)
        if endpoint is None:
            await self.pool.start()
            known = list(self.pool.endpoints.values())
            if not known:
                raise NoEndpointUp(f"no endpoint in the pool yet ({self.config.pool.dns_url} resolved to none)")
            endpoint = next((e for e in known if e.up), known[0])
        url = f"{endpoint.url}/models"
        try:
            # the whole answer within read_timeout_s: a server sending its list a byte at a time held the engine's
            # first read for ever (every request waiting its bound on it)
            response = await get_whole(endpoint.http, "models", self.config.read_timeout_s,
                                       "model_gateway.read_timeout_s", headers=self._headers(token, stream=False))
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, url, key) from None
        if response.status_code >= 300:  # a redirect too: not followed (error_for_status names where it points)
            raise error_for_status(response.status_code, response.text, response.headers, url=url, model="", key=key,
                                   url_source=self.url_source)
        try:
            body = response.json()
            ids = servers.listed_ids(body)
        except ValueError:
            raise StreamProtocolError(
                f"GET {url} did not return OpenAI's model list ({{'data': [{{'id': ...}}]}}): "
                f"received {snippet(redact(response.text, key.value))}"
            ) from None
        endpoint.windows = {model: window for model in ids if (window := servers.reported_context_window(body, model))}
        endpoint.models = frozenset(ids)
        name = self.config.server if self.config.server != "auto" else servers.detect(body, response.headers)
        if endpoint.flavour is not servers.FLAVOURS[name]:  # first read, or a server restarted
            endpoint.flavour = servers.FLAVOURS[name]
            log.info("model server at %s: %s", endpoint.url, name)
        return ids

    def _relist_soon(self, endpoint: Endpoint) -> None:
        """Read ``endpoint``'s model list again in the background (:meth:`_relist`)."""
        relist = asyncio.get_running_loop().create_task(self._relist(endpoint), name=f"relist-{endpoint.name}")
        self._relists.add(relist)
        relist.add_done_callback(self._relists.discard)

    async def _relist(self, endpoint: Endpoint) -> None:
        """``endpoint`` answers again after it could not be reached: its server may have been restarted with
        another model or context window, so its ``GET /v1/models`` is read again (its ids, windows and
        flavour). A read that fails leaves the list as it was, to be read at the next answer."""
        models, windows = endpoint.models, endpoint.windows
        try:
            await self.list_models(endpoint)
        except GatewayError as exc:
            endpoint.relist = True
            log.info("could not read the model list of %s again, now that it answers: %s", endpoint.url, exc)
            return
        if (endpoint.models, endpoint.windows) != (models, windows):
            log.info("upstream endpoint %s lists %s now (context windows %s), back after it could not be reached",
                     endpoint.url, ", ".join(map(repr, sorted(endpoint.models or ()))) or "no model",
                     endpoint.windows or "not reported")

    async def list_models_everywhere(self) -> list[str]:
        """:meth:`list_models` of the first endpoint up (its ids returned, its errors raised), and of every other
        endpoint of a pool (their failures logged): each endpoint's reported context windows are read, so that
        :meth:`reported_context_window` is the smallest of them."""
        ids = await self.list_models()
        others = [e for e in self.pool.endpoints.values() if e.models is None]  # not read yet
        for endpoint, outcome in zip(others, await asyncio.gather(*(self.list_models(e) for e in others),
                                                                  return_exceptions=True)):
            if isinstance(outcome, BaseException):
                log.info("could not list the models of %s for its context windows: %s", endpoint.url, outcome)
        return ids

    def served_names(self) -> tuple[str, ...]:
        """Every client-facing model name a request may give (:func:`~switchyard.gateway.models.served_names` of the
        ids the endpoints' :meth:`list_models` read, over a pool their union, and ``model_map``), sorted; empty while
        any endpoint of the pool has not been read (a down one may serve a name no other lists): not known, a
        request naming any model is sent and the upstream decides. The default and fallback models (and their
        aliases) are always among them: the set-up named them, and a server that serves a model it does not list
        (llama.cpp's answers any name) is the call's to decide; one the server does not serve is a warning at the
        dispatcher's start and a failure of ``switchyard doctor``.

        Built when a list was read with other ids or an endpoint joined or left the pool (``model_map`` and the
        configured models are the client's for its life), not on each call: the dispatcher reads it for every
        request that names a model (twice: :meth:`OpenAIEngine.await_model_list` and its check)."""
        lists = tuple(e.models for e in self.pool.endpoints.values())
        if lists != self._served[0]:  # a tuple compares each list by identity first: one element check per endpoint
            self._served = (lists, self._build_served(lists))
        return self._served[1]

    def _build_served(self, lists: tuple[frozenset[str] | None, ...]) -> tuple[str, ...]:
        """:meth:`served_names` of the endpoints' model ``lists``."""
        if not lists or any(models is None for models in lists):
            return ()
        ids = frozenset().union(*lists)  # type: ignore[arg-type]
        if not ids:
            return ()
        cfg = self.config
        configured = {model_names.resolve(m, cfg.model_map, "") for m in (cfg.default_model, cfg.fallback_model) if m}
        return tuple(model_names.served_names(ids | configured, cfg.model_map))

    def _pool_windows(self) -> dict[str, int]:
        """The context window per upstream model id over the endpoints of the pool now, tokens: the smallest any
        of them reported (a request within it fits on whichever endpoint it is sent to; one past it was
        refused 400 by the smaller replica, after the task was accepted, and not sent to another)."""
        windows: dict[str, int] = {}
        for endpoint in self.pool.endpoints.values():  # one that left the pool no longer counts
            for model, window in (endpoint.windows or {}).items():
                windows[model] = min(window, windows.get(model, window))
        return windows

    def reported_context_windows(self) -> dict[str, int]:
        """Every client-facing model name with a window the upstream reported, tokens: the upstream ids the
        endpoints' :meth:`list_models` saw one for (the smallest over a pool, :meth:`_pool_windows`), and each
        ``model_map`` alias of one (the alias's own name wins)."""
        reported = self._pool_windows()
        windows = dict(reported)
        for alias, target in self.config.model_map.items():
            if target in reported:
                windows.setdefault(alias, reported[target])
        return windows

    def named_as(self, requested: str, model: str) -> str:
        """Who named upstream id ``model`` (a call for client-facing ``requested``) by another name that
        ``model_gateway.model_map`` mapped to it, and that name: ``"the request's 'sonnet'"``,
        ``"model_gateway.default_model 'x'"`` or ``"model_gateway.fallback_model 'fast'"``; "" when ``model`` was
        named as it is (an error names the id, and that name where the one who wrote it knows only the name)."""
        cfg = self.config
        chain = self.models_for(requested)
        if model == chain[0]:
            source, name = ("the request's", requested) if requested else ("model_gateway.default_model",
                                                                            cfg.default_model)
        elif model in chain[1:]:
            source, name = "model_gateway.fallback_model", cfg.fallback_model
        else:
            return ""
        return f"{source} {name!r}" if name and name != model else ""

    def model_setting(self, requested: str, model: str) -> str:
        """The setting that named upstream id ``model`` for a call for client-facing ``requested``, where the
        request did not: the default model's (the request left ``model`` empty) or the fallback's, as
        :func:`~switchyard.gateway.classify.model_key` names it (the variable where one overrides the key);
        "" when the request named it."""
        chain = self.models_for(requested)
        if model == chain[0]:
            return "" if requested else model_key("default_model")
        return model_key("fallback_model") if model in chain[1:] else ""

    def reported_context_window(self, requested: str) -> int:
        """The context window, tokens, the upstream reported for the model client-facing ``requested`` maps to
        (:meth:`models_for`'s primary), from the last :meth:`list_models` of each endpoint (over a pool, the
        smallest they reported); 0 when none was reported (or the models were not listed yet). Callers take it
        through ``limits.context_window(model, reported)``."""
        return self._pool_windows().get(self.models_for(requested)[0], 0)

    async def server_flavour(self, endpoint: Endpoint | None = None) -> servers.ServerFlavour:
        """``endpoint``'s flavour (default: the first endpoint up): ``model_gateway.server``, or detected from its
        ``GET /v1/models`` once (``unknown`` when that fails or names no known server)."""
        if self.config.server != "auto":
            return servers.FLAVOURS[self.config.server]
        if endpoint is None:
            await self.pool.start()
            known = list(self.pool.endpoints.values())
            endpoint = next((e for e in known if e.up), known[0] if known else None)
            if endpoint is None:
                return servers.FLAVOURS["unknown"]
        if endpoint.flavour is None:
            try:
                await self.list_models(endpoint)
            except GatewayError as exc:
                log.info("could not list models to detect the server flavour of %s: %s", endpoint.url, exc)
            if endpoint.flavour is None:
                endpoint.flavour = servers.FLAVOURS["unknown"]
        return endpoint.flavour

    def _claim_request_id(self, request: ChatRequest) -> ChatRequest:
        """``request`` under an id no call of this client has in flight (:class:`LiveRequestIds`): two tasks under
        one task_id at once, as the field's ghz command sends them, reach the engine under one
        ``<task_id>:<turn>`` once the orchestrator's stream has rotated between them."""
        request_id = self._request_ids.claim(request.request_id)
        return request if request_id == request.request_id else dataclasses.replace(request, request_id=request_id)

    async def stream_chat(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        """Stream one completion: :class:`Token`, :class:`Reasoning` and :class:`ToolCallOut` items, then one
        :class:`Finished`. A reasoning model's thinking is an item like a token: the first one is the time to
        first token, and after it nothing is retried.
        The request goes upstream under an id no call of this client has in flight (:meth:`_claim_request_id`).

        Raises:
            GatewayError: any row of the error table. Before the first item the
                primary was retried and the fallback tried; after it, nothing was.
        """
        request = self._claim_request_id(request)
        try:
            async with contextlib.aclosing(self._stream_chat(request)) as events:
                async for event in events:
                    yield event
        finally:
            self._request_ids.release(request.request_id)

    async def _stream_chat(self, request: ChatRequest) -> AsyncIterator[StreamEvent]:
        """:meth:`stream_chat` of a request whose id is its own."""
        call = self._begin(request)
        started = time.monotonic()
        outcome = "ok"
        model = ""
        sent = 0
        thought = 0  # of which Reasoning events
        finished = False  # the Finished event went out: a close after it ends a complete call
        try:
            opened, model = await self._with_fallback(
                call, request, lambda e, m: self._open_stream(call, request, e, m))
            GATEWAY_TTFT.labels(model_names.model_label(model, self.config)).observe(time.monotonic() - started)
            ended_with: GatewayError | None = None  # what the endpoint's stream ended with, told to the pool
            ending_counted = opened.ended  # its ending counted (:data:`STREAM_ENDINGS`): each stream once
            try:
                for event in opened.first:
                    sent += not isinstance(event, Finished)
                    thought += isinstance(event, Reasoning)
                    finished = finished or isinstance(event, Finished)
                    if not opened.counted and (tokens := opened.decoder.answer_tokens([event])):  # its work too
                        self.pool.on_tokens(opened.endpoint, tokens)
                    yield event
                if not opened.ended:
                    reads = _ReadDeadline(call.deadline)
                    try:
                        async for sse in opened.events:
                            reads.hold()
                            self._check_deadline(call, model)
                            for event in opened.decoder.feed(sse.data, sse.event):
                                sent += not isinstance(event, Finished)
                                thought += isinstance(event, Reasoning)
                                finished = finished or isinstance(event, Finished)
                                if tokens := opened.decoder.answer_tokens([event]):
                                    self.pool.on_tokens(opened.endpoint, tokens)
                                yield event
                            if opened.decoder.done:
                                # [DONE] ends the stream: nothing after it is read, nor the body's end waited for
                                # (a server or proxy holding the response open after it turned a whole answer into
                                # a read timeout after its tokens)
                                break
                            reads.read()
                    except TimeoutError:
                        raise self._deadline_error(model, call) from None
                    except asyncio.CancelledError:
                        if reads.timed_out():
                            raise self._deadline_error(model, call) from None
                        raise
                    finally:
                        reads.close()
                    tail = _end(opened.decoder)  # counts the ending, or the cut it raises (an error it raises: below)
                    ending_counted = True
                    for event in tail:
                        finished = finished or isinstance(event, Finished)
                        yield event
                call.span.set_attribute("gen_ai.response.model", opened.decoder.model)
                call.span.set_attribute("switchyard.gateway.stream_ending", opened.decoder.ending or "cut")
            except httpx.HTTPError as exc:
                url = opened.endpoint.chat_completions
                error = self._transport_error(exc, url, call.key)
                _count_broken(error)
                ending_counted = True
                ended_with = error.from_replica(opened.endpoint.url, opened.endpoint.replica).after_tokens(sent)
                raise ended_with from None
            except GatewayError as exc:
                if not ending_counted:
                    _count_error(opened.decoder, exc)
                    ending_counted = True
                ended_with = (exc.naming(opened.endpoint.chat_completions)
                              .from_replica(opened.endpoint.url, opened.endpoint.replica).after_tokens(sent))
                raise ended_with
            except (asyncio.CancelledError, GeneratorExit):  # its caller left before the stream ended
                if not ending_counted:
                    _count_left(call)
                raise
            finally:
                try:
                    if opened.decoder.done and ended_with is None:
                        self._finish_body(opened)
                    else:
                        await opened.response.aclose()
                finally:  # a cancel arriving while the response closes must not keep the endpoint's slot
                    self.pool.finished(opened.endpoint, ended_with)
        except GatewayError as exc:
            # its caller's deadline ran out: the caller gave up, as a cancel does (which of the gateway's clock and
            # gRPC's cancel of the call sees it first is a race), never the model failing the call
            outcome = grpc.StatusCode.CANCELLED.name if exc.callers_deadline else exc.code.name
            self._fail_span(call.span, exc)
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the caller went away (cancelled, or stopped reading)
            if not finished:
                outcome = grpc.StatusCode.CANCELLED.name
            raise
        except BaseException:
            outcome = grpc.StatusCode.INTERNAL.name  # not an upstream answer: a fault here, never counted as ok
            raise
        finally:
            call.span.set_attribute("switchyard.gateway.items_streamed", sent)
            call.span.set_attribute("switchyard.gateway.reasoning_items", thought)
            call.span.end()
            GATEWAY_REQUESTS.labels(self._label(model or self.models_for(request.model)[0]), outcome).inc()

    def _finish_body(self, opened: _OpenStream) -> None:
        """Read what is left of a body whose stream ended at ``data: [DONE]``, in the background, then close it.

        The answer is whole at ``[DONE]``: the call ends there, not when the body does (a server or proxy that
        held the response open after it turned a whole answer into a read timeout after its tokens). The rest
        (most servers send the body's end right after) is read so that the connection is kept for the next call,
        within :data:`DRAIN_AFTER_DONE_S`: a body held open longer is closed with its connection (held for the
        whole ``read_timeout_s``, such bodies piled up connections no longer counted in flight, to the pool's
        ``max_connections``). What it holds is not read as the stream, and a failure there fails nothing. A
        client closing (:meth:`aclose`) closes the body at once."""

        async def drain() -> None:
            try:
                if not self._closed:  # a client closing closes the body at once: its drains were cancelled
                    async with asyncio.timeout(DRAIN_AFTER_DONE_S):
                        async for _ in opened.events:
                            pass
            except Exception:  # noqa: BLE001 - the answer is whole: whatever the rest of the body does fails nothing
                pass
            finally:
                with contextlib.suppress(Exception):
                    await opened.response.aclose()

        task = asyncio.get_running_loop().create_task(drain(), name=f"drain-{opened.endpoint.name}")
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    # ------------------------------------------------------------------ attempts

    def _begin(self, request: ChatRequest) -> _Call:
        span = self._tracer.start_span(
            "gateway.chat_completions",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "gen_ai.request.model": self.models_for(request.model)[0],
                "switchyard.request_id": request.request_id,
            },
        )
        key = load_api_key(self.config.api_key_env)
        try:
            token = require_usable(key, required=self.config.api_key_required)
        except GatewayError as exc:
            self._fail_span(span, exc)
            span.end()
            GATEWAY_REQUESTS.labels(self._label(self.models_for(request.model)[0]), exc.code.name).inc()
            raise
        budget_s, budget = self.config.total_timeout_s, f"model_gateway.total_timeout_s={self.config.total_timeout_s:g}s"
        set_by = f"model_gateway.total_timeout_s = {self.config.total_timeout_s:g}"
        callers = request.timeout_s is not None and request.timeout_s < budget_s
        if callers:
            source = f", from {request.deadline_source}" if request.deadline_source else ""
            budget_s, budget = request.timeout_s, f"the caller's deadline ({request.timeout_s:.3g}s left{source})"
            set_by = f"its caller{source}"
        deadline = asyncio.get_running_loop().time() + budget_s
        return _Call(key, token, deadline, span, request.request_id, budget, set_by, callers_deadline=callers)

    async def _with_fallback(
        self, call: _Call, request: ChatRequest, once: Callable[[Endpoint, str], Awaitable[T]]
    ) -> tuple[T, str]:
        """``once(endpoint, model)`` over the endpoints, with retries and the fallback model.

        The result keeps its endpoint's stream open (an :class:`_OpenStream`, whose reader calls
        ``pool.finished``).
        """
        chain = self.models_for(request.model)

        async def attempt(model: str) -> T:
            try:
                return await self._on_endpoints(call, request, model, once)
            except ModelNotFound as exc:
                # A model the client named and the upstream does not know is the client's
                # mistake: answer NOT_FOUND with the nearest id rather than quietly serve
                # another model. The configured default failing still falls back.
                if request.model and model == chain[0]:
                    exc.fallback_ok = False
                raise

        result, model = await with_fallback(
            chain, attempt, self.config, deadline=call.deadline,
            on_deadline=lambda model: self._deadline_error(model, call),
            deadline_set_by=call.set_by, attempt_s=self.pool.expected_ttft_s,
        )
        if model != chain[0]:
            call.span.set_attribute("switchyard.gateway.fallback_model", model)
        return result, model

    async def _on_endpoints(
        self, call: _Call, request: ChatRequest, model: str, once: Callable[[Endpoint, str], Awaitable[T]]
    ) -> T:
        """One attempt of ``model``: on the endpoint the picker gives, and on the next untried one at once when it
        fails before its first token in a way another replica may not (retryable, or its circuit is open).

        Raises:
            GatewayError: the first error another endpoint would meet too, or the last endpoint's error.
            NoEndpointUp: every endpoint is down.
        """
        pool = self.pool
        await pool.start()
        key = ""
        if pool.pooled:
            key = request.affinity_key or prompt_key(request.messages, self.config.pool.prefix_chars)
        tried: set[str] = set()
        last: GatewayError | None = None
        # no fallback model after this one: a half-open circuit with its probes out is waited on, not a refusal
        # (the picker gives an endpoint whose circuit refuses only when no other untried one takes the call)
        last_model = model == self.models_for(request.model)[-1]
        while True:
            try:
                endpoint, picked = pool.pick(key, frozenset(tried), model)
            except LookupError:
                if last is not None:
                    raise last from None
                raise NoEndpointUp(
                    f"every endpoint of model_gateway.pool is down ({len(pool.endpoints)}: "
                    f"{', '.join(sorted(pool.endpoints)) or 'none resolved'}); calls resume when one answers "
                    "its /metrics again"
                ) from None
            call.span.set_attributes(endpoint.span_attributes)  # the last attempt's: the endpoint that answered
            if pool.pooled:
                call.span.set_attribute("switchyard.gateway.endpoint", endpoint.name)
                call.span.set_attribute("switchyard.gateway.endpoint_pick", picked.reason)
            try:
                result = await endpoint.cooldowns.call(model, lambda: once(endpoint, model),
                                                       wait_for_probes=last_model)
            except GatewayError as exc:
                exc.from_replica(endpoint.url, endpoint.replica)
                pool.finished(endpoint, exc)
                # a NOT_FOUND of a model this endpoint listed read its list again (_status_error): one that no
                # longer names it (a replica restarted with another model) leaves the call to one that does
                dropped = (isinstance(exc, ModelNotFound) and not pool.lists(endpoint, model)
                           and any(pool.lists(e, model) for e in pool.endpoints.values()
                                   if e is not endpoint and e.name not in tried))
                if not (exc.retryable or isinstance(exc, ModelCoolingDown) or dropped) or not pool.pooled:
                    raise
                tried.add(endpoint.name)
                last = exc
                if len(tried) < len(pool.endpoints):
                    ENDPOINT_FAILOVERS.inc()
                    log.info("endpoint %s failed before the first token (%s); trying another", endpoint.name, exc)
                continue
            except BaseException:
                pool.finished(endpoint)
                raise
            return result  # its reader calls pool.finished when the stream ends

    async def _body(self, request: ChatRequest, endpoint: Endpoint, model: str) -> dict[str, Any]:
        cfg = self.config
        body: dict[str, Any] = {"model": model, "messages": request.messages, "stream": True}
        if request.max_tokens:
            body["max_tokens"] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.tools:
            body["tools"] = request.tools
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
        if cfg.include_usage:
            body["stream_options"] = {"include_usage": True}
        if cfg.forward_priority and request.priority is not None:
            flavour = await self.server_flavour(endpoint)
            value = servers.priority_value(flavour, cfg.priority_values, request.priority.label,
                                           cfg.priority_polarity)
            if value is not None and flavour.priority_field:
                body[flavour.priority_field] = value
        for name in endpoint.refused:
            value = body.pop(name, None)
            if name in _RENAMED_FIELDS and value is not None:
                body[_RENAMED_FIELDS[name]] = value
        return body

    @staticmethod
    def _headers(token: str | None, *, stream: bool, request: ChatRequest | None = None,
                 attempt: int = 1) -> dict[str, str]:
        """The headers of one HTTP request; with ``request``, its tags, the ``attempt``-th request of its call
        (:func:`attempt_request_id`)."""
        headers = {"accept": "text/event-stream" if stream else "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        if request is not None:
            # The field's convention for tagging model calls (X-Agent-Id, X-Priority, X-Tenant-Id), read by
            # gateways and schedulers in front of the model server; X-Request-Id is what vLLM,
            # TGI and transformers serve take as the request's id in their logs.
            headers["x-agent-id"] = header_value(request.agent_id or request.request_id)
            if request.tenant_id:  # whose agent: two tenants' agents of one id are two agents
                headers["x-tenant-id"] = header_value(request.tenant_id)
            priority = request.priority if request.priority is not None else PriorityClass.NORMAL  # CORE is 0: no `or`
            headers["x-priority"] = priority.label
            if request.request_id:
                headers["x-request-id"] = header_value(attempt_request_id(request.request_id, attempt))
        return headers

    def _drop_refused(self, endpoint: Endpoint, status: int | None, text: str, body: dict[str, Any],
                      call: _Call) -> bool:
        """Whether a 400/422 (answered, or an error inside the stream before any item) refuses an optional field
        ``body`` carried (``priority``, ``stream_options``: :func:`servers.refused_field`), or one it names the
        replacement of (:data:`_RENAMED_FIELDS`); if so that field is never sent to ``endpoint`` again (the
        replacement is, with its value), logged the first time, and the caller sends the request again."""
        sent = tuple(name for name in (*_OPTIONAL_FIELDS, *_RENAMED_FIELDS) if name in body)
        refused = servers.refused_field(status, text, sent) if status is not None else None
        if refused in _RENAMED_FIELDS and _RENAMED_FIELDS[refused] not in text:
            refused = None  # refused for its value, say, not its name: the replacement would be refused too
        if refused is None:
            return False
        dropped = endpoint.refused
        if refused in dropped:  # the calls in flight before the first refusal are each refused too: said once
            return True
        dropped.add(refused)
        log.warning(
            "%s refused the request field %r (%d %s); it is no longer sent to this endpoint%s",
            endpoint.chat_completions, refused, status, snippet(redact(upstream_message(text), call.key.value)),
            f", {_RENAMED_FIELDS[refused]} is sent instead" if refused in _RENAMED_FIELDS else
            "; set model_gateway.forward_priority to false, name the server in model_gateway.server, or start "
            "vLLM with --scheduling-policy priority" if refused == "priority" else "",
        )
        return True

    async def _send(
        self, call: _Call, request: ChatRequest, endpoint: Endpoint, model: str
    ) -> tuple[httpx.Response, dict[str, Any]]:
        """POST chat/completions to ``endpoint``: its 2xx response and the body sent; a non-2xx answer is read
        and raised as its error.

        An answer 400/422 refusing an optional field that was sent (``priority``,
        ``stream_options``) drops that field for this endpoint and sends the request again.
        """
        url = endpoint.chat_completions
        while True:
            body = await self._body(request, endpoint, model)
            call.sent += 1
            if request.on_sent is not None:
                request.on_sent(endpoint.url, model)
            headers = self._headers(call.token, stream=True, request=request, attempt=call.sent)
            # W3C trace context (traceparent, and baggage where set): a model server that traces (vLLM's
            # --otlp-traces-endpoint, TGI's --otlp-endpoint, SGLang's) joins the task's trace under this call's span
            propagate.inject(headers, context=trace.set_span_in_context(call.span))
            http_request = endpoint.http.build_request("POST", endpoint.chat_completions_url, json=body, headers=headers)
            try:
                response = await endpoint.http.send(http_request, stream=True)
            except httpx.HTTPError as exc:
                self.pool.lost(endpoint)
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)) and not proxy_for(url):
                    self.pool.mark_down(endpoint, f"{type(exc).__name__}: {exc}")
                raise self._transport_error(exc, url, call.key) from None
            if response.status_code < 300:  # a redirect is not followed: error_for_status names where it points
                return response, body
            try:
                text = (await response.aread()).decode("utf-8", "replace")
            except httpx.HTTPError:
                text = ""
            finally:
                await response.aclose()
            if not self._drop_refused(endpoint, response.status_code, text, body, call):
                raise await self._status_error(response, text, endpoint, model, call.key,
                                               self.named_as(request.model, model),
                                               self.model_setting(request.model, model))

    async def _status_error(
        self, response: httpx.Response, text: str, endpoint: Endpoint, model: str, key: ApiKey, named_as: str = "",
        setting: str = "",
    ) -> GatewayError:
        """The error of a non-2xx answer to a call of upstream id ``model`` (``named_as``: who named it by another
        name, which ``model_gateway.model_map`` mapped to it, :meth:`named_as`; a not-found names both; ``setting``:
        the setting that named it, :meth:`model_setting`, which a not-found's fix names)."""
        url = endpoint.chat_completions
        status = response.status_code
        if status in (400, 404, 422):
            # A 400/422 whose message names the model may be a model the server does not serve
            # (transformers serve: 400 "Server is pinned to ..."): the model list decides.
            said_model = is_model_not_found(status, text)
            names_model = bool(model) and model in upstream_message(text)
            if said_model or names_model or status == 404:
                listed = endpoint.models is not None and model_names.listed(model, endpoint.models)
                known = await self._known_models(endpoint)  # read again: its list may be a server's before a restart
                if listed and known is not None and not model_names.listed(model, known):
                    log.info("upstream endpoint %s no longer lists model %r (it lists %s now): restarted with "
                             "another model?", endpoint.url, model, ", ".join(map(repr, known[:10])) or "none")
                if said_model or (known is not None and not model_names.listed(model, known)):
                    detail = snippet(redact(upstream_message(text), key.value))
                    return ModelNotFound(model, model_names.nearest(model, known or []), detail,
                                         served=known, named_as=named_as, setting=setting).naming(url)
                if status == 404:
                    said = snippet(redact(upstream_message(text), key.value))
                    if known is not None:  # the root's GET /models answers and lists it: the root is right
                        return EndpointNotFound(
                            f"upstream 404 for {url} (upstream said {said}), although {endpoint.url}/models lists "
                            f"model {model!r}: the server there serves no chat completions for it (a completions-only "
                            f"or embedding server?); point {self.url_source} at a server that serves /chat/completions"
                        )
                    return EndpointNotFound(
                        f"upstream 404 for {url} (upstream said {said}), and {endpoint.url}/models could not be read "
                        f"either; {wrong_root(endpoint.url, text, self.url_source)}"
                    )
        return error_for_status(status, text, response.headers, url=url, model=model, key=key,
                                url_source=self.url_source)

    @staticmethod
    def _note_label(endpoint: Endpoint, content_type: str) -> None:
        """``endpoint`` answered a stream request with an event stream labelled ``content_type``, not
        ``text/event-stream``: it is read as the stream it is, and the label is kept
        (:attr:`Endpoint.stream_label`, which ``switchyard doctor`` names) and logged when it first comes."""
        if endpoint.stream_label == content_type:
            return
        endpoint.stream_label = content_type
        log.warning(
            "%s streams under %s, not text/event-stream; read as the event stream its body is, as the OpenAI SDK "
            "reads it, but a client that checks the type (a browser's EventSource, some SDKs) refuses it",
            endpoint.chat_completions, f"Content-Type {content_type!r}" if content_type else "no Content-Type",
        )

    def _transport_error(self, exc: httpx.HTTPError, url: str, key: ApiKey) -> GatewayError:
        """:func:`error_for_transport` of a request to ``url``: through its proxy, if any, and naming what set the
        URL (:attr:`url_source`) in the fix."""
        return error_for_transport(exc, url=url, proxy=proxy_for(url), key=key, url_source=self.url_source)

    async def _known_models(self, endpoint: Endpoint) -> list[str] | None:
        try:
            return await self.list_models(endpoint)
        except GatewayError as exc:
            log.info("could not list models for a 404: %s", exc)
            return None

    async def _open_stream(self, call: _Call, request: ChatRequest, endpoint: Endpoint, model: str) -> _OpenStream:
        """The stream of one attempt, open once its first item came. In a pool, an endpoint marked down meanwhile
        (its ``/metrics`` read failed: a hung or stopped server) ends the wait at once with a retryable error, so
        the call goes to another endpoint instead of waiting ``read_timeout_s`` on one known to be down."""
        if not self.pool.pooled:
            return await self._open_first(call, request, endpoint, model)
        opening = asyncio.ensure_future(self._open_first(call, request, endpoint, model))
        marked_down = asyncio.ensure_future(endpoint.down.wait())
        try:
            await asyncio.wait((opening, marked_down), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller left (cancelled): a stream the attempt opened meanwhile is read by no one
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                unread = opening.result()
                if not unread.ended:
                    _count_left(call)
                await unread.response.aclose()
            raise
        finally:
            marked_down.cancel()
            if not opening.done():
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)
        if not opening.cancelled():
            return opening.result()
        raise EndpointMarkedDown(
            f"upstream endpoint {endpoint.chat_completions} was marked down (its /metrics read failed) while this "
            "call waited for its first item; sent to another endpoint"
        )

    async def _open_first(self, call: _Call, request: ChatRequest, endpoint: Endpoint, model: str) -> _OpenStream:
        """Send one attempt and read its stream up to its first item (or its end). An error inside the stream
        before any item that refuses an optional field (vLLM without ``--scheduling-policy priority`` answers a
        priority other than 0 so) drops the field as an answered refusal does, and sends the request again."""
        while True:
            opened = await self._open_once(call, request, endpoint, model)
            if opened is not None:
                return opened

    async def _open_once(self, call: _Call, request: ChatRequest, endpoint: Endpoint,
                         model: str) -> _OpenStream | None:
        """One request of :meth:`_open_first`; None: its stream refused an optional field, now dropped."""
        sent = time.monotonic()
        response, body = await self._send(call, request, endpoint, model)
        url = endpoint.chat_completions
        decoder = StreamDecoder(model, url=url, key=call.key)
        try:
            content_type = response.headers.get("content-type", "")
            labelled = "text/event-stream" in content_type.lower()
            head, chunks = await opening(response.aiter_bytes())  # the body decides, not its label
            if opens_as_events(head):
                if not labelled:  # a stream under another label
                    self._note_label(endpoint, content_type)
            else:  # read whole: a chat completion or a JSON error under any label, else what came is named
                body_bytes = b"".join([chunk async for chunk in chunks])  # head first
                text = body_bytes.decode("utf-8-sig", "replace")  # a leading byte order mark, as a stream's
                if (answered := decoder.answered_error(text, response.headers)) is not None:
                    raise answered
                if (whole := decoder.whole_answer(text)) is not None:
                    UPSTREAM_STREAM_ENDINGS.labels(decoder.ending).inc()
                    self.pool.on_whole_answer(endpoint, decoder.answer_tokens(whole))
                    return _OpenStream(response, _no_events(), decoder, whole, True, endpoint, counted=True)
                if not labelled:
                    decoder.failed = True  # a body that cannot be read: counted as the stream's error ending
                    raise StreamProtocolError(
                        f"asked {url} for a stream (stream=true) but it answered "
                        f"{content_type or 'no content-type'} that is neither a stream nor a chat completion: "
                        f"received {snippet(redact(text, call.key.value))}"
                    )
                chunks = _one(body_bytes)  # labelled a stream: read as one, and what it held instead is named
            stray: list[str] = []  # what the body held that is no event (read while none came)
            events = iter_events(chunks, stray)
            first: list[StreamEvent] = []
            async for sse in events:
                first.extend(decoder.feed(sse.data, sse.event))
                if decoder.done:  # [DONE] ends the stream: the body's own end is not waited for
                    break
                if first:
                    self.pool.on_first_item(endpoint, time.monotonic() - sent)
                    return _OpenStream(response, events, decoder, first, False, endpoint)
            if not decoder.chunks and stray:  # no chunk came (a [DONE] may have): what came instead is named
                decoder.stray = redact("\n".join(stray), call.key.value)
                if (answered := decoder.answered_error(decoder.stray, response.headers)) is not None:
                    raise answered
            return _OpenStream(response, events, decoder, _end(decoder), True, endpoint)
        except httpx.HTTPError as exc:
            await response.aclose()
            self.pool.lost(endpoint)
            error = self._transport_error(exc, url, call.key)
            _count_broken(error)
            raise error from None
        except GatewayError as exc:  # the decoder's: a cut, malformed or choiceless stream, or an error in it
            await response.aclose()
            _count_error(decoder, exc)
            if decoder.error_data is not None and self._drop_refused(endpoint, decoder.error_status,
                                                                     decoder.error_data, body, call):
                return None
            raise exc.naming(url) from None
        except (asyncio.CancelledError, GeneratorExit):  # no longer waited for: the caller left, or the deadline
            await response.aclose()
            _count_left(call)
            raise
        except BaseException:
            await response.aclose()
            raise

    # ------------------------------------------------------------------ deadlines and spans

    def _deadline_error(self, model: str, call: _Call) -> UpstreamTimeout:
        where = (f"the {len(self.pool.endpoints)} endpoints of model_gateway.pool" if self.pool.pooled
                 else safe_url(self.config.base_url))
        err = UpstreamTimeout(f"model {model!r} did not complete within {call.budget} at {where}")
        err.code = grpc.StatusCode.DEADLINE_EXCEEDED
        err.retryable = False
        err.callers_deadline = call.callers_deadline
        return err

    def _check_deadline(self, call: _Call, model: str) -> None:
        if asyncio.get_running_loop().time() > call.deadline:
            raise self._deadline_error(model, call)

    @staticmethod
    def _fail_span(span: Span, exc: GatewayError) -> None:
        span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
        span.add_event("exception", {"exception.type": type(exc).__name__, "exception.message": str(exc)})
        if exc.code in SERVER_FAULT_CODES:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
