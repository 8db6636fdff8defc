"""Prometheus metrics of the model gateway. Labels carry model ids and status names, never keys."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import Counter, Gauge, Histogram

from switchyard.common.metrics import STATUS_CODES

GATEWAY_REQUESTS = Counter(
    "switchyard_gateway_requests_total",
    "Chat completions sent upstream, by upstream model and outcome (ok or the gRPC status name; CANCELLED: the "
    "caller went away or its deadline ran out).",
    ["model", "outcome"],
)
GATEWAY_RETRIES = Counter(
    "switchyard_gateway_retries_total", "Retries of an upstream call before its first token.", ["model"]
)
GATEWAY_FALLBACKS = Counter(
    "switchyard_gateway_fallbacks_total",
    "Requests served by the fallback model after the primary failed before its first token.",
    ["model", "fallback_model"],
)
GATEWAY_TTFT = Histogram(
    "switchyard_gateway_upstream_ttft_seconds",
    "Upstream call sent -> first streamed item, including retries and fallback.",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
OUTCOMES = ("ok", *(code for code in STATUS_CODES if code != "OK"))
"""``switchyard_gateway_requests_total``'s outcome values: ok, or the gRPC status name of the failure."""


def start_at_zero(models: Iterable[str], fallback_models: Iterable[str]) -> None:
    """Start the gateway's request, retry and fallback counters and its TTFT histogram at 0 for every model
    label in ``models`` (the configured models' labels and ``other``), falling back to each of
    ``fallback_models``' labels."""
    fallbacks = set(fallback_models)
    for model in models:
        GATEWAY_RETRIES.labels(model)
        GATEWAY_TTFT.labels(model)
        for outcome in OUTCOMES:
            GATEWAY_REQUESTS.labels(model, outcome)
        for fallback in fallbacks - {model}:
            GATEWAY_FALLBACKS.labels(model, fallback)


CIRCUIT_STATES = ("closed", "open", "half_open")
"""The states of an upstream model's circuit (gateway/cooldown.py)."""
CIRCUIT_TRANSITIONS = (("closed", "open"), ("open", "half_open"), ("half_open", "open"), ("half_open", "closed"))
"""The moves a circuit makes, (from_state, to_state)."""
GATEWAY_CIRCUIT_STATE = Gauge(
    "switchyard_gateway_circuit_state",
    "Endpoints whose circuit for the upstream model is in this state (closed, open: cooling down after repeated "
    "failures, half_open: admitting its probes); with one endpoint, 1 for its state and 0 for the others.",
    ["model", "state"],
)
GATEWAY_CIRCUIT_TRANSITIONS = Counter(
    "switchyard_gateway_circuit_transitions_total",
    "Moves of an upstream model's circuit between states (closed -> open is a cooldown beginning).",
    ["model", "from_state", "to_state"],
)

STREAM_ENDINGS = ("done_marker", "finish_reason", "whole_answer", "error", "cut", "timeout", "cancelled")
"""How an upstream stream ended: ``data: [DONE]``; a clean end after a ``finish_reason`` with no marker
(``transformers serve``); no stream but the whole chat completion as JSON (a server or proxy ignoring
``stream``); an error object inside the stream, or a chunk that cannot be read; cut (the connection broke, or the
body ended before any ``finish_reason``); timeout (the body went silent past ``model_gateway.read_timeout_s``, or
the call ran past ``total_timeout_s``); or cancelled (the gateway stopped reading it before it ended: its caller
left or ran out of its own deadline, or a pool's endpoint was marked down while the call waited for its first
item). Each stream the server answered is counted once, so the endings add up to the streams opened."""
UPSTREAM_STREAM_ENDINGS = Counter(
    "switchyard_upstream_stream_endings_total",
    "Upstream completion streams by how they ended: done_marker (data: [DONE]), finish_reason (the body ended "
    "after a choice's finish_reason, without the marker), whole_answer (the whole chat completion as JSON, no "
    "stream), error (an error object inside the stream, or a chunk that cannot be read), cut (connection broken, "
    "or ended before any finish_reason), timeout (silent past model_gateway.read_timeout_s, or past "
    "total_timeout_s) or cancelled (no longer read before it ended: its caller left or ran out of time).",
    ["ending"],
)
for _ending in STREAM_ENDINGS:
    UPSTREAM_STREAM_ENDINGS.labels(_ending)
# --------------------------------------------------------------------------- a pool of replicas (gateway/pool.py)
# The endpoint label is one of the pool's endpoints (host:port), a set as large as the pool; an endpoint's
# series are removed when it leaves the pool (its DNS name stops listing it).

ENDPOINT_UP = Gauge(
    "switchyard_gateway_endpoint_up",
    "1 while the upstream endpoint answers (its /metrics read or last call connected), else 0.",
    ["endpoint"],
)
ENDPOINT_IN_FLIGHT = Gauge(
    "switchyard_gateway_endpoint_in_flight", "Streams in flight to the upstream endpoint.", ["endpoint"]
)
ENDPOINT_LIMIT = Gauge(
    "switchyard_gateway_endpoint_concurrency_limit",
    "Streams the upstream endpoint's adaptive concurrency limit admits now (the limit's whole part).",
    ["endpoint"],
)
ENDPOINT_KNEE = Gauge(
    "switchyard_gateway_endpoint_knee",
    "The upstream endpoint's knee estimate (streams past which its throughput stops rising), 0 until measured.",
    ["endpoint"],
)
ENDPOINT_WAITING = Gauge(
    "switchyard_gateway_endpoint_server_waiting",
    "Requests waiting in the upstream server's own queue, as its /metrics last said (-1: not exported).",
    ["endpoint"],
)
ENDPOINT_KV_USAGE = Gauge(
    "switchyard_gateway_endpoint_server_kv_cache_usage_ratio",
    "The upstream server's KV cache in use, a fraction, as its /metrics last said (-1: not exported).",
    ["endpoint"],
)
ENDPOINT_PICKS = Counter(
    "switchyard_gateway_endpoint_picks_total",
    "Attempts placed on an endpoint of the pool, by why: affinity (the key's home), spill (the key's home was past "
    "its in-flight bound), load (no key, or another endpoint scored higher), round_robin.",
    ["reason"],
)
ENDPOINT_FAILOVERS = Counter(
    "switchyard_gateway_endpoint_failovers_total",
    "Calls moved to another endpoint of the pool after one failed before the first token.",
)
