"""The replicas of the model server behind ``model_gateway``: endpoints, their health and load, and the picking.

``model_gateway.pool`` names the replicas: a list of base URLs
(``pool.endpoints``) or a base URL whose host resolves to all of them
(``pool.dns_url``, a headless Service; re-resolved every
``resolve_interval_s``, each address an endpoint). Without either, ``base_url``
is the one endpoint: a pool of one, with its own limit as every endpoint has,
and no picking, marking down or failover.

Per endpoint (:class:`Endpoint`): its own HTTP connection pool, its own circuit
breaker per model (:class:`switchyard.gateway.cooldown.Cooldowns`), its own
adaptive concurrency limit
(:class:`switchyard.dispatcher.adaptive_limit.AdaptiveConcurrencyLimit`, fed that
endpoint's TTFTs and 429/503 answers), its streams in flight, and what the
server says of its own load (:mod:`switchyard.gateway.server_load`, read from
its ``/metrics`` every ``scrape_interval_s``; one endpoint's until it shows it
exports no queue depth). A read or a call that cannot connect, or
``pool.down_after_failed_reads`` reads in a row that time out or are cut, mark a
pool's endpoint down until a read succeeds. The dispatcher admits up to the sum of the
endpoints' limits (:class:`PoolLimit`): the one limit on the upstream, whatever
its size; it counts the streams it admitted itself
(:class:`switchyard.dispatcher.scheduler.capacity.StreamSlots`), each endpoint its
attempts.

Each attempt of a call asks :class:`switchyard.gateway.picker.EndpointPicker`
for an endpoint; a call that fails there before its first token (a refused
connection, a 5xx, a 429, an open circuit) is tried on another endpoint at once
(:meth:`switchyard.gateway.client.GatewayClient`), and only when every endpoint
failed do the retries with backoff and the fallback model take over. After a
token, nothing is retried.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import httpx

from switchyard.common.affinity import hash64
from switchyard.common.config import UpstreamConfig
from switchyard.common.dns import resolve_addresses
from switchyard.dispatcher.adaptive_limit import (
    UPSTREAM_KNEE,
    UPSTREAM_LIMIT,
    AdaptiveConcurrencyLimit,
    core_reserve,
)
from switchyard.gateway import models as model_names
from switchyard.gateway.cooldown import CircuitGauges, Cooldowns
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.metrics import (
    ENDPOINT_IN_FLIGHT,
    ENDPOINT_KNEE,
    ENDPOINT_KV_USAGE,
    ENDPOINT_LIMIT,
    ENDPOINT_PICKS,
    ENDPOINT_UP,
    ENDPOINT_WAITING,
)
from switchyard.gateway.picker import REASONS, EndpointPicker, Picked
from switchyard.gateway.server_load import ServerLoad, parse_server_load
from switchyard.gateway.servers import ServerFlavour
from switchyard.gateway.transport import get_whole

log = logging.getLogger(__name__)

for _reason in REASONS:
    ENDPOINT_PICKS.labels(_reason)


def endpoint_name(url: str) -> str:
    """The endpoint's label: ``host:port`` of its base URL (the scheme's default port when none is given)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_root(url: str) -> str:
    """The server's root for a base URL: ``http://h:8000/v1`` -> ``http://h:8000``."""
    return url[: -len("/v1")] if url.endswith("/v1") else url


def prompt_key(messages: list[dict[str, Any]], chars: int) -> str:
    """The affinity key of a call without an agent: a hash of the first ``chars`` characters of its messages
    (role and text, in order), so calls opening with the same system prompt and context share a key."""
    text = []
    size = 0
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        piece = f"<{message.get('role', '')}>{content}"
        text.append(piece)
        size += len(piece)
        if size >= chars:
            break
    return f"prefix:{hash64(''.join(text)[:chars]):016x}"


