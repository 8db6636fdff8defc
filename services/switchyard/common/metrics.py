"""Prometheus metrics shared by the three services.

Names follow Prometheus conventions: ``switchyard_`` prefix, base units
(seconds, bytes), ratios 0-1. Service-specific metrics live beside their
service; these are the ones every queue and server uses.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from prometheus_client import Counter, Gauge, Histogram

OTHER = "other"
"""Label value for anything outside a metric's bounded set."""

TOOL_NAMES: tuple[str, ...] = ("search_docs", "calculator")
"""The orchestrator's registered tools (react.py offers them): with :data:`OTHER`, the only ``tool`` label
values of the tool metrics, in the orchestrator (tool durations) and the dispatcher (tool waits)."""

TASK_TYPES: tuple[str, ...] = ("rag_answer", "chat", "react_loop")
"""The workflows (task types) a task may name; the only task_type label values besides ``unknown`` and ``other``."""

STATUS_CODES: tuple[str, ...] = tuple(code.name for code in grpc.StatusCode)
"""Every gRPC status code name (``OK``, ``CANCELLED``, ... ``UNAUTHENTICATED``): the ``code`` label's values,
each counter with it started at 0."""


def bounded(value: str, allowed: "Iterable[str]", empty: str = "unknown") -> str:
    """``value`` when it is one of ``allowed``, ``empty`` when it is empty, else :data:`OTHER`.

    Every label value that comes from a request (a model, a tool or task type a
    client or a model named) goes through this, so a metric's series stay a
    bounded set whatever callers send.
    """
    if not value:
        return empty
    return value if value in allowed else OTHER


# Queue waits span sub-millisecond (idle) to the queue timeouts (seconds), and the backlog of submitted tasks'
# waits to minutes (a task waits there until one of orchestrator.max_running_submitted_tasks ends; above 30 s every
# wait read as 30 s in a quantile).
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

QUEUE_DEPTH = Gauge("switchyard_queue_depth", "Items waiting in a queue.", ["queue"])
QUEUE_WAIT = Histogram(
    "switchyard_queue_wait_seconds",
    "Time an item waited in a queue, by how the wait ended: a worker took it (admitted), its wait's bound or its "
    "own deadline passed (expired), or it left unserved otherwise, its caller gone or the service stopping "
    "(cancelled).", ["queue", "outcome"],
    buckets=WAIT_BUCKETS,
)
QUEUE_WAIT_OUTCOMES: tuple[str, ...] = ("admitted", "expired", "cancelled")
"""The ``outcome`` label of :data:`QUEUE_WAIT`; each wait is observed once, under one of them. Every queue's series
start at 0 for each, so that ``sum by (le)`` over them is the whole wait, the waits that expired included (their
absence biased the quantiles down exactly while the queue was overloaded)."""
QUEUE_REJECTED = Counter(
    "switchyard_queue_rejected_total", "Items rejected by a queue, by reason (full, timeout).", ["queue", "reason"]
)
QUEUE_REJECT_REASONS: tuple[str, ...] = ("full", "timeout")
"""The ``reason`` label of :data:`QUEUE_REJECTED`: a full queue refused the item at once, or it waited past the
queue's timeout; every queue's counter starts at 0 for each."""
QUEUE_BUSY_WORKERS = Gauge("switchyard_queue_busy_workers", "Workers of a queue running an item.", ["queue"])
QUEUE_CAPACITY = Gauge(
    "switchyard_queue_capacity",
    "Items a queue holds before it refuses (queue.json queues.<name>.capacity); depth / capacity is its saturation.",
    ["queue"],
)
SERVING = Gauge(
    "switchyard_serving",
    "1 while the service's gRPC health check answers SERVING (ready), 0 while it does not (a service it needs "
    "is down, or it is starting) and while it drains; by service name (orchestrator-http: the orchestrator's HTTP "
    "face, as its /readyz answers).",
    ["service"],
)

PEER_SERVICES: tuple[str, ...] = ("orchestrator", "retrieval", "dispatcher", OTHER)
"""The services a channel may dial (the ``peer`` label of the channel counters)."""
CHANNEL_DISCONNECTS = Counter(
    "switchyard_grpc_channel_disconnects_total",
    "Times a gRPC channel's connection to a peer service left READY: a GOAWAY (the server's "
    "server.max_connection_age_s, or its drain) or a broken connection; grpc's connectivity states do not "
    "tell the two apart. By peer service.",
    ["peer"],
)
CHANNEL_RECONNECTS = Counter(
    "switchyard_grpc_channel_reconnects_total",
    "Times a gRPC channel was READY again after it had lost its connection (the first connection is not "
    "counted), by peer service.",
    ["peer"],
)
for _peer in PEER_SERVICES:
    CHANNEL_DISCONNECTS.labels(_peer)
    CHANNEL_RECONNECTS.labels(_peer)

# Bucket sets for the latencies services record beside their code. TTFT runs
# from milliseconds (sim engine, short prompts) to tens of seconds (long
# prompts on a loaded remote model); inter-token latency from sub-millisecond
# (batched decode) to about a second (stalled stream).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 30, 60)
INTER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
# Stage and task durations: a millisecond to a couple of minutes.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Batch sizes: powers of two up to the largest flush.max_batch_size worth plotting.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Event-loop lag: healthy loops oversleep by well under a millisecond; a loop
# blocked by CPU work (JSON, templates, token counting) shows tens to hundreds.
LOOP_LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

EVENT_LOOP_LAG = Histogram(
    "switchyard_event_loop_lag_seconds",
    "How much later than asked the event loop woke a fixed-interval sleeper (time the loop was blocked).",
    buckets=LOOP_LAG_BUCKETS,
)
