"""The engine loop: flushed batches in, scheduled engine steps out.

This module holds the interface between the loop and a scheduling policy
(:class:`SchedulingPolicy`), the plain FIFO policy (:class:`FifoPolicy`, also
the baseline the scheduler benchmark compares against), and the loop itself.
"""

from __future__ import annotations

import importlib.util
from collections import deque
from typing import Protocol, runtime_checkable

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.sequence import SchedulerOutput, Sequence


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Decides, at each time-slice boundary, which sequences run.

    The engine loop calls, all on the event loop and never concurrently:

    - :meth:`add` with each flushed batch (in flush order);
    - :meth:`schedule` at every time-slice boundary (every ``time_slice_ms``
      of decode steps, and whenever the running set empties or new work
      arrives while idle);
    - :meth:`finish` when a sequence ends (finished, cancelled, failed),
      whether it is running or still waiting.

    The loop applies the output: it releases the KV state of ``preempted``
    sequences (``engine.release`` and ``seq.mark_preempted``), prefills the
    ``admitted`` ones, then decodes ``running`` until the next boundary.
    """

    name: str

    def add(self, seqs: list[Sequence], now: float) -> None:
        """New sequences join the waiting set. ``now`` is ``time.monotonic()``."""

    def schedule(self, now: float) -> SchedulerOutput:
        """Admit and preempt; returns the decision and the running set after it."""

    def finish(self, seq: Sequence, now: float) -> None:
        """``seq`` left the system: free its slot or drop it from waiting. Idempotent."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


class FifoPolicy:
    """Plain first-come first-served admission, bounded by ``max_running``.

    No priority classes, no compute score, no preemption: waiting sequences are
    admitted in arrival order while fewer than ``max_running`` run. This is the
    scheduling most serving gateways start with, and the baseline the
    scheduler benchmark compares against.

    Args:
        max_running: most sequences running at once
            (``scheduler_config.json`` ``max_running_agents``); >= 1.
    """

    name = "fifo"

    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running: expected >= 1, got {max_running}")
        self.max_running = max_running
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, seqs: list[Sequence], now: float) -> None:
        self._waiting.extend(seqs)

    def schedule(self, now: float) -> SchedulerOutput:
        admitted: list[Sequence] = []
        while self._waiting and len(self._running) < self.max_running:
            seq = self._waiting.popleft()
            seq.admitted_at = now
            self._running.append(seq)
            admitted.append(seq)
        return SchedulerOutput(admitted=admitted, preempted=[], running=list(self._running))

    def finish(self, seq: Sequence, now: float) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)


SCHEDULER_MODULE = "switchyard.dispatcher.scheduler"


def make_policy(config: SwitchyardConfig, engine: object, name: str | None = None) -> SchedulingPolicy:
    """The scheduling policy the dispatcher runs.

    Args:
        config: the whole config (``scheduler_config.json`` in ``config.scheduler``).
        engine: the step engine (a policy may read its busy time for the compute score).
        name: ``"fifo"`` for :class:`FifoPolicy`; None or ``"priority"`` for the
            priority scheduler in ``switchyard.dispatcher.scheduler`` (its
            ``make_scheduler(config, engine)``), falling back to FIFO while
            that package is not installed.

    Raises:
        ValueError: unknown ``name``.
    """
    if name == "fifo":
        return FifoPolicy(config.scheduler.max_running_agents)
    if name not in (None, "priority"):
        raise ValueError(f"scheduling policy: expected 'fifo' or 'priority', got {name!r}")
    if importlib.util.find_spec(SCHEDULER_MODULE) is None:
        return FifoPolicy(config.scheduler.max_running_agents)
    module = importlib.import_module(SCHEDULER_MODULE)
    return module.make_scheduler(config, engine)
