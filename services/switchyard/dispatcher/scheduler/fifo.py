"""The FIFO policy: arrival order, bounded by max_running_agents; the baseline.

No priority classes, no compute score, no preemption: waiting sequences start
in arrival order while fewer than ``max_running_agents`` run. This is the
scheduling most serving gateways start with; the scheduler benchmark compares
the priority policy against it. Tool-waiting react_loop agents are still
parked (no slot held, prefix kept warm for ``tool_wait_ttl_s``), but a
resuming agent queues by its arrival like any other work.
"""

from __future__ import annotations

from switchyard.dispatcher.scheduler.admission import MAX_RUNNING
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.sequence import Sequence


class FifoScheduler(SchedulerCore):
    """First come, first served (see the module docstring).

    Args: see :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`.
    """

    name = "fifo"

    def _order_key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        return (seq.arrival,)

    def _refusal(self, seq: Sequence, projected_score: float) -> str | None:
        return MAX_RUNNING if len(self._running) >= self.config.max_running_agents else None
