"""The priority policy: classes weighted by priority_boost, aging, admission by score, preemption.

Order of the waiting set. Each waiting request gets a *virtual arrival*::

    virtual_arrival = arrival - aging_max_wait * (boost[class] - boost_min) / (boost_max - boost_min)

and the waiting set is served by virtual arrival, oldest first. With the
default boosts (core 10, normal 5, batch 1) and ``aging_max_wait_ms`` 5000,
core work is ordered as if it had arrived 5 s earlier than it did, normal work
2.2 s earlier, batch work as it arrived. This is linear aging, the same
ordering as ``boost + wait * rate`` with one rate for every class:

- work arriving together is served core, then normal, then batch;
- within a class, by arrival (FIFO);
- aging bound: once a task has waited ``aging_max_wait_ms``, no work that
  arrives later, of any class, is ordered ahead of it; so batch work never
  starves: it waits at most ``aging_max_wait_ms`` plus the time to drain what
  was already ahead of it.

The key is fixed while a request waits and comes from its original
``arrival``: a preempted request goes back to its original place and never
loses it to newer work of its class. A react_loop agent back from a tool
(``resume``) is put at the head of its class: ahead of every waiting
non-resumed request of its class (and, resumed agents among themselves, in
the order they came back).

Admission (:mod:`.admission`, :mod:`.capacity`) takes from the head while
``score + expected < high_load_threshold``, the head's KV fits the HBM budget
(or the upstream's concurrency limit allows) and fewer than
``max_admitted_per_decision`` were admitted in this decision.

Preemption (``preemption_enabled``): a core request still waiting after the
admission pass, which has waited at least ``preemption_grace_ms`` since its
arrival, takes the slot of the lowest-priority running request (batch before
normal; within a class the one latest in the waiting order), which must be of
a lower class than core; core never preempts core. The victim keeps the
tokens it streamed and waits again at its original place; the scheduler
moves its KV state to the DRAM tier when a swap is cheaper than recomputing it
(restored at re-admission, counted in ``restored_tokens``), else drops it and
its next prefill recomputes the prefix (counted in ``recomputed_tokens``).
Requests admitted in the same decision are not preempted.
"""

from __future__ import annotations

from typing import Any

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.scheduler.base import class_rank
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.request import Request, SchedulerOutput

_RESUMED, _NEW = 0.0, 1.0


class PriorityScheduler(SchedulerCore):
    """Priority classes with aging, admission by compute score, and preemption for core work.

    Args: see :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`.
    """

    name = "priority"

    def __init__(self, config: SwitchyardConfig, engine: Any = None, monitor: ComputeScoreMonitor | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, engine, monitor, **kwargs)
        boost = self.config.priority_boost
        values = (boost.core, boost.normal, boost.batch)
        low, high = min(values), max(values)
        aging_s = self.config.aging_max_wait_ms / 1000.0
        self.head_start_s: tuple[float, ...] = tuple(
            aging_s * (value - low) / (high - low) if high > low else 0.0 for value in values
        )
        """Seconds each class (core, normal, batch) is ordered ahead of its arrival."""
        self.grace_s = self.config.preemption_grace_ms / 1000.0

    def virtual_arrival(self, req: Request) -> float:
        """``req.arrival`` minus its class's head start (seconds, monotonic clock)."""
        return req.arrival - self.head_start_s[class_rank(req)]

    def _order_key(self, req: Request, now: float) -> tuple[float, ...]:
        virtual = self.virtual_arrival(req)
        if not req.resume:
            return (virtual, _NEW)
        rank = class_rank(req)
        class_heads = [key[0] for key, queued in self._waiting if class_rank(queued) == rank and key[1] == _NEW]
        return (min([virtual, *class_heads]), _RESUMED)

    def _preempt(self, now: float, out: SchedulerOutput) -> None:
        if not self.preemption_enabled:
            return
        due = [req for _, req in self._waiting if class_rank(req) == 0 and now - req.arrival >= self.grace_s]
        for req in due:
            victims = self._victims_for(req, out)
            if victims is None:
                return
            for victim in victims:
                self._preempt_one(victim, now, out)
            self._remove_waiting(req)
            self._start(req, now, out)

    def _victims_for(self, req: Request, out: SchedulerOutput) -> list[Request] | None:
        """The fewest lowest-priority running requests whose slots and KV let ``req`` start; None if none do.

        At least one victim (its slot in the compute score), more while ``req``'s
        KV reservation does not fit what they free.
        """
        chosen: list[Request] = []
        freed = 0
        need = getattr(self.capacity, "need", None)
        shortfall = 0
        if need is not None:
            shortfall = need(req) - self.capacity.free_bytes  # type: ignore[attr-defined]
        while True:
            victim = self._victim(out, chosen)
            if victim is None:
                return None
            chosen.append(victim)
            freed += victim.kv_reserved_bytes
            if freed >= shortfall:
                return chosen

    def _victim(self, out: SchedulerOutput, exclude: list[Request] = ()) -> Request | None:  # type: ignore[assignment]
        """Lowest-priority running request below core, not admitted in this decision nor in ``exclude``."""
        fresh = set(out.admitted) | set(exclude)
        candidates = [req for req in self._running if class_rank(req) > 0 and req not in fresh]
        if not candidates:
            return None
        return max(candidates, key=lambda req: (class_rank(req), self.virtual_arrival(req), req.arrival))
