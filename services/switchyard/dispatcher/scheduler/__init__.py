"""GPU-aware scheduling of the dispatcher: which requests run at each time slice.

Public factory: :func:`make_scheduler`. Interface: :class:`Scheduler` (see
:mod:`.base` for the call order the engine loop follows). Policies:
:class:`PriorityScheduler` (priority classes with aging, admission by compute
score, preemption; :mod:`.priority`), :class:`FairScheduler` (classes, least
slack for work at risk, then tenant and session fairness; :mod:`.fair`) and
:class:`FifoScheduler` (arrival order; :mod:`.fifo`), chosen by ``scheduler_config.json`` ``policy``.

What the policies share, each module owning one part of it:

- :mod:`.core`: ``SchedulerCore``, the one request queue (intake, waiting, running, parked) and every
  transition between them; :mod:`.kv_memory`: its base ``KvMemory``, what happens to a request's KV while it
  does not run (tool waits, planned restores, hand-over, room for waiting work, the HBM scan);
  :mod:`.request_queue`: the waiting queue in a policy's order;
  :mod:`.update`: what an engine's report writes into a request, and the one stop check.
- :mod:`.capacity`: what the engine can hold (KV memory, or the upstream's concurrency limit);
  :mod:`.admission` and :mod:`.compute_score`: admission by compute score; :mod:`.accounting`: each task's
  compute score used and KV peak.
- :mod:`.parking` and :mod:`.tool_wait`: agents waiting on a tool, and whether their KV stays, swaps or drops;
  :mod:`.slack` and :mod:`.fairness`: the fair policy's deadlines and attained service.
"""

from __future__ import annotations

from typing import Any

from switchyard.common.config import SchedulerConfig, SwitchyardConfig
from switchyard.dispatcher.adaptive_flush import AdaptiveFlush
from switchyard.dispatcher.scheduler.base import Scheduler, SchedulerOutput, should_park
from switchyard.dispatcher.scheduler.capacity import Capacity
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.fair import FairScheduler
from switchyard.dispatcher.scheduler.fifo import FifoScheduler
from switchyard.dispatcher.scheduler.priority import PriorityScheduler
from switchyard.dispatcher.scheduler.request_queue import FcfsQueue, PriorityAgingQueue, RequestQueue

__all__ = [
    "ComputeScoreMonitor",
    "FairScheduler",
    "FcfsQueue",
    "FifoScheduler",
    "POLICIES",
    "PriorityAgingQueue",
    "PriorityScheduler",
    "RequestQueue",
    "Scheduler",
    "SchedulerOutput",
    "make_scheduler",
    "should_park",
]

POLICIES: dict[str, type[SchedulerCore]] = {"priority": PriorityScheduler, "fifo": FifoScheduler,
                                            "fair": FairScheduler}
"""``scheduler_config.json`` ``policy`` -> class."""


def make_scheduler(
    config: SwitchyardConfig | SchedulerConfig,
    engine: Any = None,
    *,
    policy: str | None = None,
    monitor: ComputeScoreMonitor | None = None,
    capacity: Capacity | None = None,
    adaptive_flush: AdaptiveFlush | None = None,
    tiers: Any = None,
    queue: RequestQueue | None = None,
) -> SchedulerCore:
    """The scheduling policy named by ``policy`` (default: ``config.scheduler.policy``).

    Args:
        config: the whole config, or just its ``scheduler`` section (the rest default).
        engine: the engine (a :class:`~switchyard.dispatcher.engines.base.StepEngine` or
            ``StreamEngine``: its ``kv`` manager, ``busy_seconds``, declared flags).
        policy: ``"priority"``, ``"fair"`` or ``"fifo"``; overrides the config.
        monitor: compute-score source (tests pass one built on a fake NVML).
        capacity: the running set's limit (default: the engine's KV budget).
        adaptive_flush: the flush-interval controller where ``batching.flush_interval_ms`` is ``"auto"`` (default
            None: the fixed interval, ``min_interval_ms`` for ``"auto"``).
        tiers: the memory tiers (:class:`switchyard.dispatcher.tiers.MemoryTiers`); default
            one without a DRAM store (evicted KV is recomputed).
        queue: the waiting queue (:class:`.request_queue.RequestQueue`; default the policy's): another
            ordering (fairness by attained service, slack) plugs in here through its ``order_key``.

    Raises:
        ValueError: unknown ``policy``.
    """
    whole = config if isinstance(config, SwitchyardConfig) else SwitchyardConfig(scheduler=config)
    name = policy or whole.scheduler.policy
    if name not in POLICIES:
        raise ValueError(f"scheduler policy: expected one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](whole, engine, monitor, capacity=capacity, adaptive_flush=adaptive_flush, tiers=tiers,
                          queue=queue)
