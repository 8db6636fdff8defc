"""``queue.json`` ``model_gateway``: the OpenAI-compatible model server(s) the ``openai`` engine streams from."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator, model_validator

from switchyard.common.affinity import DEFAULT_BALANCE
from switchyard.common.config.base import _Strict
from switchyard.common.priority import LABELS, ClassLabel


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")



URL_EXPECTED = "an http:// or https:// URL with a host, a port in 1-65535 and no credentials"
"""What a model server's URL (``base_url``, ``pool.endpoints``, ``pool.dns_url``) must be, in a refusal's words."""


def url_problem(url: str) -> str:
    """What keeps ``url`` from being a model server's address the gateway calls, as ``urllib.parse`` finds it (a
    port past 65535 or 0, a bracket left open, no host), or credentials in it (``user:password@``): the gateway
    authenticates with ``api_key_env``'s key as a bearer token, which they contradict (aiohttp, the default
    transport, refused every call carrying both, a ValueError), and the URL is named in errors, logs and spans;
    "" when nothing does."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError past 65535
    except ValueError as exc:
        return str(exc)
    if port == 0:  # a port to listen on (any free one), never one to connect to: every call was refused
        return "port 0 names no server"
    if any(ch.isspace() for ch in parts.netloc):  # 'http://a b/v1' loaded, and every call failed to resolve 'a b'
        return "a space in the host"
    if "@" in parts.netloc:
        return ("it holds credentials (user:password@): give the key in model_gateway.api_key_env, sent as a "
                "bearer token")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        # Azure OpenAI's deployment URLs carry ?api-version=...: the gateway appends /chat/completions and /models
        # to the path, and every call went to '...?api-version=2024-02-01/chat/completions'
        return ("a query or fragment ('?...', '#...'): the gateway appends /chat/completions and /models to the "
                "URL's path and carries no query; for Azure OpenAI use its v1 API, https://NAME.openai.azure.com/openai/v1")
    path = parts.path.rstrip("/")
    for endpoint in ENDPOINT_PATHS:
        if path.endswith(endpoint):
            # the server's endpoint pasted for its root: every call went to '.../v1/chat/completions/chat/completions'
            # and failed NOT_FOUND, with the stack reported healthy
            root = urlunsplit(parts._replace(path=path[:-len(endpoint)]))
            return (f"it ends in {endpoint}, an endpoint the gateway appends itself (it calls /chat/completions and "
                    f"/models under the URL): give the API's root, {root}")
    return "" if parts.hostname else "no host"


ENDPOINT_PATHS = ("/chat/completions", "/completions", "/models")
"""Paths under an OpenAI-compatible root that a base URL must not end in: the gateway appends them itself."""

class CooldownConfig(_Strict):
    """Circuit breaker per upstream model (LiteLLM's "cooldowns"): a model that keeps failing is
    skipped, its requests going to the fallback model, until the cooldown has passed."""

    enabled: bool = Field(True, description="Skip a failing model for cooldown_s after `failures` failures in a row.")
    failures: int = Field(
        5, ge=1, le=1000,
        description="Upstream failures in a row, count (5xx, timeouts, cut connections; never a 429 or the request's "
        "own fault) that open the circuit.",
    )
    first_cooldown_s: float = Field(
        2.0, gt=0, le=3600,
        description="How long a model is skipped the first time its circuit opens, seconds; each reopening (a "
        "half-open probe failed) doubles it, up to cooldown_s, and closing starts over (resilience4j's "
        "exponential wait in the open state): a server back after a restart is tried again within seconds, one "
        "that stays down is tried ever less often. At cooldown_s or more, every opening lasts cooldown_s.",
    )
    cooldown_s: float = Field(
        30.0, gt=0, le=3600,
        description="The longest a model is skipped once open, seconds (see first_cooldown_s); then the circuit is "
        "half-open and admits half_open_probes trial requests (LiteLLM's cooldown time is configured the same way). "
        "Also the longest a wait an upstream asked for (Retry-After) is held locally, with the breaker enabled or "
        "not: a longer one is asked again after it.",
    )
    half_open_probes: int = Field(
        1, ge=1, le=1000,
        description="Trial requests a half-open circuit admits at once, requests; every other request is refused at "
        "once until they end (goes to the fallback model or another endpoint), except one with nowhere else to "
        "go, which waits for their outcome within its deadline. The circuit closes when this many have "
        "succeeded and opens again on the first that fails (resilience4j's permittedNumberOfCallsInHalfOpenState).",
    )
    health_check_interval_s: float = Field(
        1.0, gt=0, le=3600,
        description="While a circuit is open, its endpoint's GET /models is read this often, seconds (in the "
        "background, and on a refused call, never more often); an answer (any status below 500) half-opens the "
        "circuit at once, so a model server back after a restart is served within about this long however far "
        "the open period has doubled, with no call refused first.",
    )