@dataclass(eq=False)
class Endpoint:
    """One replica: its URL, connection pool, breaker, limit, streams in flight and reported load."""

    url: str
    """Base URL, ending in /v1."""
    name: str
    """``host:port``: the metric label and the affinity ring's name for it."""
    http: httpx.AsyncClient
    cooldowns: Cooldowns
    limit: AdaptiveConcurrencyLimit
    """Its adaptive limit, fed by the gateway with this endpoint's TTFTs, tokens, 429/503s and reported queue."""
    load: ServerLoad = field(default_factory=ServerLoad)
    failed_reads: int = 0
    """``/metrics`` reads in a row that timed out or were cut (0 after a good one): ``pool.down_after_failed_reads``
    of them mark it down."""
    down: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while it is marked down (:meth:`EndpointPool.mark_down`), cleared when a read finds it up: what
    :attr:`up` reads, and what a call waiting on it for its first item waits on beside its answer."""
    models: frozenset[str] | None = None
    """The model ids its server's last ``GET /v1/models`` listed (None: not read yet)."""
    relist: bool = False
    """Its model list is to be read again: its server could not be reached, or cut a call, since the list was
    read (it may have been restarted with another model, another context window), until the next read
    succeeds."""
    windows: dict[str, int] | None = None
    """The context window per model id, tokens, as its last ``GET /v1/models`` reported it (vLLM's
    max_model_len; a model it reported none for is absent; None: not read yet)."""
    flavour: ServerFlavour | None = None
    """Its server's flavour: ``model_gateway.server``, or detected from its ``GET /v1/models`` (None: not
    known yet)."""
    refused: set[str] = field(default_factory=set)
    """Body fields its server refused (400/422 naming them): never sent to it again."""
    replica: str = ""
    """Its place in ``model_gateway.pool.endpoints``, from 1, where that list holds several (its errors say
    it: :meth:`GatewayError.from_replica`); "" for one endpoint, and in a DNS-resolved pool (its addresses come
    and go, and no operator named them). Never its address: its ``name`` is one (``host:port``)."""
    stream_label: str | None = None
    """The Content-Type its last event stream came under when that was not ``text/event-stream`` ("": none); None
    while every stream came labelled so (read as events by their body all the same:
    :func:`switchyard.gateway.sse.opens_as_events`)."""

    @property
    def up(self) -> bool:
        """Whether calls may pick it: no failed read or unreachable call since its last good read."""
        return not self.down.is_set()

    @cached_property
    def chat_completions(self) -> str:
        """``{url}/chat/completions``: where its chat calls go, and what their errors name."""
        return f"{self.url}/chat/completions"

    @cached_property
    def chat_completions_url(self) -> httpx.URL:
        """:attr:`chat_completions` parsed once (a string is parsed again by httpx on every request: about
        25 us of the dispatcher's CPU per call)."""
        return httpx.URL(self.chat_completions)

    @cached_property
    def span_attributes(self) -> dict[str, str | int]:
        """The server a call to this endpoint reaches, as OpenTelemetry's HTTP client conventions name it:
        ``server.address`` (the host), ``server.port`` and ``url.full``."""
        url = self.chat_completions_url
        port = url.port or (443 if url.scheme == "https" else 80)
        return {"server.address": url.host, "server.port": port, "url.full": self.chat_completions}

    @property
    def in_flight(self) -> int:
        """Attempts in flight to this endpoint now: its limit's count, the one count of them (kept from
        :meth:`EndpointPool.pick` to :meth:`EndpointPool.finished`). Not the dispatcher's streams
        (:class:`~switchyard.dispatcher.scheduler.capacity.StreamSlots`): a stream between two attempts (the
        gateway's backoff) is on no endpoint."""
        return self.limit.in_flight

    @property
    def limit_value(self) -> int:
        """Its concurrency limit now, streams."""
        return self.limit.streams

    @property
    def ttft_s(self) -> float | None:
        """Its recent TTFT (the limit's fast EWMA), seconds; None before the first sample."""
        return self.limit.short_s


