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
``score + expected < admission_score_limit``, the head's KV fits the HBM budget
(or the upstream's concurrency limit allows) and fewer than
``max_admitted_per_decision`` were admitted in this decision.

Preemption (``preemption_enabled``): a core request that does not fit, once it
has waited ``core_wait_before_preempt_ms`` since its arrival (default 0: at
once), takes the slot of the lowest-priority running request (batch before
normal; within a class the one latest in the waiting order), more of them
while its KV does not fit what they free; a victim must be of a lower class
than core: core never preempts core. A core request preempts only for what
preempting frees (KV memory, a running slot and its compute score), never past
the admission wave: once ``max_admitted_per_decision`` requests were admitted in
a decision, the rest wait for the next one and preempt nothing. It happens at a
decision (after the admission pass) or, when the core request arrives while a step runs, at once:
the victims leave the running set mid-step and the core request is prefilled
at the step's next layer boundary (:meth:`SchedulerCore.admit_core`). The
victim keeps the tokens it streamed and waits again at its original place; its
KV state goes to the DRAM tier in the background when a swap, counting the
delay the copy puts on the core request waiting for its bytes, is cheaper than
recomputing it (restored at re-admission, counted in ``restored_tokens``), else
it is dropped and its next prefill recomputes the prefix (counted in
``recomputed_tokens``). Requests admitted in the same decision are not
preempted.
"""

from __future__ import annotations

from typing import Any

from switchyard.common.config import SchedulerConfig, SwitchyardConfig
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.request_queue import PriorityAgingQueue, RequestQueue
from switchyard.dispatcher.request import Request, SchedulerOutput



def head_start(config: SchedulerConfig) -> tuple[float, ...]:
    """Seconds each class (core, normal, batch) is ordered ahead of its arrival: ``aging_max_wait_ms x
    (boost - boost_min) / (boost_max - boost_min)`` (see the module docstring)."""
    values = tuple(config.priority_boost.of(cls) for cls in PriorityClass)
    low, high = min(values), max(values)
    aging_s = config.aging_max_wait_ms / 1000.0
    return tuple(aging_s * (value - low) / (high - low) if high > low else 0.0 for value in values)


class PriorityScheduler(SchedulerCore):
    """Priority classes with aging, admission by compute score, and preemption for core work.

    Args: see :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`.
    """

    name = "priority"

    def __init__(self, config: SwitchyardConfig, engine: Any = None, monitor: ComputeScoreMonitor | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, engine, monitor, **kwargs)
        self.wait_before_preempt_s = self.scheduler_config.core_wait_before_preempt_ms / 1000.0
        """Seconds a core request that does not fit waits for room before it preempts."""

    def make_queue(self) -> RequestQueue:
        """:class:`~.request_queue.PriorityAgingQueue` with each class's head start (see the module docstring)."""
        return PriorityAgingQueue(head_start(self.scheduler_config))

    def _may_preempt(self, req: Request, now: float) -> bool:
        return (self.preemption_enabled and req.priority is PriorityClass.CORE
                and now - req.arrival >= self.wait_before_preempt_s)

    def _preempt(self, now: float, out: SchedulerOutput) -> None:
        if not self.preemption_enabled:
            return
        due = [req for req in self.queue if self._may_preempt(req, now)]
        for req in due:
            if self.admission.wave_full(len(out.admitted)):  # the wave bounds what preemption admits too
                return
            victims = self._victims_for(req, out)
            if victims is None:
                return
            for victim in victims:  # a copy in front of core's prefill counts against the swap
                self._preempt_one(victim, now, out, delays=self._copy_delays())
            self.queue.remove(req)
            self._start(req, now, out)

    def _below_core(self, out: SchedulerOutput, exclude: list[Request] = ()) -> list[Request]:  # type: ignore[assignment]
        """Running work below core, not admitted in this decision nor in ``exclude``: what core work may preempt."""
        fresh = set(out.admitted) | set(exclude)
        return [req for req in self._running if req.priority is not PriorityClass.CORE and req not in fresh]

    @staticmethod
    def _victim_order(req: Request) -> tuple[int, float]:
        """The larger, the sooner preempted: the lowest class first, then the latest arrival (inside one class
        the aging order is the arrival order: every member has the same head start)."""
        return req.priority, req.arrival

    def _in_victim_order(self, out: SchedulerOutput) -> list[Request]:
        """:meth:`_below_core`, first victim first (:meth:`_victim_order`)."""
        return sorted(self._below_core(out), key=self._victim_order, reverse=True)

    def _victim_candidates(self, req: Request, out: SchedulerOutput) -> list[Request]:
        """Lower-class running work, lowest priority first, when ``req`` is core work that may preempt now."""
        if not self._may_preempt(req, self._now):
            return []
        return self._in_victim_order(out)

    def _victims_for(self, req: Request, out: SchedulerOutput) -> list[Request] | None:
        """The fewest lowest-priority running requests whose slots and KV let ``req`` start; None if none do:
        :meth:`SchedulerCore._fewest_victims` over :meth:`_in_victim_order`, each victim's whole reservation
        freed (at a decision no step is in flight; the caller checked :meth:`_may_preempt`)."""
        return self._fewest_victims(req, self._in_victim_order(out), lambda victim: victim.kv_reserved_bytes)
