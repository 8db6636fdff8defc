"""An adaptive concurrency limit for upstream (stream) engines.

A fixed cap on streams in flight is wrong in both directions: four streams
starve a vLLM or SGLang server that batches hundreds of sequences, and a large
fixed value overloads a hosted API until it answers 429. The limit here adapts
to what the upstream can take, from two signals:

- **latency gradient** (Netflix concurrency-limits' ``Gradient2Limit``, the
  rule Envoy's adaptive concurrency filter also follows): the TTFT of each
  stream is a sample; ``short`` is a fast EWMA of the samples, ``long`` a slow
  one (the no-queueing baseline). While ``short`` stays within
  ``tolerance x long`` the upstream is not queueing and the limit grows by
  ``sqrt(limit)`` per sample; when ``short`` rises past it the limit shrinks in
  proportion::

      gradient = clamp(tolerance * long / short, 0.5, 1.0)
      target   = limit * gradient + sqrt(limit)
      limit    = (1 - smoothing) * limit + smoothing * target

  The limit grows only while it is used (more than half of it in flight), as
  in ``Gradient2Limit``, so an idle period does not leave a limit the upstream
  never proved it can take.
- **overload answers** (AIMD's multiplicative decrease): a 429 or 503 from the
  upstream multiplies the limit by ``backoff_ratio``, at most once per
  ``long`` TTFT, so one burst of refusals counts once.

Bounds: ``[min_limit, max_limit]`` from ``queue.json``
``model_gateway.concurrency``; the current limit is exported as
``switchyard_upstream_concurrency_limit``.
"""

from __future__ import annotations

import math

from prometheus_client import Gauge

from switchyard.common.config import AdaptiveConcurrencyConfig

UPSTREAM_LIMIT = Gauge(
    "switchyard_upstream_concurrency_limit",
    "Streams the dispatcher may have in flight to the upstream model now (adaptive concurrency limit).",
)
UPSTREAM_IN_FLIGHT = Gauge("switchyard_upstream_in_flight", "Streams in flight to the upstream model.")

OVERLOAD_STATUSES = frozenset({429, 503})
"""HTTP statuses that mean the upstream refuses load (rate limited, overloaded)."""


class AdaptiveConcurrencyLimit:
    """The current concurrency limit and the rule that moves it (see the module docstring).

    Args:
        config: ``model_gateway.concurrency`` (min_limit, max_limit,
            initial_limit, tolerance, smoothing, backoff_ratio).

    ``limit`` is a float; callers compare ``in_flight < int(limit)``.
    """

    SHORT_ALPHA = 0.1
    """Weight of a new sample in the fast EWMA (about the last 10 samples)."""
    LONG_ALPHA = 0.01
    """Weight of a new sample in the slow baseline EWMA (about the last 100 samples)."""

    def __init__(self, config: AdaptiveConcurrencyConfig) -> None:
        self.config = config
        self.limit = float(config.initial_limit)
        self.in_flight = 0
        """Streams in flight now; kept by the caller (the scheduler's capacity)."""
        self.short_s: float | None = None
        self.long_s: float | None = None
        self._last_backoff = -math.inf
        UPSTREAM_LIMIT.set(self.limit)

    def on_sample(self, ttft_s: float) -> None:
        """One stream's TTFT in seconds (request sent -> first token)."""
        if ttft_s <= 0:
            return
        if self.short_s is None or self.long_s is None:
            self.short_s = self.long_s = ttft_s
            return
        self.short_s += self.SHORT_ALPHA * (ttft_s - self.short_s)
        self.long_s += self.LONG_ALPHA * (ttft_s - self.long_s)
        if self.long_s / self.short_s > 2:  # the baseline drifted above now: let it come down
            self.long_s *= 0.95
        gradient = max(0.5, min(1.0, self.config.tolerance * self.long_s / self.short_s))
        if gradient >= 1.0 and self.in_flight < self.limit / 2:
            return  # app-limited: do not grow a limit nobody uses
        target = self.limit * gradient + math.sqrt(self.limit)
        self._set((1 - self.config.smoothing) * self.limit + self.config.smoothing * target)

    def on_overload(self, now: float) -> None:
        """The upstream refused load (429/503) at ``now`` (monotonic seconds): back off once per TTFT."""
        window = self.long_s if self.long_s is not None else 0.1
        if now - self._last_backoff < window:
            return
        self._last_backoff = now
        self._set(self.limit * self.config.backoff_ratio)

    def _set(self, value: float) -> None:
        self.limit = max(float(self.config.min_limit), min(float(self.config.max_limit), value))
        UPSTREAM_LIMIT.set(self.limit)
