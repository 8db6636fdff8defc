"""Prometheus metrics of the model gateway. Labels carry model ids and status names, never keys."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

GATEWAY_REQUESTS = Counter(
    "switchyard_gateway_requests_total",
    "Chat completions sent upstream, by upstream model and outcome (ok or the gRPC status name).",
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
CIRCUIT_STATES = ("closed", "open", "half_open")
"""The states of an upstream model's circuit (gateway/cooldown.py)."""
CIRCUIT_TRANSITIONS = (("closed", "open"), ("open", "half_open"), ("half_open", "open"), ("half_open", "closed"))
"""The moves a circuit makes, (from_state, to_state)."""
GATEWAY_CIRCUIT_STATE = Gauge(
    "switchyard_gateway_circuit_state",
    "1 for the state the upstream model's circuit is in (closed, open: cooling down after repeated failures, "
    "half_open: admitting its probes), 0 for the others.",
    ["model", "state"],
)
GATEWAY_CIRCUIT_TRANSITIONS = Counter(
    "switchyard_gateway_circuit_transitions_total",
    "Moves of an upstream model's circuit between states (closed -> open is a cooldown beginning).",
    ["model", "from_state", "to_state"],
)
