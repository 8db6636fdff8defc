"""The interface between the engine loop and a scheduling policy.

The engine loop calls the scheduler on the event loop, never concurrently:

- :meth:`Scheduler.add` with each flushed batch (flush order);
- :meth:`Scheduler.schedule` at every time-slice boundary (every
  ``time_slice_ms`` of decode steps, and whenever the running set empties or
  new work arrives while idle): admit waiting work, decide preemptions;
- :meth:`Scheduler.finish` when a request ends (finished, cancelled, failed),
  running or still waiting;
- :meth:`Scheduler.park` instead of ``finish`` when a ``react_loop`` agent's
  step ends in a tool call (:func:`should_park`): the agent waits on a tool,
  holds no running slot, and its prefix state stays warm for ``tool_wait_ttl_s``.

The loop applies each :class:`SchedulerOutput`: for ``preempted`` it calls
``req.mark_preempted(now)`` and ``engine.release(req)``; it prefills
``admitted``; it decodes ``running`` until the next boundary. It releases the
KV state of finished requests, but not of parked ones: the scheduler owns
those and releases them when their TTL runs out or their agent resumes.

All times are ``time.monotonic()`` seconds, passed in as ``now`` so that tests
and the benchmark can drive a simulated clock.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from switchyard.api import agent_pb2
from switchyard.common.priority import LABELS
from switchyard.dispatcher.request import Request, SchedulerOutput

__all__ = ["CLASS_ORDER", "REACT_TASK_TYPE", "Scheduler", "SchedulerOutput", "class_rank", "should_park"]

CLASS_ORDER: tuple[str, ...] = LABELS
"""Priority class labels, most important first (:class:`switchyard.common.priority.PriorityClass`)."""

REACT_TASK_TYPE = "react_loop"
"""The task type whose agents alternate GPU thinking and tool waits."""

def class_rank(req: Request) -> int:
    """0 for core, 1 for normal, 2 for batch (unset priority counts as normal)."""
    return int(req.priority_class)


def class_name(req: Request) -> str:
    """core, normal or batch."""
    return req.priority_class.label


def should_park(req: Request) -> bool:
    """True when ``req`` ended its step waiting on a tool and will come back.

    That is a ``react_loop`` request with an ``agent_id`` that finished with
    ``finish_reason == "tool_calls"``: the agent's next Generate (``resume``
    set) continues the same prefix.
    """
    return req.task_type == REACT_TASK_TYPE and bool(req.agent_id) and req.finish_reason == "tool_calls"


@runtime_checkable
class Scheduler(Protocol):
    """A scheduling policy behind the engine loop (see the module docstring for the call order)."""

    name: str
    """Policy name: ``priority`` or ``fifo``."""

    def add(self, reqs: list[Request], now: float) -> None:
        """A flushed batch arrives: its requests join the waiting set.

        A request with ``resume`` set is a react_loop agent back from a tool
        call: it goes ahead of new work of its class, and reuses its agent's
        warm prefix state when the TTL has not run out (``num_computed_tokens``
        is set to the warm prefix; otherwise the prefix counts as recomputed).
        """

    def schedule(self, now: float) -> SchedulerOutput:
        """Decide at a time-slice boundary: admit waiting work, preempt running work.

        Also charges the running requests for the time slice that just ended
        (``compute_score_used``, ``memory_peak_bytes``) and releases the prefix
        state of parked agents whose ``tool_wait_ttl_s`` ran out.

        Returns:
            the admitted and preempted requests, and the running set after the
            decision (admitted included).
        """

    def finish(self, req: Request, now: float) -> None:
        """``req`` left the system (running or waiting): free its slot, learn its score. Idempotent."""

    def park(self, req: Request, now: float) -> None:
        """``req``'s agent now waits on a tool: free its running slot, keep its prefix state warm.

        The prefix state (``engine.kv_bytes(req)`` bytes) stays held, and
        counted in :attr:`parked_kv_bytes`, until the agent resumes or
        ``tool_wait_ttl_s`` passes; then the scheduler releases it.
        """

    def resume(self, req: Request, now: float) -> None:
        """Same as ``add([req], now)`` for a request with ``resume`` set."""

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests, in the order they will be admitted."""

    @property
    def running(self) -> list[Request]:
        """Running requests, in step order."""

    @property
    def parked(self) -> list[Request]:
        """Last request of each agent waiting on a tool with its prefix state warm."""

    @property
    def parked_kv_bytes(self) -> int:
        """Bytes of prefix state held for parked agents."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...