class PoolLimit:
    """The dispatcher's concurrency limit over a pool: what its endpoints' adaptive limits let NORMAL and BATCH
    fill, summed, with one CORE headroom on top (:attr:`reserve`), over the endpoints a call of the default
    model may be placed on now (:meth:`counted`).

    The limit source of the dispatcher's admission
    (:class:`~switchyard.dispatcher.scheduler.capacity.ConcurrencyLimit`: :meth:`admission_limit`,
    :meth:`note_refused`); the streams admitted are counted there
    (:class:`~switchyard.dispatcher.scheduler.capacity.StreamSlots`), each endpoint's attempts by its own limit
    (:attr:`Endpoint.in_flight`). Samples, tokens and overload answers are taken per endpoint by the gateway,
    which knows the endpoint. A refusal tells each endpoint's limit that more streams were wanted than it let
    through (the load, not the limit, is what a window measured otherwise:
    :meth:`AdaptiveConcurrencyLimit.note_refused`).

    One headroom, not one per endpoint: each endpoint's limit is its knee with its own CORE headroom on top,
    and summing those let NORMAL and BATCH fill all but one of them (four endpoints with a knee of 8 each,
    limits of 10: 38 streams, 9.5 per endpoint, past every knee). An endpoint the picker would not place a call
    on (its circuit open, a Retry-After not passed, its model list without the model) is left out of the sum
    too: counted, its share was admitted and sent to the others, past their limits.

    The dispatcher's gauges ``switchyard_upstream_concurrency_limit`` and ``_knee`` show the pool's totals
    (:meth:`EndpointPool.publish_totals`); each endpoint's limit writes its own series of the
    ``switchyard_gateway_endpoint_*`` gauges.
    """

    def __init__(self, pool: "EndpointPool") -> None:
        self.pool = pool

    def counted(self) -> list[Endpoint]:
        """The endpoints whose limits the pool's sums take: those a call of the default model may be placed on
        now (:meth:`EndpointPool.accepts`); else those up; else all of them (so that calls reach the gateway and
        fail naming the endpoints)."""
        endpoints = list(self.pool.endpoints.values())
        up = [e for e in endpoints if e.up]
        model = self.pool.admission_model
        return [e for e in up if self.pool.accepts(e, model)] or up or endpoints

    def admission_limit(self) -> tuple[float, int]:
        """(:attr:`limit`, :attr:`reserve`), from one reading of the endpoints.

        NORMAL and BATCH fill at most the counted endpoints' own ceilings (each endpoint's knee); the CORE headroom
        ``R`` is one for the pool: the largest of the endpoints' own, or the headroom of their limits taken
        together where that is more (endpoints under 4 streams hold none back each: four at 3 hold 2 of their 12
        slots, as one endpoint of 12 would); and the pool never admits more than the endpoints' limits summed, so
        where the headroom does not fit on top of the ceilings it comes out of them."""
        counted = self.counted()
        whole = sum(e.limit.streams for e in counted)
        ceilings = sum(e.limit.lower_class_ceiling for e in counted)
        reserve = max(max((e.limit.reserve for e in counted), default=0),  # none: a DNS pool that resolved none
                      core_reserve(whole, self.pool.config.concurrency.core_reserved_slots))
        # The streams still on an endpoint left out (its circuit opened, a Retry-After came) keep their slots: counted
        # against the others' limits, they left endpoints with room idle while they ran.
        left_out = sum(e.in_flight for e in self.pool.endpoints.values() if e not in counted)
        limit = min(whole, ceilings + reserve) + left_out
        return float(max(limit, self.pool.config.concurrency.min_limit)), reserve

    @property
    def reserve(self) -> int:
        """Slots held back for CORE over the pool (:meth:`admission_limit`): one headroom, never the endpoints'
        sum of them (one endpoint's: its own)."""
        return self.admission_limit()[1]

    @property
    def limit(self) -> float:
        """Streams the dispatcher may have in flight over the pool now (:meth:`admission_limit`): the counted
        endpoints' NORMAL and BATCH ceilings summed plus :attr:`reserve`, at most their limits summed, plus the
        streams still in flight on the endpoints left out (one endpoint: its own limit)."""
        return self.admission_limit()[0]

    def note_refused(self) -> None:
        """The dispatcher refused a stream under this limit: each endpoint whose limit made the sum is told."""
        for endpoint in self.counted():
            endpoint.limit.note_refused()


