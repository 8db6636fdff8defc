"""Adaptive flush window for the double buffer (``flush_interval_ms: "auto"``).

The field's advice is to try fixed flush intervals of 10, 20 and 50 ms and keep
the one with the best P95 and utilisation for the arrival pattern at hand. The
best value moves with the load, so this controller recomputes the window from
two measurements instead:

- the arrival rate ``lam`` (requests per second entering the buffer), counted
  over the last ``rate_window_s`` seconds;
- the batch service time ``s`` (seconds from a flush until the engine finished
  that batch), the P95 of the last ``service_samples`` batches.

Rule (all times in seconds)::

    fill   = (max_batch_size - 1) / lam          # time until a full batch at this rate (the double
                                                 # buffer asks at a list's first item)
    budget = p95_budget - s_p95                  # queueing delay the P95 budget leaves
    window = clamp(min(fill, step, budget), min_interval, max_interval)

``step`` is the engine's admission step, when known: an engine with
iteration-level batching takes new requests only at step (time-slice)
boundaries, so a window longer than one step adds latency without adding
requests to the step they join.

Decode is memory-bound, so a step costs about the same for one request as for
``max_batch_size`` (see docs/benchmarks.md); the batch the engine can absorb in
one step is therefore the full ``max_batch_size``, and waiting for it raises
useful work per step. Waiting longer than ``fill`` buys nothing (the size
trigger fires first), and waiting longer than ``budget`` would push the P95 of
wait + service past the budget. With no arrivals yet the window is
``min_interval_ms``: no latency is spent before there is a rate to justify it.

The controller is pure bookkeeping: it never sleeps or reads a clock unless the
caller omits ``now``, so tests drive it with synthetic arrival streams.
"""

from __future__ import annotations

import math
import time
from collections import deque

from switchyard.common.config import BatchingConfig


class AdaptiveFlush:
    """Flush-window controller; call it (no arguments) for the current window in seconds.

    Args:
        config: the ``flush`` section; uses max_batch_size, p95_budget_ms,
            min_interval_ms and max_interval_ms.
        rate_window_s: arrivals older than this (seconds) no longer count
            toward the arrival rate.
        service_samples: how many recent batch service times the P95 uses.
        engine_step_s: the engine's admission step in seconds (the scheduler's
            ``time_slice_ms`` / 1000); None = no such cap.

    Raises:
        ValueError: ``rate_window_s``, ``service_samples`` or ``engine_step_s`` not positive.
    """

    def __init__(
        self,
        config: BatchingConfig,
        rate_window_s: float = 1.0,
        service_samples: int = 64,
        engine_step_s: float | None = None,
    ) -> None:
        if rate_window_s <= 0:
            raise ValueError(f"rate_window_s must be > 0, got {rate_window_s}")
        if service_samples < 1:
            raise ValueError(f"service_samples must be >= 1, got {service_samples}")
        if engine_step_s is not None and engine_step_s <= 0:
            raise ValueError(f"engine_step_s must be > 0, got {engine_step_s}")
        self.engine_step_s = engine_step_s
        self.max_batch_size = config.max_batch_size
        self.p95_budget_s = config.p95_budget_ms / 1000
        self.min_interval_s = config.min_interval_ms / 1000
        self.max_interval_s = config.max_interval_ms / 1000
        self.rate_window_s = rate_window_s
        self._arrivals: deque[float] = deque()
        self._service: deque[float] = deque(maxlen=service_samples)
        self.last_window_s = self.min_interval_s

    # ------------------------------------------------------------------ observations

    def record_arrival(self, now: float | None = None) -> None:
        """Record one request entering the buffer at ``now`` (monotonic seconds)."""
        now = time.monotonic() if now is None else now
        self._arrivals.append(now)
        self._trim(now)

    def record_batch_service(self, service_s: float) -> None:
        """Record a batch's service time: flush -> the engine finished it, in seconds.

        Raises:
            ValueError: ``service_s`` is negative or not finite.
        """
        if not (math.isfinite(service_s) and service_s >= 0):
            raise ValueError(f"service_s must be a finite number >= 0, got {service_s}")
        self._service.append(service_s)

    # ------------------------------------------------------------------ estimates

    def arrival_rate(self, now: float | None = None) -> float:
        """Requests per second over the last ``rate_window_s`` (0.0 with fewer than 2 arrivals)."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if len(self._arrivals) < 2:
            return 0.0
        span = max(now - self._arrivals[0], self._arrivals[-1] - self._arrivals[0])
        return (len(self._arrivals) - 1) / span if span > 0 else math.inf

    def service_p95(self) -> float:
        """P95 of the recent batch service times in seconds (nearest rank; 0.0 before any)."""
        if not self._service:
            return 0.0
        ordered = sorted(self._service)
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]

    def window(self, now: float | None = None) -> float:
        """The flush window in seconds, by the rule in the module docstring, with one item buffered (the double
        buffer asks when a list's first item arrives, and keeps the window for the whole list)."""
        lam = self.arrival_rate(now)
        budget = self.p95_budget_s - self.service_p95()
        if lam <= 0:
            target = self.min_interval_s
        else:
            fill = max(self.max_batch_size - 1, 1) / lam
            target = min(fill, budget, self.engine_step_s or math.inf)
        self.last_window_s = min(max(target, self.min_interval_s), self.max_interval_s)
        return self.last_window_s

    __call__ = window

    def _trim(self, now: float) -> None:
        horizon = now - self.rate_window_s
        while self._arrivals and self._arrivals[0] < horizon:
            self._arrivals.popleft()
