"""Fairness by service received: attained service per agent session and per tenant, with decay.

Attained service is the work the engine has already done for someone: tokens
prefilled plus tokens decoded (a recomputed prefix counts again: it was work).
It decays exponentially with a half-life, so that what a session received a
minute ago weighs half as much as what it received now and an idle tenant is
not owed an unbounded catch-up (the decayed counter of fair queueing's
"virtual time" without a global clock)::

    service(t) = service(t0) * 2 ** (-(t - t0) / half_life_s) + tokens charged since t0

Order within a priority class (smallest key first), :meth:`FairnessLedger.order_key`::

    (tenant service / tenant weight, session service, arrival)

- Across tenants, least *weighted* attained service first: a tenant with
  weight 2 may receive twice the tokens of a tenant with weight 1 before it
  is ordered behind it. This is the per-flow fairness of the llm-d inference
  scheduler (flow control: priority bands, and inside a band a fairness
  policy across flows keyed by a fairness ID; llm-d's per-session fairness
  plugin serves the flow with least attained service first), with the flow
  taken to be the tenant.
- Within a tenant, least attained service per agent *session* (the program:
  every call an agent made, across its tool calls) first. This is Autellix's
  program-level least attained service (PLAS, Luo et al. 2025: a call is
  ordered by the service its whole program has received so far, so short
  programs finish ahead of long ones without knowing their length). Autellix
  counts service without decay; the half-life here is this module's, so a
  long-lived session is not pushed back for ever by work done long ago.
- Equal service: by arrival (FIFO), so the order is total and stable.

The key is computed when a request joins the waiting set, and the fair
policy computes every waiting key again at a decision when service was
charged since the last one (:meth:`switchyard.dispatcher.scheduler.fair.FairScheduler.schedule`):
a tenant's service is then read at one time for all its requests, so within a
tenant the sessions' service decides.

Memory is bounded: at most :data:`MAX_TRACKED` sessions and tenants each are
remembered (least recently charged dropped first; a forgotten one starts at 0,
which only moves it forward).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["MAX_TRACKED", "AttainedService", "FairnessLedger"]

MAX_TRACKED = 100_000
"""Most keys (sessions, or tenants) an :class:`AttainedService` remembers."""


@dataclass
class _Counter:
    value: float
    at: float


class AttainedService:
    """Decayed attained service per key (tokens; a session id or a tenant id).

    Args:
        half_life_s: seconds after which charged service counts half (> 0; ``math.inf``: no decay,
            Autellix's plain cumulative service).
        max_tracked: most keys remembered (least recently charged dropped first).

    Raises:
        ValueError: ``half_life_s`` not > 0, or ``max_tracked`` < 1.
    """

    def __init__(self, half_life_s: float, max_tracked: int = MAX_TRACKED) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s: expected seconds > 0, got {half_life_s!r}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked: expected at least 1, got {max_tracked!r}")
        self.half_life_s = float(half_life_s)
        self.max_tracked = max_tracked
        self._counters: OrderedDict[str, _Counter] = OrderedDict()

    def _decayed(self, counter: _Counter, now: float) -> float:
        if math.isinf(self.half_life_s):
            return counter.value
        elapsed = max(0.0, now - counter.at)
        return counter.value * 0.5 ** (elapsed / self.half_life_s)

    def charge(self, key: str, tokens: float, now: float) -> None:
        """Add ``tokens`` of service (prefilled + decoded, >= 0) to ``key`` at ``now`` (seconds).

        Raises:
            ValueError: ``tokens`` < 0.
        """
        if tokens < 0:
            raise ValueError(f"tokens: expected >= 0, got {tokens!r}")
        counter = self._counters.pop(key, None)
        value = self._decayed(counter, now) if counter is not None else 0.0
        self._counters[key] = _Counter(value + tokens, now)
        while len(self._counters) > self.max_tracked:
            self._counters.popitem(last=False)

    def service(self, key: str, now: float) -> float:
        """``key``'s decayed attained service at ``now`` (tokens; 0 for a key never charged)."""
        counter = self._counters.get(key)
        return self._decayed(counter, now) if counter is not None else 0.0

    def __len__(self) -> int:
        return len(self._counters)


class FairnessLedger:
    """Attained service per agent session and per tenant, and the order key within a priority class.

    Args:
        half_life_s: decay half-life of both counters, seconds (``math.inf``: none).
        tenant_weights: tenant id -> weight (> 0); a tenant not named has ``default_weight``.
        default_weight: weight of an unnamed tenant (> 0).

    Raises:
        ValueError: a weight not > 0, or ``half_life_s`` not > 0.
    """

    def __init__(self, half_life_s: float, tenant_weights: dict[str, float] | None = None,
                 default_weight: float = 1.0) -> None:
        weights = dict(tenant_weights or {})
        for tenant, weight in [*weights.items(), ("(default)", default_weight)]:
            if not weight > 0:
                raise ValueError(f"tenant weight of {tenant!r}: expected > 0, got {weight!r}")
        self.weights = weights
        self.default_weight = float(default_weight)
        self.sessions = AttainedService(half_life_s)
        self.tenants = AttainedService(half_life_s)

    def weight(self, tenant_id: str) -> float:
        """``tenant_id``'s weight (its configured one, else the default)."""
        return float(self.weights.get(tenant_id, self.default_weight))

    def charge(self, session_id: str, tenant_id: str, tokens: float, now: float) -> None:
        """Record ``tokens`` of service (prefilled + decoded) done for ``session_id`` of ``tenant_id``.

        An empty session id charges the tenant only; an empty tenant id counts as the tenant "".
        """
        if session_id:
            self.sessions.charge(session_id, tokens, now)
        self.tenants.charge(tenant_id, tokens, now)

    def tenant_share(self, tenant_id: str, now: float) -> float:
        """The tenant's weighted attained service: service / weight (tokens per unit of weight)."""
        return self.tenants.service(tenant_id, now) / self.weight(tenant_id)

    def order_key(self, session_id: str, tenant_id: str, arrival: float, now: float) -> tuple[float, float, float]:
        """``(tenant's weighted service, session's service, arrival)``: smallest first within a class.

        The tenant's term is llm-d's per-flow least attained service; the session's, Autellix's PLAS
        (see the module docstring).
        """
        session = self.sessions.service(session_id, now) if session_id else 0.0
        return (self.tenant_share(tenant_id, now), session, arrival)
