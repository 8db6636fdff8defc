"""The SubmitTask tasks one orchestrator holds: the backlog and the running ones, in one registry.

A submitted task is recorded in the task store (QUEUED) and placed in the
backlog; at most ``orchestrator.max_running_submitted_tasks`` run at once, and
the next to start is the backlog's first of the most important priority class
(:class:`~switchyard.common.priority.PriorityClass`: CORE, then NORMAL, then
BATCH), first come first served within a class, as a task queue with priority
queues serves them (Celery's priority routing on Redis, RQ's queues in the
order a worker lists them). Its ``queue_position`` is the number of backlog
tasks that would start before it: a later CORE task goes ahead of waiting BATCH
ones, so a BATCH task's place can grow while it waits.

The registry also holds a finished task whose outcome the store has not taken
yet (``Submitted.final``), so GetTaskStatus answers it from here meanwhile.
``switchyard_submitted_tasks{state}`` counts its queued and running tasks, and
``switchyard_queue_wait_seconds{queue="submitted", outcome}`` each wait in the backlog, once, by how it ended:
the task started (admitted), its time limit had passed by then (expired: a task sent back to the backlog by a
refused run waits against the time limit of its first start), or it left unstarted (cancelled: CancelTask, or
the orchestrator stopping, which releases it to another orchestrator's backlog, where its next wait is observed).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque

from switchyard.api import agent_pb2
from switchyard.common.metrics import QUEUE_WAIT, QUEUE_WAIT_OUTCOMES
from switchyard.common.priority import PriorityClass
from switchyard.orchestrator.metrics import SUBMITTED_QUEUE, SUBMITTED_TASKS
from switchyard.orchestrator.task import Task
from switchyard.orchestrator.taskstore.base import TaskRecord
from switchyard.orchestrator.validation import TaskSpec

_QUEUED = SUBMITTED_TASKS.labels("queued")
_RUNNING = SUBMITTED_TASKS.labels("running")
_WAITS = {outcome: QUEUE_WAIT.labels(SUBMITTED_QUEUE, outcome) for outcome in QUEUE_WAIT_OUTCOMES}
"""``switchyard_queue_wait_seconds{queue="submitted"}`` by outcome, each series at 0 from start-up."""


class Submitted:
    """One submitted task held by this orchestrator: its request, its live state and timings.

    Args:
        spec: the validated request.
        trace_id: the trace of the SubmitTask call (empty with tracing off).
        context: the SubmitTask call's context (its span): the task's workflow runs in it, so its spans join
            the submit's trace whenever it starts.
        record: the task store's record of it as this orchestrator wrote or adopted it (None: none), written
            again from here where the store lost it (``TaskStore.mark_running``, ``TaskStore.finish``).
    """

    __slots__ = ("spec", "trace_id", "context", "priority", "submitted_at", "first_started_at", "state", "timings",
                 "final", "runner", "started", "cancelled", "task", "waits_again", "refused_alone", "record")

    def __init__(self, spec: TaskSpec, trace_id: str, context: contextvars.Context,
                 record: TaskRecord | None = None) -> None:
        self.spec = spec
        self.record = record
        self.trace_id = trace_id
        self.context = context
        self.priority = PriorityClass.from_proto(spec.priority)
        self.submitted_at = time.monotonic()
        """When it entered the backlog last (its submit, or a refusal that sent it back)."""
        self.first_started_at: float | None = None
        """When it first left the backlog: its time limit counts from here, over every start."""
        self.state = agent_pb2.QUEUED
        self.timings = agent_pb2.Timings()
        self.final: agent_pb2.TaskStatus | None = None
        """Set when the task finished but the store could not record it: answered from here instead."""
        self.runner: asyncio.Task[None] | None = None
        """The asyncio task running it; None while it waits in the backlog."""
        self.started = False
        """Its runner has begun (from then on cancelling it means cancelling the runner)."""
        self.cancelled = False
        """CancelTask asked for it (the outcome names the caller, not a stopping orchestrator)."""
        self.task: Task | None = None
        """Its running state once its runner made it, kept while it waits to start again (a refused run sent it
        back): what it has consumed so far is read from it (the next run counts on from it), and its time
        limit's end (``Task.deadline_s``); None before its first start."""
        self.waits_again = False
        """Its last run was refused for want of room and it goes back to the backlog (set as that run ends)."""
        self.refused_alone = 0
        """Runs refused for want of room in a row while no other submitted task ran here (each starts again after
        a pause that doubles: ``service.ALONE_RESTART_S``); 0 after any other end."""

    @property
    def tenant_id(self) -> str:
        return self.spec.tenant_id

    def to_status(self, queue_position: int = 0) -> agent_pb2.TaskStatus:
        """GetTaskStatus's answer from the live state; ``queue_position`` while QUEUED."""
        if self.final is not None:
            return self.final
        status = agent_pb2.TaskStatus(task_id=self.spec.task_id, state=self.state, timings=self.timings,
                                      tenant_id=self.tenant_id,
                                      queue_position=queue_position if self.state == agent_pb2.QUEUED else 0)
        if self.task is not None:  # started: what its runs have consumed so far
            status.compute_score_used = self.task.compute_score_used
            status.memory_peak_bytes = self.task.memory_peak_bytes
        return status


