"""The scheduler's one interface: a state machine the step loop drives, one call at a time.

Shape after vLLM's v1 scheduler interface (``vllm/v1/core/sched/interface.py``)
and its engine core's step (``vllm/v1/engine/core.py`` ``step()``:
``schedule()`` -> ``execute_model()`` -> ``update_from_output()``). The loop
(:mod:`switchyard.dispatcher.engine_loop` for step engines,
:mod:`switchyard.dispatcher.stream_loop` for stream engines) is the only
caller, on the event loop, never concurrently. It runs, turn after turn:

1. :meth:`Scheduler.schedule` ``(now) -> SchedulerOutput``: the double buffer's
   active list joins the waiting queue, requests past their queue timeout or
   own deadline end, waiting work is admitted into the running set and
   running work preempted (its KV freed or swapped to DRAM);
2. the engine runs the step the scheduler composed
   (:meth:`Scheduler.compose_batch` -> ``engine.execute_model``) and reports a
   :class:`~switchyard.dispatcher.engines.base.StepResult`;
3. :meth:`Scheduler.update_from_output` writes the result into its requests
   (tokens, computed prefix, the one stop check) and returns one
   :class:`~switchyard.dispatcher.request.RequestOutput` per request that
   produced something or ended; the loop publishes them to the requests'
   output streams.

Beside the turn: :meth:`Scheduler.add_request` (a Generate arrived; refused at
once when the queue is full), :meth:`Scheduler.finish_requests` (the caller went
away, the engine failed), :meth:`Scheduler.make_stats` (what the loop publishes
to the metrics after each decision). Every call that ends requests returns
their outputs; nothing inside the scheduler writes to a stream, starts a timer,
or touches asyncio: the loop owns time (the double buffer's flush-interval
timer included: :attr:`Scheduler.flush_deadline`).

The scheduler is composed, not inherited, of: a request queue per policy
(:mod:`.request_queue`: the policy's ``order_key``), the compute-score
admission rule (:mod:`.admission`), the running set's capacity
(:mod:`.capacity`), the KV cache manager of the engine with the memory tiers
as its client (:mod:`switchyard.dispatcher.tiers`), and the parked agents
(:mod:`.parking`). A request's accounting lives on the request.

All times are ``time.monotonic()`` seconds passed in as ``now``, so tests and
the benchmarks drive a simulated clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from switchyard.common.priority import LABELS
from switchyard.dispatcher.request import Request, RequestOutput, RequestStatus, SchedulerOutput

if TYPE_CHECKING:
    from switchyard.dispatcher.engines.base import StepBatch, StepResult

__all__ = ["CLASS_ORDER", "REACT_TASK_TYPE", "Scheduler", "SchedulerOutput", "SchedulerStats", "class_rank",
           "should_park"]

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


@dataclass
class SchedulerStats:
    """What :meth:`Scheduler.make_stats` reports after a decision; the loop publishes it as gauges
    (after vLLM's ``SchedulerStats`` in ``vllm/v1/metrics/stats.py``).

    ``running`` / ``waiting``: requests by priority class label (core, normal, batch; waiting excludes
    the double buffer); ``num_waiting``: waiting plus buffered; ``num_queued``: accepted and never
    admitted (the inference queue's depth); ``parked``, ``parked_kv_bytes``: react_loop agents waiting on
    a tool and the bytes of prefix state kept warm for them; ``hbm_held_bytes``: bytes the KV budget holds
    (None: the capacity counts no bytes); ``compute_score``: 0-100, read at the last decision.
    """

    running: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASS_ORDER, 0))
    waiting: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASS_ORDER, 0))
    num_running: int = 0
    num_waiting: int = 0
    num_queued: int = 0
    parked: int = 0
    parked_kv_bytes: int = 0
    hbm_held_bytes: int | None = None
    compute_score: float = 0.0


@runtime_checkable
class Scheduler(Protocol):
    """A scheduling policy behind the step loop (see the module docstring for the call order)."""

    name: str
    """Policy name: ``priority`` or ``fifo``."""

    def add_request(self, req: Request, now: float) -> None:
        """Accept ``req`` (into the double buffer), or refuse it at once.

        A request with ``resume`` set is a react_loop agent back from a tool call: it goes ahead of new
        work of its class, and reuses its agent's warm prefix state when the TTL has not run out.

        Raises:
            DispatcherClosed: draining (UNAVAILABLE).
            QueueFullError: ``queues.inference.capacity`` requests wait already (RESOURCE_EXHAUSTED).
            InvalidArgument: it could never fit the engine (``max_tokens``).
        """

    def schedule(self, now: float) -> SchedulerOutput:
        """Decide at a step boundary: flush the intake, end expired work, admit waiting work, preempt.

        Also charges the running requests for the time since the last decision (``compute_score_used``,
        ``memory_peak_bytes``) and releases the prefix state of parked agents whose TTL ran out.

        Returns:
            the admitted and preempted requests, the running set after the decision, and the outputs of
            the requests that ended in it.
        """

    def compose_batch(self, prefill: list[Request], decode: list[Request],
                      budget: int | None = None) -> "StepBatch":
        """The engine step over ``prefill`` and ``decode`` (prefix-cache hits taken; chunked under
        ``budget`` prompt tokens when given)."""

    def update_from_output(self, batch: "StepBatch", result: "StepResult", now: float) -> list[RequestOutput]:
        """Write the engine's ``result`` for ``batch`` into its requests; the one stop check ends them.

        Returns:
            one output per request that produced something or ended, in ``batch`` order.
        """

    def finish_requests(self, seq_ids: list[int], status: RequestStatus, now: float,
                        error: BaseException | None = None) -> list[RequestOutput]:
        """End the requests held under ``seq_ids`` (``Request.seq_id``) with ``status`` wherever they are; idempotent.

        Returns:
            their outputs (each ``finished``).
        """

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state now, for the loop to publish (:class:`SchedulerStats`)."""

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
    def has_work(self) -> bool:
        """Anything buffered, waiting, running or leaving the running set."""

    @property
    def flush_deadline(self) -> float | None:
        """When the double buffer must be flushed (reason ``interval``), monotonic seconds; None: empty.
        The loop's timer calls ``flush`` then."""
