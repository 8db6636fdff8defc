"""The FIFO policy: arrival order, no priority classes, no preemption; the baseline.

Waiting requests start in arrival order while they fit the engine (KV memory
or the upstream's limit, see :mod:`.capacity`) and the admission wave allows.
No compute-score admission and no preemption. This is the scheduling most
serving gateways start with; the scheduler benchmark compares the priority
policy against it. Tool-waiting react_loop agents are still parked (no slot
held, prefix kept warm for ``tool_wait_ttl_s``), but a resuming agent queues
by its arrival like any other work.
"""

from __future__ import annotations

from switchyard.dispatcher.scheduler.admission import ADMISSION_WAVE
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.request_queue import FcfsQueue, RequestQueue
from switchyard.dispatcher.request import Request


class FifoScheduler(SchedulerCore):
    """First come, first served (see the module docstring).

    Args: see :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`.
    """

    name = "fifo"

    def make_queue(self) -> RequestQueue:
        """Arrival order (:class:`~.request_queue.FcfsQueue`)."""
        return FcfsQueue()

    def _policy_refusal(self, req: Request, projected_score: float, wave: int) -> str | None:
        return ADMISSION_WAVE if self.admission.wave_full(wave) else None  # the wave's one owner: Admission
