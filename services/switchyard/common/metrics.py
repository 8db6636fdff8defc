"""Prometheus metrics shared by the three services.

Names follow Prometheus conventions: ``switchyard_`` prefix, base units
(seconds, bytes), ratios 0-1. Service-specific metrics live beside their
service; these are the ones every queue and server uses.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Queue waits span sub-millisecond (idle) to the queue timeouts (seconds).
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

QUEUE_DEPTH = Gauge("switchyard_queue_depth", "Items waiting in a queue.", ["queue"])
QUEUE_WAIT = Histogram(
    "switchyard_queue_wait_seconds", "Time an item waited in a queue before a worker took it.", ["queue"],
    buckets=WAIT_BUCKETS,
)
QUEUE_REJECTED = Counter(
    "switchyard_queue_rejected_total", "Items rejected by a queue, by reason (full, timeout).", ["queue", "reason"]
)
QUEUE_BUSY_WORKERS = Gauge("switchyard_queue_busy_workers", "Workers of a queue running an item.", ["queue"])
