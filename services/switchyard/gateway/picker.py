"""The endpoint picker: which replica of the model server takes a call, as filter -> score -> pick.

The shape of the Gateway API Inference Extension's endpoint picker and llm-d's
inference scheduler: small plugins in a fixed order, each scorer named for
what it measures and weighted in config (``model_gateway.pool.weights``).

Filters (an endpoint that fails one is not a candidate):

- ``available``: the endpoint is up (its last ``/metrics`` read or call did not
  fail to connect) and not already tried by this call;
- ``under_limit``: fewer streams in flight than its adaptive concurrency limit
  (when every candidate is at its limit, all stay: the dispatcher's admission
  already bounds the total, and the least loaded will win the scoring).

Scorers (each 0-1 per candidate):

- ``prefix_affinity``: 1 for the endpoint the bounded-load rule gives the call's
  affinity key (its agent, else a hash of its prompt's opening text), 0 for the
  others (:class:`switchyard.common.affinity.BoundedLoadRing`: the key's home
  until that endpoint has more than ``balance`` x the mean streams in flight,
  then the next endpoint on the ring);
- ``queue_depth``: ``1 / (1 + requests waiting in the server)``;
- ``kv_cache_usage``: ``1 - KV cache used``;
- ``in_flight``: ``1 - streams in flight / concurrency limit``;
- ``ttft``: fastest recent TTFT among the candidates / this endpoint's.

A figure the server does not export scores 0.5 (neither for nor against); an
endpoint with no TTFT yet scores 1 (it gets tried). Pick: the highest weighted
sum; ties go to the fewest streams in flight, then in turn.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from switchyard.common.affinity import BoundedLoadRing
from switchyard.common.config import UpstreamPoolConfig
from switchyard.gateway.server_load import ServerLoad

UNKNOWN = 0.5
"""Score of a figure the server does not export."""
REASONS = ("affinity", "spill", "load", "round_robin")
"""Why an endpoint was picked (a metric label): its key's home, the key's overflow, the scores without a key's
endpoint winning, or its turn."""


class Candidate(Protocol):
    """What the picker reads of an endpoint (:class:`switchyard.gateway.pool.Endpoint`)."""

    name: str
    up: bool
    in_flight: int
    load: ServerLoad

    @property
    def limit_value(self) -> int:
        """Its concurrency limit now, streams (at least ``concurrency.min_limit``, 1 or more)."""

    @property
    def ttft_s(self) -> float | None:
        """Its recent TTFT, seconds (None: none measured yet)."""


@dataclass(frozen=True)
class Picked:
    """The endpoint chosen for one attempt, why, and every candidate's weighted score (for spans and tests)."""

    name: str
    reason: str
    scores: dict[str, float] = field(default_factory=dict)


class EndpointPicker:
    """Filter -> score -> pick over the pool's endpoints (see the module docstring).

    Args:
        config: ``model_gateway.pool`` (policy, weights, balance, affinity_idle_s).
    """

    def __init__(self, config: UpstreamPoolConfig) -> None:
        self.config = config
        self.ring = BoundedLoadRing(balance=config.balance)
        self._turn = itertools.count()

    def sync(self, names: Sequence[str]) -> None:
        """Make the ring hold exactly ``names`` (endpoints joining or leaving; only a leaver's keys move)."""
        for name in set(self.ring.replicas) - set(names):
            self.ring.remove(name)
        for name in names:
            self.ring.add(name)

    def pick(self, endpoints: Sequence[Candidate], key: str, now: float,
             tried: frozenset[str] = frozenset()) -> Picked:
        """The endpoint for one attempt of a call with affinity key ``key`` ("" for none).

        ``now``: monotonic seconds (ages the ring's keys); ``tried``: names this call already failed on.

        Raises:
            LookupError: no endpoint is up and untried.
        """
        candidates = self.available(endpoints, tried)
        if not candidates:
            raise LookupError(f"no endpoint up and untried ({len(endpoints)} known, {len(tried)} tried)")
        if self.config.policy == "round_robin":
            return Picked(candidates[next(self._turn) % len(candidates)].name, "round_robin")
        available = candidates
        candidates = self.under_limit(candidates)
        if len(candidates) == 1 and not key:
            return Picked(candidates[0].name, "load")
        weights = self.config.weights
        home, at_home = self._affinity(endpoints, available, key, now)
        if home not in {c.name for c in candidates}:
            home = None  # its endpoint is at its concurrency limit: the load scorers decide (the key stays placed)
        fastest = min((c.ttft_s for c in candidates if c.ttft_s), default=None)
        scores: dict[str, float] = {}
        for c in candidates:
            total = weights.prefix_affinity * (1.0 if c.name == home else 0.0)
            total += weights.queue_depth * _queue_score(c)
            total += weights.kv_cache_usage * (UNKNOWN if c.load.kv_cache_usage is None else 1 - c.load.kv_cache_usage)
            total += weights.in_flight * _headroom(c)
            total += weights.ttft * (1.0 if not c.ttft_s or fastest is None else fastest / c.ttft_s)
            scores[c.name] = total
        best = max(scores.values())
        tied = [c for c in candidates if scores[c.name] >= best - 1e-9]
        fewest = min(c.in_flight for c in tied)
        tied = [c for c in tied if c.in_flight == fewest]
        chosen = tied[next(self._turn) % len(tied)].name if len(tied) > 1 else tied[0].name
        reason = "load" if chosen != home else ("affinity" if at_home else "spill")
        return Picked(chosen, reason, scores)

    # ------------------------------------------------------------------ filters

    @staticmethod
    def available(endpoints: Sequence[Candidate], tried: frozenset[str]) -> list[Candidate]:
        """Endpoints up and not yet tried by this call."""
        return [e for e in endpoints if e.up and e.name not in tried]

    @staticmethod
    def under_limit(candidates: list[Candidate]) -> list[Candidate]:
        """Candidates below their concurrency limit; all of them when none is."""
        roomy = [c for c in candidates if c.in_flight < c.limit_value]
        return roomy or candidates

    # ------------------------------------------------------------------ scorers

    def _affinity(self, endpoints: Sequence[Candidate], available: list[Candidate], key: str,
                  now: float) -> tuple[str | None, bool]:
        """The bounded-load ring's endpoint for ``key`` among the available ones (a key whose home is down or
        was tried by this call is placed anew), and whether it is the key's home."""
        if not key or not self.config.weights.prefix_affinity:
            return None, False
        self.ring.expire(now, self.config.affinity_idle_s)
        names = {c.name for c in available}
        exclude = frozenset(n for n in self.ring.replicas if n not in names)
        in_flight = {e.name: e.in_flight for e in endpoints}
        return self.ring.route(key, in_flight, now, exclude)


def _queue_score(c: Candidate) -> float:
    return UNKNOWN if c.load.waiting is None else 1 / (1 + max(0.0, c.load.waiting))


def _headroom(c: Candidate) -> float:
    return max(0.0, 1 - c.in_flight / max(1, c.limit_value))