class SubmittedTasks:
    """Task id -> :class:`Submitted` for every submitted task this orchestrator holds, with the backlog's order.

    Args:
        max_running: most tasks :meth:`start_next` lets run at once (``orchestrator.max_running_submitted_tasks``).

    A task is queued (:meth:`add`), then started (:meth:`start_next`) or cancelled while queued
    (:meth:`remove_queued`); once started, :meth:`stopped` frees its place among the running, and
    :meth:`forget` drops it when its outcome is recorded. ``len()`` counts every task held (the admission
    bound ``orchestrator.max_unfinished_submitted_tasks`` reads it).
    """

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self._tasks: dict[str, Submitted] = {}
        self._backlog: tuple[deque[str], ...] = tuple(deque() for _ in PriorityClass)
        """Task ids waiting to start, one FIFO per priority class, indexed by the class's rank."""
        self.running = 0
        """Tasks started whose workflow has not ended."""

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, task_id: str) -> Submitted | None:
        return self._tasks.get(task_id)

    def add(self, entry: Submitted) -> int:
        """Queue ``entry`` last of its class; returns its queue position (backlog tasks that start before it)."""
        task_id = entry.spec.task_id
        assert task_id not in self._tasks, f"{task_id} is held already"
        self._tasks[task_id] = entry
        rank = entry.priority.value
        self._backlog[rank].append(task_id)
        _QUEUED.inc()
        return sum(len(q) for q in self._backlog[:rank + 1]) - 1

    def position(self, task_id: str) -> int:
        """Backlog tasks that start before ``task_id`` (0: it is next). O(backlog).

        Raises:
            KeyError: ``task_id`` is not in the backlog.
        """
        entry = self._tasks[task_id]
        rank = entry.priority.value
        try:
            index = self._backlog[rank].index(task_id)
        except ValueError:
            raise KeyError(task_id) from None
        return sum(len(q) for q in self._backlog[:rank]) + index

    def start_next(self, held: frozenset[str] = frozenset()) -> Submitted | None:
        """The next task to start (the most important class's first whose workflow is not in ``held``), now
        counted as running; None when ``max_running`` run already, or no task waits but of a held workflow. A
        task of a held workflow (one whose downstream service is down) keeps its place. The caller starts it and
        sets ``runner``."""
        if self.running >= self.max_running:
            return None
        for queue in self._backlog:
            for index, task_id in enumerate(queue):
                entry = self._tasks[task_id]
                if entry.spec.workflow in held:
                    continue
                del queue[index]
                entry.state = agent_pb2.RUNNING
                # started again past the time limit of its first start (its last run's deadline)
                expired = entry.task is not None and time.monotonic() >= entry.task.deadline_s
                _left_backlog(entry, "expired" if expired else "admitted")  # expired: its run fails at once
                self.running += 1
                _QUEUED.dec()
                _RUNNING.inc()
                return entry
        return None

    def stopped(self, entry: Submitted) -> None:
        """A started task's workflow ended: its place among the running is free."""
        assert entry.runner is not None
        self.running -= 1
        _RUNNING.dec()

    def wait_again(self, entry: Submitted) -> None:
        """Put a started task whose run was refused for want of room (its runner ended, :meth:`stopped` called)
        back first in its class's backlog: it starts again before any task that waits behind it."""
        assert entry.runner is not None and entry.final is None
        entry.runner, entry.started = None, False  # its task kept: what its runs consumed, its deadline
        entry.state = agent_pb2.QUEUED
        entry.submitted_at = time.monotonic()
        self._backlog[entry.priority.value].appendleft(entry.spec.task_id)
        _QUEUED.inc()

    def remove_queued(self, task_id: str) -> Submitted | None:
        """Take ``task_id`` out of the backlog (it will not start); None when it is not queued here. The entry
        stays held until :meth:`forget`."""
        entry = self._tasks.get(task_id)
        if entry is None or entry.runner is not None or entry.state != agent_pb2.QUEUED:
            return None
        self._backlog[entry.priority.value].remove(task_id)
        entry.state = agent_pb2.FAILED
        _QUEUED.dec()
        _left_backlog(entry, "cancelled")
        return entry

    def drain_backlog(self) -> list[Submitted]:
        """Take every queued task out of the backlog (an orchestrator stopping), most important first."""
        entries = []
        for queue in self._backlog:
            while queue:
                entry = self._tasks[queue.popleft()]
                entry.state = agent_pb2.FAILED
                _QUEUED.dec()
                _left_backlog(entry, "cancelled")
                entries.append(entry)
        return entries

    def forget(self, task_id: str) -> None:
        """Drop a task that is no longer queued or running (its outcome is recorded, or it was refused)."""
        entry = self._tasks.get(task_id)
        if entry is not None and entry.state == agent_pb2.QUEUED and entry.runner is None:
            self._backlog[entry.priority.value].remove(task_id)
            _QUEUED.dec()
            _left_backlog(entry, "cancelled")
        self._tasks.pop(task_id, None)

    def started(self) -> list[Submitted]:
        """The tasks started whose runner is not done yet."""
        return [e for e in self._tasks.values() if e.runner is not None and not e.runner.done()]


def _left_backlog(entry: Submitted, outcome: str) -> None:
    """``entry`` left the backlog, its wait ended with ``outcome`` (one of ``QUEUE_WAIT_OUTCOMES``): the wait,
    seconds since it entered (:attr:`Submitted.submitted_at`), is observed in
    ``switchyard_queue_wait_seconds{queue="submitted"}`` and added to its ``timings.queue_wait_s["submitted"]``
    (over every wait of a task that waited again). Called once per wait, where the backlog lets it go."""
    wait = time.monotonic() - entry.submitted_at
    _WAITS[outcome].observe(wait)
    waits = entry.timings.queue_wait_s
    waits[SUBMITTED_QUEUE] = waits.get(SUBMITTED_QUEUE, 0.0) + wait
