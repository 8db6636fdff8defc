"""GPU-aware scheduling of the dispatcher: which sequences run at each time slice.

Public factory: :func:`make_scheduler`. Interface: :class:`Scheduler` (see
:mod:`.base` for the call order the engine loop follows). Policies:
:class:`PriorityScheduler` (priority classes with aging, admission by compute
score, preemption; :mod:`.priority`) and :class:`FifoScheduler` (arrival order;
:mod:`.fifo`), chosen by ``scheduler_config.json`` ``policy``.
"""

from __future__ import annotations

from typing import Any

from switchyard.common.config import SchedulerFile, SwitchyardConfig
from switchyard.dispatcher.scheduler.base import Scheduler, SchedulerOutput, should_park
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.fifo import FifoScheduler
from switchyard.dispatcher.scheduler.priority import PriorityScheduler

__all__ = [
    "ComputeScoreMonitor",
    "FifoScheduler",
    "POLICIES",
    "PriorityScheduler",
    "Scheduler",
    "SchedulerOutput",
    "make_scheduler",
    "should_park",
]

POLICIES: dict[str, type[SchedulerCore]] = {"priority": PriorityScheduler, "fifo": FifoScheduler}
"""``scheduler_config.json`` ``policy`` -> class."""


def make_scheduler(
    config: SwitchyardConfig | SchedulerFile,
    engine: Any = None,
    *,
    policy: str | None = None,
    monitor: ComputeScoreMonitor | None = None,
) -> Scheduler:
    """The scheduling policy named by ``policy`` (default: ``config.scheduler.policy``).

    Args:
        config: the whole config, or just its ``scheduler`` section.
        engine: the step engine (``busy_seconds``, ``kv_bytes``, ``release``
            are used when present).
        policy: ``"priority"`` or ``"fifo"``; overrides the config.
        monitor: compute-score source (tests pass one built on a fake NVML).

    Raises:
        ValueError: unknown ``policy``.
    """
    scheduler_config = config.scheduler if isinstance(config, SwitchyardConfig) else config
    name = policy or scheduler_config.policy
    if name not in POLICIES:
        raise ValueError(f"scheduler policy: expected one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](scheduler_config, engine, monitor)
