"""The value score of held KV state: which state to evict first, and where it goes.

Every piece of KV state the dispatcher holds (a running request's cache, a
parked agent's prefix, a swapped-out copy in Redis) gets one number::

    value = priority_weight x (1 + hits) x reuse_cost_us / size_gib x recency

- ``reuse_cost_us``: the prefill time, in microseconds, that keeping the state
  saves: the engine's cost of recomputing its tokens (the sim's latency model,
  the torch engine's measured prefill time per token).
- ``size_gib``: the bytes it holds, in GiB (2**30 bytes). Cost over size, times
  frequency, is the Greedy-Dual-Size-Frequency rule of web caching (Cherkasova,
  "Improving WWW proxies performance with Greedy-Dual-Size-Frequency caching
  policy", HP Labs HPL-98-69, 1998): keep what is expensive to rebuild per byte
  it occupies and often reused. LMCache scores KV chunks the same way, by the
  prefill they save (LMCache, Liu et al. 2024).
- ``1 + hits``: frequency, the times the state was reused from a tier; with
  recency it is what ARC balances (Megiddo and Modha, FAST 2003), the policy
  vLLM's KV offloading connector offers besides LRU.
- ``recency``: ``0.5 ** (idle_s / recency_half_life_s)``, LRU's signal as a
  decay; it stays 1 while a parked agent's tool-wait TTL runs, because an agent
  waiting on a tool is expected back: Continuum pins a tool-calling agent's KV
  for a TTL sized to the tool call (Li et al., "Continuum: Efficient and Robust
  Multi-Turn LLM Agent Scheduling with KV Cache Time-to-Live", 2025).
- ``priority_weight``: the class's ``priority_boost`` (core 10, normal 5,
  batch 1): core agents' state outlives batch state of equal worth.

Scale: a normal-class agent's 1,000-token prefix on the sim engine (30 ms of
prefill, 0.49 GiB at 512 KiB per token) scores 5 x 1 x 30,000 / 0.49 x 1, about
3.1e5; fresh core state with two reuses about 1.8e6. The thresholds of
``memory_policy.toml`` read on this scale:

- ``[hbm] evict_first_below`` (1e6): parked state below it is evicted from HBM
  first to make room for admission, before the prefix cache; state above it
  after the prefix cache.
- ``[dram] renew_ttl_threshold`` (1e6): a DRAM entry at or above it stays hot
  (the DRAM scan renews its TTL).
- ``[dram] demote_threshold`` (1e3): a DRAM entry below it is demoted by the
  DRAM scan (the normal agent above, idle for about eight half-lives).
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.common.config import PriorityBoost, ValueScoreConfig
from switchyard.common.priority import LABELS, PriorityClass

GIB = 2**30


@dataclass(frozen=True)
class ValueScore:
    """The value score with its configuration.

    Args:
        config: ``memory_policy.toml`` ``[value]``.
        boost: ``scheduler_config.json`` ``priority_boost`` (the priority weights).
    """

    config: ValueScoreConfig
    boost: PriorityBoost

    def weight(self, priority_class: str) -> float:
        """The priority weight of ``priority_class`` (core, normal or batch; any other label: normal's)."""
        rank = LABELS.index(priority_class) if priority_class in LABELS else PriorityClass.NORMAL
        return float(self.boost.of(PriorityClass(rank)))

    def score(
        self, *, priority_class: str, hits: int, reuse_seconds: float, nbytes: int, idle_s: float, pinned: bool = False
    ) -> float:
        """The value of one piece of state (see the module docstring); >= 0.

        Args:
            priority_class: core, normal or batch.
            hits: times it was reused from a tier.
            reuse_seconds: prefill seconds keeping it saves.
            nbytes: bytes it holds (at least one byte is counted).
            idle_s: seconds since it was last used.
            pinned: a parked agent within its tool-wait TTL (recency stays 1).
        """
        recency = 1.0 if pinned else 0.5 ** (max(0.0, idle_s) / self.config.recency_half_life_s)
        size_gib = max(1, nbytes) / GIB
        return self.weight(priority_class) * (1 + max(0, hits)) * max(0.0, reuse_seconds) * 1e6 / size_gib * recency