MEMORY_WINDOWS = 10
"""``memory_s`` must hold at least this many windows of ``window_s``: a level is measured in two windows before it
counts (switchyard.dispatcher.adaptive_limit.PROBE_WINDOWS), a window in which the streams ramped counts for none,
and the knee's level must outlast two at the knee and a ramp and two at each probe around it; with fewer the knee's
level was forgotten while the probe above it was measured, and the limit ran away (142-386 streams in front of a
server whose knee is 8; at 6 windows, 17 for a knee of 8, at 8 windows 9: 10 leaves a margin)."""


class AdaptiveConcurrencyConfig(_Strict):
    """Adaptive limit on streams in flight to the upstream (switchyard.dispatcher.adaptive_limit)."""

    min_limit: int = Field(1, ge=1, le=100_000, description="Floor of the limit, streams (in a pool, of each "
                           "endpoint's limit and of the dispatcher's total).")
    max_limit: int = Field(1024, ge=1, le=100_000, description="Ceiling of the limit, streams (in a pool, of each "
                           "endpoint's; the dispatcher admits what NORMAL and BATCH may fill on each, summed, and one CORE headroom).")
    initial_limit: int = Field(
        4, ge=1, le=100_000,
        description="Limit at start-up, streams; the limit climbs from here, measuring throughput at each level "
        "on the way up (start low: levels above the knee are found, levels below it only by passing them). "
        "Also the least a knee known only from a light load counts as (that load's level says nothing of the "
        "server's knee).",
    )
    ttft_tolerance: float = Field(
        2.0, ge=1, le=100,
        description="A window's mean TTFT may rise to this multiple of the TTFT measured before at the same "
        "concurrency before the limit shrinks, a ratio (>= 1).",
    )
    smoothing: float = Field(
        0.5, gt=0, le=1,
        description="Weight of each new target in the limit once the knee is known, a fraction in (0, 1].",
    )
    window_s: float = Field(
        0.5, gt=0, le=60,
        description="Length of one throughput measurement (tokens received / seconds, beside the mean streams in "
        "flight over it), seconds; the limit moves once per window.",
    )
    knee_fraction: float = Field(
        0.9, ge=0.7, lt=1,
        description="The knee is the lowest concurrency whose measured throughput reaches this fraction of the "
        "plateau (the mean throughput of the concurrencies measured from it up), a fraction in [0.7, 1): at 2/3 "
        "or less a level and the one twice as high that confirms it reach it on any linear curve, and the limit "
        "went to 1 stream in front of any server.",
    )
    memory_s: float = Field(
        30.0, gt=0, le=3600,
        description="How long one concurrency level's throughput and TTFT count after it was last measured, "
        "seconds; levels above the knee age out and are measured again by probing. At least "
        f"{MEMORY_WINDOWS} x window_s (a level must outlast two windows at the knee, a ramp, and two at each probe "
        "around it).",
    )
    core_reserved_slots: int = Field(
        2, ge=0, le=100_000,
        description="Slots of the limit held back for CORE streams, streams: NORMAL and BATCH wait in the "
        "dispatcher's queue once in flight reaches limit - (core_reserved_slots - CORE in flight); the limit "
        "always leaves at least one slot any class may take. CORE may start while fewer than min(this, limit // 4) "
        "CORE streams are in flight even when the limit is taken (by streams admitted before it came down).",
    )
    backoff_ratio: float = Field(
        0.5, gt=0, lt=1,
        description="Factor of the limit's one step down on a 429, 503 or 529 (overloaded), a fraction in (0, 1): a "
        "refusal takes the limit down to the other streams in flight but never below this times itself; one with "
        "nothing else in flight, or asking a Retry-After wait, steps once per TTFT or per that wait.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> "AdaptiveConcurrencyConfig":
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(
                f"expected min_limit <= initial_limit <= max_limit, got {self.min_limit}, "
                f"{self.initial_limit}, {self.max_limit}"
            )
        if self.memory_s < MEMORY_WINDOWS * self.window_s:
            raise ValueError(
                f"expected memory_s >= {MEMORY_WINDOWS} x window_s (a level must outlast the probes around it), "
                f"got memory_s {self.memory_s} with window_s {self.window_s}"
            )
        return self


class EndpointScorerWeights(_Strict):
    """Weights of the endpoint picker's scorers (switchyard.gateway.picker); each scorer gives 0-1 per endpoint,
    the endpoint with the highest weighted sum serves the call. 0 turns a scorer off."""

    prefix_affinity: float = Field(
        4.0, ge=0, le=100,
        description="Weight of the affinity scorer, a multiplier: 1 for the endpoint that holds the call's agent "
        "(or prompt prefix) under the bounded-load rule, 0 for the others.",
    )
    queue_depth: float = Field(
        1.0, ge=0, le=100,
        description="Weight of the server's own queue, a multiplier: 1 / (1 + requests waiting), from its /metrics "
        "(vLLM vllm:num_requests_waiting, SGLang sglang:num_queue_reqs, TGI tgi_queue_size).",
    )
    kv_cache_usage: float = Field(
        1.0, ge=0, le=100,
        description="Weight of the server's free KV cache, a multiplier: 1 - KV cache used (a fraction), from its "
        "/metrics (vLLM vllm:kv_cache_usage_perc, SGLang sglang:token_usage).",
    )
    in_flight: float = Field(
        1.0, ge=0, le=100,
        description="Weight of the endpoint's headroom, a multiplier: 1 - streams in flight / its concurrency limit.",
    )
    ttft: float = Field(
        1.0, ge=0, le=100,
        description="Weight of the endpoint's measured TTFT, a multiplier: fastest recent TTFT / this endpoint's.",
    )


class UpstreamPoolConfig(_Strict):
    """Several replicas of one OpenAI-compatible model server behind ``model_gateway`` (switchyard.gateway.pool):
    ``queue.json`` ``model_gateway.pool``. Empty ``endpoints`` and ``dns_url``: ``base_url`` alone is served."""

    endpoints: list[str] = Field(
        default_factory=list,
        description="Base URLs of the replicas, each an OpenAI-compatible root ending in /v1; replaces base_url.",
    )
    dns_url: str = Field(
        "",
        description="A base URL whose host name resolves to every replica (a Kubernetes headless Service); each "
        "address is an endpoint, re-resolved every resolve_interval_s. Empty: not used.",
    )
    resolve_interval_s: float = Field(10.0, gt=0, le=3600, description="Seconds between DNS resolutions of dns_url.")
    scrape_interval_s: float = Field(
        0.5, gt=0, le=600,
        description="Seconds between reads of each endpoint's /metrics (its queue depth and KV use; a connection "
        "refused there marks the endpoint down until a read succeeds).",
    )
    scrape_timeout_s: float = Field(1.0, gt=0, le=60, description="Longest wait for one /metrics read or health "
                                    "check, its whole answer, seconds.")
    down_after_failed_reads: int = Field(
        2, ge=1, le=100,
        description="Consecutive /metrics reads that time out or are cut that mark an endpoint down (no call "
        "picks it, and the calls on it that have streamed nothing move to another): one slow read of a busy "
        "server's /metrics is not a hung server. A refused connection marks it down at once.",
    )
    metrics_path: str = Field(
        "/metrics", pattern=r"^/", description="Path of the Prometheus metrics under the server's root (the base URL "
        "without /v1), a path.",
    )
    balance: float = Field(
        DEFAULT_BALANCE, gt=1, le=10,
        description="Bounded-load rule of the affinity scorer, a ratio: an endpoint keeps its agents' calls until it "
        "has more than this times the mean calls in flight, then the overflow goes to the next endpoint on the "
        "ring (switchyard.common.affinity).",
    )
    affinity_idle_s: float = Field(
        60.0, gt=0, le=86_400,
        description="An agent or prompt prefix with no call for this long, seconds, stops counting on its endpoint.",
    )
    prefix_chars: int = Field(
        1024, ge=16, le=1_000_000,
        description="Characters of the prompt (messages in order) hashed into the affinity key of a call that names "
        "no agent, characters: calls opening with the same text go to the endpoint that has it cached.",
    )
    policy: Literal["score", "round_robin"] = Field(
        "score",
        description="How a call picks its endpoint: 'score' (filter, then the weighted scorers, then the best) or "
        "'round_robin' (each endpoint in turn, as a plain load balancer does; for comparison).",
    )
    weights: EndpointScorerWeights = Field(
        default_factory=EndpointScorerWeights, description="Weights of the endpoint picker's scorers."
    )

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")) or url_problem(url):
                raise ValueError(f"expected {URL_EXPECTED} each, got {url!r}"
                                 + (f" ({url_problem(url)})" if url_problem(url) else ""))
        urls = [url.rstrip("/") for url in value]
        if len(set(urls)) != len(urls):
            raise ValueError(f"expected distinct URLs, got {value}")
        return urls

    @field_validator("dns_url")
    @classmethod
    def _dns_url(cls, value: str) -> str:
        if value and (not value.startswith(("http://", "https://")) or url_problem(value)):
            raise ValueError(f"expected {URL_EXPECTED}, or empty"
                             + (f" ({url_problem(value)})" if value and url_problem(value) else ""))
        return value.rstrip("/")

    @model_validator(mode="after")
    def _one_source(self) -> "UpstreamPoolConfig":
        if self.endpoints and self.dns_url:
            raise ValueError(f"endpoints ({self.endpoints}) and dns_url ({self.dns_url!r}): set one, not both")
        return self

    @property
    def pooled(self) -> bool:
        """True when several endpoints are (or may be) served: a list of more than one, or a DNS name."""
        return len(self.endpoints) > 1 or bool(self.dns_url)


class UpstreamConfig(_Strict):
    """The OpenAI-compatible model server the ``openai`` engine streams from (switchyard.gateway):
    ``queue.json`` ``model_gateway``."""

    base_url: str = Field(
        "http://127.0.0.1:8400/v1",
        description="OpenAI-compatible base URL, ending in /v1; no credentials in it (user:password@): the key goes "
        "in api_key_env.",
    )
    api_key_env: str = Field("TAOTOKEN_API_KEY", description="Name of the environment variable holding the API key (a name, not the key).")
    default_model: str = Field("claude-sonnet-4-5", min_length=1, description="Model id used when a request names none.")
    fallback_model: str = Field(
        "gpt-4o-mini", description="Model id tried when the primary model fails before its first token; empty (in the "
        "environment: SWITCHYARD_UPSTREAM_FALLBACK_MODEL=none, since an empty variable counts as unset) disables fallback."
    )
    model_map: dict[str, str] = Field(
        default_factory=dict, description="Client-facing model name -> upstream model id; unmapped names pass through."
    )
    api_key_required: bool = Field(
        True, description="Refuse to call upstream without a key; false for local servers that take none (vLLM, Ollama)."
    )
    server: Literal["auto", "vllm", "sglang", "tgi", "llama_cpp", "transformers", "ollama", "openai"] = Field(
        "auto",
        description="Which model server base_url is, for its priority field and polarity (switchyard.gateway.servers); "
        "auto reads it from GET /v1/models (owned_by) and the server header.",
    )
    forward_priority: bool = Field(
        False,
        description="Send the priority class in the server's own priority field (vLLM and SGLang 'priority'); "
        "nothing for servers without one. A field the server refuses (400/422 naming it) is dropped for the "
        "endpoint and the request retried without it.",
    )
    priority_values: dict[ClassLabel, int] = Field(
        default_factory=lambda: {"core": 0, "normal": 1, "batch": 2},
        description="Priority per class, an integer on vLLM's scale (lower is served earlier); mirrored "
        "(max - value) for a server that serves higher values first (SGLang).",
    )
    priority_polarity: Literal["server_default", "lower_first", "higher_first"] = Field(
        "server_default",
        description="Which priority values the server serves first: its default (vLLM lower, SGLang higher), or "
        "as set here (lower_first for SGLang started with --schedule-low-priority-values-first).",
    )
    include_usage: bool = Field(
        True, description="Ask for token usage in streams (stream_options.include_usage)."
    )
    connect_timeout_s: float = Field(5.0, gt=0, le=600, description="TCP/TLS connect timeout, seconds.")
    read_timeout_s: float = Field(60.0, gt=0, le=3600, description="Longest silence between bytes from upstream, seconds.")
    write_timeout_s: float = Field(10.0, gt=0, le=600, description="Longest time to send the request body, seconds.")
    pool_timeout_s: float = Field(5.0, gt=0, le=600, description="Longest wait for a pooled connection, seconds.")
    total_timeout_s: float = Field(300.0, gt=0, le=86_400, description="Longest time for one whole completion, seconds.")
    max_connections: int = Field(1024, ge=1, le=10_000, description="Connections in the HTTP pool, connections.")
    max_keepalive_connections: int = Field(
        1024, ge=0, le=10_000,
        description="Idle connections kept open, connections (httpx transport; aiohttp keeps every idle connection "
        "of the pool for 5 s).",
    )
    http_transport: Literal["aiohttp", "httpx"] = Field(
        "aiohttp",
        description="What carries the HTTP requests under httpx's client API: aiohttp's connection pool and C "
        "parser (httpx-aiohttp, the transport the OpenAI Python SDK offers for concurrency), or httpx's own "
        "(httpcore). httpcore checks every pooled connection for each request it places; at a hundred concurrent "
        "streams the dispatcher served 1.4-1.6x the streams on aiohttp (docs/benchmarks.md). "
        "Requests through a proxy (HTTPS_PROXY...) always use httpx's own.",
    )
    max_retries: int = Field(2, ge=0, le=20, description="Retries per model before the first token (tenacity), retries.")
    retry_backoff_initial_s: float = Field(0.2, ge=0, le=60, description="First retry wait, seconds; doubles per retry, with jitter.")
    retry_backoff_max_s: float = Field(2.0, ge=0, le=600, description="Longest retry wait, seconds.")
    retry_after_max_s: float = Field(
        30.0, ge=0, le=3600, description="Longest wait honoured from an upstream's Retry-After, seconds."
    )
    cooldown: CooldownConfig = Field(
        default_factory=CooldownConfig, description="Circuit breaker per upstream model (cooldown after failures)."
    )
    concurrency: AdaptiveConcurrencyConfig = Field(
        default_factory=AdaptiveConcurrencyConfig,
        description="Adaptive limit on streams in flight to the upstream (TTFT gradient, backoff on 429/503); with a "
        "pool, one such limit per endpoint.",
    )
    pool: UpstreamPoolConfig = Field(
        default_factory=UpstreamPoolConfig,
        description="Several replicas of the model server: their URLs or a DNS name, and how a call picks one.",
    )

    @property
    def endpoint_urls(self) -> list[str]:
        """The base URLs served before any DNS resolution: ``pool.endpoints``, else ``[base_url]``."""
        return list(self.pool.endpoints) or [self.base_url]

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL")
        problem = url_problem(value)
        if problem:
            raise ValueError(f"expected {URL_EXPECTED} ({problem})")
        return value.rstrip("/")

    @field_validator("default_model", "fallback_model")
    @classmethod
    def _model_id(cls, value: str) -> str:
        if value and not value.strip():
            raise ValueError("expected a model id, not blank")
        return value

    @field_validator("model_map")
    @classmethod
    def _model_ids(cls, value: dict[str, str]) -> dict[str, str]:
        blank = sorted(name for name, target in value.items() if not name.strip() or not target.strip())
        if blank:
            raise ValueError(f"expected a non-blank name and upstream model id for each entry, got {blank!r} blank")
        return value

    @field_validator("priority_values")
    @classmethod
    def _every_class(cls, value: dict[str, int]) -> dict[str, int]:
        missing = [c for c in LABELS if c not in value]
        if missing:  # a class without a value would be sent with none: on vLLM that is 0, CORE's own
            raise ValueError(f"expected a value for each of core, normal and batch; missing {', '.join(missing)}")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError("expected an environment variable name such as TAOTOKEN_API_KEY")
        return value

    @model_validator(mode="after")
    def _gateway_pairs(self) -> "UpstreamConfig":
        if self.max_keepalive_connections > self.max_connections:
            raise ValueError(
                f"max_keepalive_connections ({self.max_keepalive_connections}) must not exceed "
                f"max_connections ({self.max_connections})"
            )
        if self.concurrency.max_limit > self.max_connections:
            raise ValueError(
                f"concurrency.max_limit ({self.concurrency.max_limit}) must not exceed max_connections "
                f"({self.max_connections}): every stream the limit allows needs a pooled connection"
            )
        if self.retry_backoff_max_s < self.retry_backoff_initial_s:
            raise ValueError(
                f"retry_backoff_max_s ({self.retry_backoff_max_s}) must not be below "
                f"retry_backoff_initial_s ({self.retry_backoff_initial_s})"
            )
        return self