class EndpointPool:
    """The endpoints of ``model_gateway`` and the picker over them (see the module docstring).

    Args:
        config: ``model_gateway``.
        make_http: builds the HTTP client of one endpoint from its base URL.
    """

    def __init__(self, config: UpstreamConfig, make_http: Callable[[str], httpx.AsyncClient]) -> None:
        self.config = config
        self.pooled = config.pool.pooled
        self._make_http = make_http
        self.endpoints: dict[str, Endpoint] = {}
        self.picker = EndpointPicker(config.pool)
        self.circuit_gauges = CircuitGauges(config)
        """``switchyard_gateway_circuit_state`` over the endpoints (each endpoint's circuits join it)."""
        self.admission_model = model_names.resolve(config.default_model, config.model_map, config.default_model)
        """The upstream model id whose endpoints the admission limit counts (:meth:`PoolLimit.counted`): the
        default model's. A call naming another model is admitted under the same limit."""
        self.limit = PoolLimit(self)
        """The dispatcher's admission limit: the sum of the endpoints' (one endpoint: its own)."""
        self._retired: list[Endpoint] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self.on_answer: Callable[[Endpoint], None] | None = None
        """Called when an endpoint whose model list is to be read again (:attr:`Endpoint.relist`) answers: a
        ``/metrics`` read or a call's first item after it could not be reached. The gateway reads the list."""
        if not config.pool.dns_url:
            self._update(config.endpoint_urls)

    # ------------------------------------------------------------------ membership

    def _update(self, urls: list[str]) -> None:
        by_name = {endpoint_name(u): u for u in urls}
        for name in [n for n in self.endpoints if n not in by_name]:
            gone = self.endpoints.pop(name)
            self._retired.append(gone)
            self.circuit_gauges.leave(gone.cooldowns)
            for gauge in (ENDPOINT_UP, ENDPOINT_IN_FLIGHT, ENDPOINT_LIMIT, ENDPOINT_KNEE, ENDPOINT_WAITING,
                          ENDPOINT_KV_USAGE):
                try:
                    gauge.remove(name)
                except KeyError:
                    pass
            log.info("upstream endpoint %s left the pool (%d left)", gone.url, len(by_name))
        for name, url in by_name.items():
            if name in self.endpoints:
                continue
            endpoint_config = self.config.model_copy(update={"base_url": url})  # errors and breakers name it
            limit = AdaptiveConcurrencyLimit(  # its own series, never the dispatcher's gauges (the pool's totals)
                self.config.concurrency, limit_gauge=ENDPOINT_LIMIT.labels(name),
                knee_gauge=ENDPOINT_KNEE.labels(name), in_flight_gauge=ENDPOINT_IN_FLIGHT.labels(name),
            )
            endpoint = Endpoint(url, name, self._make_http(url),
                                Cooldowns(endpoint_config, gauges=self.circuit_gauges), limit)
            listed = self.config.pool.endpoints
            if len(listed) > 1 and url in listed:
                endpoint.replica = str(listed.index(url) + 1)
            endpoint.cooldowns.health_check = functools.partial(self.answers, endpoint)
            self.endpoints[name] = endpoint
            if self.pooled:
                ENDPOINT_UP.labels(name).set(1)
                ENDPOINT_WAITING.labels(name).set(-1)
                ENDPOINT_KV_USAGE.labels(name).set(-1)
                log.info("upstream endpoint %s joined the pool", url)
        self.picker.sync(list(self.endpoints))
        self.publish_totals()

    async def _resolve(self) -> None:
        url = self.config.pool.dns_url
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await resolve_addresses(host, port)
        except OSError as exc:
            log.warning("resolving %s failed (%s); keeping %d endpoint(s)", url, exc, len(self.endpoints))
            return
        if addresses:
            self._update([urlunsplit((parts.scheme, netloc, parts.path, "", "")) for netloc in addresses])

    async def start(self) -> None:
        """Resolve a DNS pool once (waiting for it) and start the background reads; for one endpoint, only the
        read of its server's queue (:meth:`_queue_loop`)."""
        if self._started:
            return
        self._started = True
        if not self.pooled:
            self._tasks.append(asyncio.create_task(self._queue_loop(), name="upstream-queue"))
            return
        if self.config.pool.dns_url:
            await self._resolve()
            self._tasks.append(asyncio.create_task(self._resolve_loop(), name="upstream-resolve"))
        self._tasks.append(asyncio.create_task(self._scrape_loop(), name="upstream-scrape"))

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.pool.resolve_interval_s)
            await self._resolve()

    # ------------------------------------------------------------------ health and load

    async def answers(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint``'s server answers HTTP now (its ``GET /models``, any status below 500; a 401 is
        a server that is up): the health check its circuits read while open
        (:attr:`switchyard.gateway.cooldown.Cooldowns.health_check`)."""
        try:
            response = await self._get_within(endpoint, "models")
        except httpx.HTTPError:
            return False
        return response.status_code < 500

    async def _get_within(self, endpoint: Endpoint, url: str) -> httpx.Response:
        """``GET url`` of ``endpoint``, its whole answer within ``pool.scrape_timeout_s`` (:func:`get_whole`): a
        server sending its body a byte at a time held a /metrics read or a health check for as long as it went on,
        so a hung endpoint was never marked down, and its circuit's health checks (one at a time) stopped.

        Raises:
            httpx.HTTPError: the transport failed; httpx.ReadTimeout when the whole answer did not come in time.
        """
        timeout_s = self.config.pool.scrape_timeout_s
        return await get_whole(endpoint.http, url, timeout_s, "model_gateway.pool.scrape_timeout_s", timeout=timeout_s)

    async def _queue_loop(self) -> None:
        """One endpoint: read its server's queue every ``scrape_interval_s`` for its limit, until a read that the
        server answers shows none (a server that exports no queue depth, such as ``transformers
        serve`` or a hosted API, is not asked again)."""
        endpoint = next(iter(self.endpoints.values()))
        while True:
            if await self.scrape(endpoint) and endpoint.load.waiting is None:
                log.info("upstream %s reports no queue depth on %s: the limit goes by what it measures alone",
                         endpoint.url, self.config.pool.metrics_path)
                return
            await asyncio.sleep(self.config.pool.scrape_interval_s)

    async def scrape(self, endpoint: Endpoint) -> bool:
        """Read ``endpoint``'s ``/metrics`` once: its load, and whether it is up. True when the server answered."""
        url = server_root(endpoint.url) + self.config.pool.metrics_path
        try:
            response = await self._get_within(endpoint, url)
        except httpx.TransportError as exc:
            endpoint.failed_reads += 1
            if (isinstance(exc, httpx.ConnectError)  # nothing listens: down now
                    or endpoint.failed_reads >= self.config.pool.down_after_failed_reads):
                in_a_row = f" ({endpoint.failed_reads} reads in a row)" if endpoint.failed_reads > 1 else ""
                self.mark_down(endpoint, f"/metrics: {type(exc).__name__}: {exc}{in_a_row}")
            return False
        endpoint.failed_reads = 0
        if not self.holds(endpoint):  # it left the pool during the read (a re-resolve): its series are gone
            return True
        self._answered(endpoint)
        load = ServerLoad()
        if response.status_code == 200:
            try:
                load = parse_server_load(response.text)
            except ValueError:
                pass  # not Prometheus text: no figures, still up
        endpoint.load = load
        if load.waiting is not None:  # its own queue: past its knee when > 0
            endpoint.limit.on_server_queue(load.waiting)
            self.publish_totals()
        if not self.pooled:  # one endpoint: its queue for its limit, nothing picked or marked
            return True
        ENDPOINT_WAITING.labels(endpoint.name).set(-1 if load.waiting is None else load.waiting)
        ENDPOINT_KV_USAGE.labels(endpoint.name).set(-1 if load.kv_cache_usage is None else load.kv_cache_usage)
        if not endpoint.up:
            log.info("upstream endpoint %s is up again", endpoint.url)
        endpoint.down.clear()
        ENDPOINT_UP.labels(endpoint.name).set(1)
        self.publish_totals()
        return True

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(e) for e in list(self.endpoints.values())), return_exceptions=True)
            for gone in [e for e in self._retired if e.in_flight == 0]:
                self._retired.remove(gone)
                await gone.cooldowns.aclose()
                await gone.http.aclose()
            await asyncio.sleep(self.config.pool.scrape_interval_s)

    def holds(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` is one of the pool's now: False once a re-resolve dropped its address (a call
        or a ``/metrics`` read begun before may still end on it)."""
        return self.endpoints.get(endpoint.name) is endpoint

    def _answered(self, endpoint: Endpoint) -> None:
        """``endpoint``'s server answered: its model list is read again (:attr:`on_answer`) if it could not be
        reached since it was read."""
        if endpoint.relist and self.on_answer is not None:
            endpoint.relist = False  # the read sets it again if it fails
            self.on_answer(endpoint)

    @staticmethod
    def lost(endpoint: Endpoint) -> None:
        """A call to ``endpoint`` failed in transport (refused, or cut: a server restarting closes its
        connections): its model list is read again once it answers, alone or in a pool (a restarted server may
        serve another model, or another context window)."""
        endpoint.relist = True

    def mark_down(self, endpoint: Endpoint, why: str) -> None:
        """``endpoint`` could not be reached: no call picks it until a ``/metrics`` read succeeds, and the calls
        on it that have streamed nothing yet are sent to another endpoint (pools only); its model list is read
        again once it answers (:meth:`lost`)."""
        self.lost(endpoint)
        if not self.pooled:
            return
        if not self.holds(endpoint):  # it left the pool (a re-resolve): its calls move on, its series stay gone
            endpoint.down.set()
            return
        if endpoint.up:
            if any(e.up for e in self.endpoints.values() if e is not endpoint):
                log.warning("upstream endpoint %s is down (%s); its calls go to the other endpoints", endpoint.url, why)
            else:
                log.warning("upstream endpoint %s is down (%s); no endpoint of model_gateway.pool is up: calls fail "
                            "UNAVAILABLE until one answers its /metrics again", endpoint.url, why)
        endpoint.down.set()  # a call still waiting there for its first item goes to another endpoint
        ENDPOINT_UP.labels(endpoint.name).set(0)
        self.publish_totals()

    # ------------------------------------------------------------------ calls

    def pick(self, key: str, tried: frozenset[str] = frozenset(), model: str = "") -> tuple[Endpoint, Picked]:
        """The endpoint for one attempt of a call of ``model`` with affinity key ``key``; it counts as in flight
        until :meth:`finished`. An endpoint whose circuit for ``model`` refuses calls now (open, half-open with
        its probes taken, or a Retry-After not yet passed), or whose model list does not name ``model`` (a
        replica restarted with another model), is left out while another is left (affinity would otherwise send
        most calls there first, to be refused and moved on).

        Raises:
            LookupError: every endpoint is down or in ``tried``.
        """
        endpoints = list(self.endpoints.values())
        if len(endpoints) == 1 and not self.pooled:
            picked = Picked(endpoints[0].name, "load")
        else:
            now = time.monotonic()
            refusing = frozenset(e.name for e in endpoints if not self.accepts(e, model))
            if any(e.name not in tried and e.name not in refusing for e in endpoints):
                tried = tried | refusing
            picked = self.picker.pick(endpoints, key, now, tried)
            ENDPOINT_PICKS.labels(picked.reason).inc()
        endpoint = self.endpoints[picked.name]
        endpoint.limit.started()
        return endpoint, picked

    def accepts(self, endpoint: Endpoint, model: str) -> bool:
        """Whether a call of ``model`` may be placed on ``endpoint`` now, up or not: its circuit for ``model``
        does not refuse calls (open, half-open with its probes taken, a Retry-After not passed) and its model
        list names ``model``. The one rule of both the picker (:meth:`pick`) and the admission limit
        (:meth:`PoolLimit.counted`). True for every endpoint when ``model`` is empty."""
        return not model or (not endpoint.cooldowns.refusing(model) and self.lists(endpoint, model))

    @staticmethod
    def lists(endpoint: Endpoint, model: str) -> bool:
        """Whether ``endpoint``'s model list names ``model`` (True while its list has not been read)."""
        return endpoint.models is None or model_names.listed(model, endpoint.models)

    def expected_ttft_s(self, model: str) -> float:
        """Seconds an attempt of ``model`` is expected to take to its first item: the fastest recent TTFT
        (:attr:`Endpoint.ttft_s`, which its limit keeps) among the endpoints up that list ``model``; 0.0 before
        any was measured. A retry that would not leave this much before the call's deadline after its wait is
        not started (:func:`switchyard.gateway.resilience.with_retries`)."""
        measured = [e.ttft_s for e in self.endpoints.values()
                    if e.ttft_s is not None and e.up and self.lists(e, model)]
        return min(measured, default=0.0)

    def finished(self, endpoint: Endpoint, error: GatewayError | None = None) -> None:
        """A call :meth:`pick` placed on ``endpoint`` ended, with ``error`` or none; an error that says the
        upstream refused load (:attr:`GatewayError.refuses_load`: a 429 or 503, answered or inside the stream)
        backs its limit off first, while the call still counts in flight: one bounded step, given the wait its
        Retry-After asked for (:meth:`AdaptiveConcurrencyLimit.on_overload`)."""
        if error is not None and error.refuses_load:
            endpoint.limit.on_overload(time.monotonic(), error.retry_after_s)
        endpoint.limit.ended()
        self.publish_totals()

    def on_first_item(self, endpoint: Endpoint, ttft_s: float) -> None:
        """``endpoint`` streamed its first item ``ttft_s`` seconds after the request was sent."""
        endpoint.limit.on_sample(ttft_s)
        self.publish_totals()
        self._answered(endpoint)

    def on_whole_answer(self, endpoint: Endpoint, tokens: int) -> None:
        """``endpoint`` answered a stream request with the whole completion, ``tokens`` of it: it answers, and its
        limit counts the tokens; no time to first token is sampled (the wait was the whole answer's, not a
        prefill's, and would brake the limit as a TTFT rising)."""
        endpoint.limit.on_tokens(tokens)
        self.publish_totals()
        self._answered(endpoint)

    def on_tokens(self, endpoint: Endpoint, count: int) -> None:
        """``endpoint`` streamed ``count`` tokens (its limit measures its throughput from them)."""
        endpoint.limit.on_tokens(count)

    def publish_totals(self) -> None:
        """The dispatcher's limit and knee gauges: the admission limit over the pool (:attr:`PoolLimit.limit`)
        and the sum of the knees the same endpoints have measured (0 until one has)."""
        UPSTREAM_LIMIT.set(self.limit.limit)
        UPSTREAM_KNEE.set(sum(e.limit.knee or 0 for e in self.limit.counted()))

    async def aclose(self) -> None:
        """Stop the background reads and close every endpoint's connections."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for endpoint in [*self.endpoints.values(), *self._retired]:
            await endpoint.cooldowns.aclose()
            await endpoint.http.aclose()
