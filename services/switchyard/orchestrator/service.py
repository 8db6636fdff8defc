"""The orchestrator: AgentService (RunTask, SubmitTask, GetTaskStatus, CancelTask).

A request is validated (validation.py), takes its place and is ``accepted``,
then runs its workflow (workflows.py) inside its deadline; the final event
follows. The task's CPU work (rendering and counting its prompt) waits for a
worker of the bounded orchestration queue (``queues.orchestration`` in
queue.json) and runs in the CPU executor (``orchestrator.cpu_executor``: a
process pool by default); calls to retrieval and the dispatcher hold no
orchestration worker while they wait on the other services. With
``orchestrator.inference_mode = "inline"`` a task instead holds one worker for
its whole workflow: the one-mixed-queue baseline that the benchmark compares against.

A submitted task (SubmitTask) is accepted once it is recorded in the task store
and placed in the orchestrator's backlog of submitted tasks (submitted.py); at
most ``orchestrator.max_running_submitted_tasks`` of them run at once, so an
offered rate above what the stack completes grows the backlog, not the number
of workflows sharing this event loop. RunTask starts at once: its caller waits
on the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import AsyncIterator, Iterable, Mapping

import grpc
from opentelemetry import trace
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import children
from switchyard.common.untrusted import check_id, shown
from switchyard.common.auth import BearerAuthInterceptor, BearerTokens, TokenGuarded
from switchyard.common.channels import deadline_scope
from switchyard.common.config import SwitchyardConfig
from switchyard.common.dram import DramClient
from switchyard.common.metrics import QUEUE_CAPACITY, QUEUE_DEPTH, QUEUE_REJECTED, TASK_TYPES
from switchyard.common.metrics import SERVING as SERVING_GAUGE
from switchyard.common.errors import (InvalidArgument, ServiceUnavailable, SwitchyardError,
                                     TaskRefusedEarly, abort, hop_of, own_fault, status_for)
from switchyard.common.queues import WorkQueue
from switchyard.common.server import GRPC_SERVICES, Drains, EndsStreams, HealthOwner, InterceptsCalls
from switchyard.common.tasks import settle
from switchyard.common.tenant import DEFAULT_TENANT, agent_key
from switchyard.orchestrator import prompts, tokens
from switchyard.orchestrator.addresses import EdgeText
from switchyard.orchestrator.agent_memory import AgentMemory
from switchyard.orchestrator.clients import InferenceClient, RetrievalClient, reported_window
from switchyard.orchestrator.events import event_stream
from switchyard.orchestrator.metrics import (AGENTS_CONCURRENT, CLIENT_WRITE_TIMEOUTS, SUBMITTED_QUEUE, TASK_DURATION,
                                             TASK_TTFT, TASKS)
from switchyard.orchestrator.readiness import SERVING as READY
from switchyard.orchestrator.readiness import Readiness
from switchyard.orchestrator.submitted import Submitted, SubmittedTasks
from switchyard.orchestrator.task import Deps, Task
from switchyard.orchestrator.taskstore import (
    OutageLog,
    TaskRecord,
    TaskStore,
    TaskStoreUnavailable,
    fingerprint,
    make_task_store,
    task_status,
)
from switchyard.orchestrator.taskstore.base import RELEASED, TASKS_ADOPTED
from switchyard.orchestrator.validation import (TaskSpec, apply_edge_headers, edge_tenant, task_spec_of, token_tenant,
                                                validate)
from switchyard.orchestrator.workflows import WORKFLOWS, check_question_fits

log = logging.getLogger(__name__)


def _log_failure(task_id: str, exc: BaseException) -> None:
    """Log a task's INTERNAL failure, RunTask's and a submitted task's alike: a fault of the orchestrator itself
    (:func:`~switchyard.common.errors.own_fault`) at ERROR with its traceback; one another hop answered
    INTERNAL (a model server's malformed stream) as one WARNING line naming that hop, no traceback of the
    client code that relayed it. Other codes are answers (a refusal, a cut stream, a deadline): not logged."""
    if own_fault(exc, OrchestratorService.name):
        log.error("task %s failed", task_id, exc_info=exc)
    elif status_for(exc)[0] == grpc.StatusCode.INTERNAL:
        log.warning("task %s failed: INTERNAL from the %s: %s", task_id, hop_of(exc, OrchestratorService.name),
                    status_for(exc)[1])


def _trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def _init_cpu_worker(parent_pid: int) -> None:
    """A CPU worker process leaves SIGINT to its parent, which stops it through the executor, and dies with
    it (SIGKILL when the orchestrator ends, ``kill -9`` included: common/children.py).

    The multiprocessing resource tracker needs nothing of its own: it exits when every holder of its pipe
    (the orchestrator and these workers) has gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children.die_with_parent(parent_pid, signal.SIGKILL)


def _warm_cpu_worker() -> None:
    """Load the tokenizer's BPE ranks and the templates before the first task needs them (loading the
    ranks takes about half a second: on the event loop that is half a second of every caller waiting)."""
    tokens.encoding()
    prompts.render("chat", "warm-up")


async def _cpu_executor(kind: str, workers: int) -> Executor | None:
    """The executor for CPU-bound steps (``orchestrator.cpu_executor``), warmed up.

    Processes start with ``spawn``: forking a process that already runs gRPC's
    threads is unsafe. They are started from the event loop's thread (the
    warm-up below submits one job per worker), which lives as long as the
    process: the parent-death signal follows the thread that started them. The
    calling process is warmed whatever the kind: a step within
    ``orchestrator.cpu_inline_max_chars`` runs on its event loop.
    """
    executor: Executor | None
    _warm_cpu_worker()  # the event loop's own process too: steps within cpu_inline_max_chars run there
    if kind == "loop":
        return None
    if kind == "thread":
        executor = ThreadPoolExecutor(workers, thread_name_prefix="orchestration-cpu")
    else:
        executor = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_cpu_worker,
            initargs=(os.getpid(),),
        )
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(executor, _warm_cpu_worker) for _ in range(workers)))
    return executor


CANCEL_ANSWER_MARGIN_S = 0.25
"""A CancelTask waiting on another orchestrator answers this long before its caller's deadline, seconds: room
for the answer to reach the caller from a busy event loop."""

RECORD_TRY_WAIT_S = 0.1
"""First wait between two tries of an outcome's write while the task store refuses it, seconds (then doubled, up to
2 s; five tries)."""
RECORD_AGAIN_S = 1.0
"""First wait before an outcome the task store refused is written again, seconds (then doubled)."""
RECORD_AGAIN_MAX_S = 30.0
"""Longest wait between two writes of the refused outcomes, seconds."""

ALONE_RESTART_S = (0.05, 1.0)
"""Pause before a submitted task refused for want of room, with no other submitted task running here whose end
would start it again, starts again: the first, seconds, doubling per such refusal in a row up to the second
(:meth:`OrchestratorService._waits_again`)."""
DEADLINE_RACE_S = 0.05
"""A downstream DEADLINE_EXCEEDED within this many seconds of the task's deadline is the task's own running out
(its calls' gRPC deadlines are its time left), reported as such: :class:`TaskDeadlineExceeded`."""


def _out_of_time(task: Task) -> bool:
    """Whether ``task`` is within :data:`DEADLINE_RACE_S` of its deadline, or past it: the one test by which a
    downstream DEADLINE_EXCEEDED, or a cancellation by the caller's gRPC deadline, is the task running out."""
    return task.deadline_s - time.monotonic() <= DEADLINE_RACE_S


def _count_unrun(spec: TaskSpec, code: grpc.StatusCode) -> None:
    """Count in ``switchyard_tasks_total`` a submitted task that ended before it ran (cancelled or stopped while
    in the backlog): :meth:`OrchestratorService._execute` counts every task it runs."""
    TASKS.labels(spec.workflow, code.name).inc()


class OrchestratorService(agent_pb2_grpc.AgentServiceServicer, InterceptsCalls, HealthOwner, Drains, EndsStreams,
                          TokenGuarded):
    """AgentService servicer plus its queue, CPU pool, downstream clients and task store.

    Args:
        config: the loaded configuration; ``orchestrator`` gives the
            downstream addresses and the task store, ``queues.orchestration`` the queue.
    """

    name = "orchestrator"
    grpc_service_names = (GRPC_SERVICES["orchestrator"],)

    def __init__(self, config: SwitchyardConfig) -> None:
        self.config = config
        self.edge = EdgeText.for_config(config)
        """What callers read of the messages that leave this edge (both faces): internal addresses hidden."""
        self.tasks: TaskStore = make_task_store(config)
        self._submitted = SubmittedTasks(config.orchestrator.max_running_submitted_tasks)
        self._restarts: set[asyncio.TimerHandle] = set()
        """Timers that start the backlog again after a refusal with nothing else running (:meth:`_start_later`)."""
        QUEUE_REJECTED.labels(SUBMITTED_QUEUE, "full")  # at 0 before the first refusal: rate() sees the first
        # the backlog's fill as every queue's (the saturation rule and top read depth / capacity): the tasks held
        # unfinished, read from the backlog itself, against the bound that refuses a submit
        QUEUE_CAPACITY.labels(SUBMITTED_QUEUE).set(config.orchestrator.max_unfinished_submitted_tasks)
        QUEUE_DEPTH.labels(SUBMITTED_QUEUE).set_function(self._submitted.__len__)
        self._stopping = False
        """Set by :meth:`stop`: no submitted task starts any more."""
        self._streams: set[asyncio.Task[agent_pb2.FinalEvent]] = set()
        """RunTask's tasks in flight, of both faces (the HTTP face streams the servicer's RunTask)."""
        self._ended_by_stop: dict[asyncio.Task[agent_pb2.FinalEvent], SwitchyardError] = {}
        """Tasks :meth:`end_streams` ended, and the error each one's stream ends with."""
        self._deps: Deps | None = None
        self._dram: DramClient | None = None
        self.readiness: Readiness | None = None
        self._tokens: BearerTokens | None = None
        self._unrecorded: dict[str, tuple[Submitted, int, bytes, str]] = {}
        """Outcomes the task store refused (task id -> the entry and its outcome), written again by
        :meth:`_record_again` until it takes them, and once more at :meth:`stop`."""
        self._undeleted: set[str] = set()
        """Records of tasks refused after they were written (the backlog filled meanwhile) whose delete the store
        refused, deleted again by :meth:`_record_again` as the outcomes are written, or at once by a submit of
        the same task_id (a record left QUEUED on a live orchestrator that holds no such task is never swept: it
        read QUEUED for good, and the identical retry was answered it)."""
        self._recording: asyncio.Task[None] | None = None
        self._cancels: asyncio.Task[None] | None = None
        """:meth:`_carry_out_cancels`, from :meth:`start` to :meth:`stop`."""
        self._closing_store = False
        """Set by :meth:`stop` before its last write of the refused outcomes: one refused after it is lost
        (logged), not handed to a writer that would outlive the store."""
        self._draining = False
        """Set by :meth:`begin_drain`: ``switchyard_serving`` stays 0 whatever readiness finds."""

    # ------------------------------------------------------------------ lifecycle

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Bearer-token authentication when ``orchestrator.auth.enabled`` (see common/auth.py).

        Raises:
            AuthConfigError: auth is on and no token can be read.
        """
        tokens = self.bearer_tokens()
        return [BearerAuthInterceptor(tokens)] if tokens is not None else []

    def bearer_tokens(self) -> BearerTokens | None:
        """The edge's tokens (read once, shared by the gRPC and HTTP faces); None with auth off.

        Raises:
            AuthConfigError: auth is on and no token can be read.
        """
        if self._tokens is None and self.config.orchestrator.auth.enabled:
            self._tokens = BearerTokens(self.config.orchestrator.auth)
        return self._tokens

    def register(self, server: grpc.aio.Server) -> None:
        """AgentService on ``server``: this servicer's methods, RunTask's writes bounded (:class:`GrpcEdge`)."""
        agent_pb2_grpc.add_AgentServiceServicer_to_server(GrpcEdge(self), server)

    async def start(self) -> None:
        cfg = self.config
        orch = cfg.orchestrator
        await self.tasks.open()
        log.info("orchestrator: task store %s (instance %s)", self.tasks.name, self.tasks.owner)
        self._cancels = asyncio.create_task(self._carry_out_cancels(), name="carry-out-cancels")
        queue = WorkQueue("orchestration", cfg.queues.orchestration)
        queue.start()
        self._deps = Deps(
            config=cfg,
            queue=queue,
            executor=await _cpu_executor(orch.cpu_executor, orch.cpu_workers),
            new_executor=lambda: _cpu_executor(orch.cpu_executor, orch.cpu_workers),
            retrieval=RetrievalClient(orch.retrieval_addr, cfg.server, orch.retrieval_timeout_ms / 1000,
                                      cfg.limits.max_query_chars),
            inference=InferenceClient(orch.dispatcher_addr, cfg.server, orch.affinity, orch.program,
                                      token_hold_s=orch.token_hold_s),
            memory=await self._agent_memory(),
            edge=self.edge,
        )
        log.info(
            "orchestrator: retrieval at %s, dispatcher at %s, inference_mode %s",
            orch.retrieval_addr, orch.dispatcher_addr, orch.inference_mode,
        )
        self.tasks.adopt = self._adopt_queued  # every lease_s, after the sweep
        try:  # the tasks a stopped (or killed) orchestrator left QUEUED: a restart on the same store runs them
            await self._adopt_queued()
        except SwitchyardError as exc:
            log.warning("orchestrator: could not adopt QUEUED tasks at start (tried again every lease_s): %s", exc)

    async def _agent_memory(self) -> AgentMemory | None:
        """Agent memory in the DRAM tier's Redis; an unreachable Redis is logged and retried, never fatal."""
        if not self.config.memory.agent_memory.enabled:
            return None
        self._dram = DramClient(self.config.memory.dram)
        await self._dram.start()
        return AgentMemory(self._dram, self.config.memory.agent_memory)

    async def watch_health(self, health) -> None:
        """Readiness follows the downstream services' health (see readiness.py); liveness ("") does not."""
        assert self._deps is not None, "start() not called"
        orch = self.config.orchestrator

        async def set_status(name: str, status: int) -> None:
            await health.set(name, status)
            if name == GRPC_SERVICES["orchestrator"] and not self._draining:  # the probe's name: switchyard_serving's
                SERVING_GAUGE.labels(self.name).set(1 if status == READY else 0)

        self.readiness = Readiness(
            set_status,
            {
                "dispatcher": (self._deps.inference.channel, orch.dispatcher_addr),
                "retrieval": (self._deps.retrieval.channel, orch.retrieval_addr),
            },
            orch.default_task_type,
            orch.health_check_interval_s,
            orch.health_check_timeout_s,
            {"dispatcher": self._deps.inference.replicas} if self._deps.inference.replicas is not None else None,
            on_back=self._downstream_back,
        )
        await self.readiness.start()

    def _held_workflows(self) -> frozenset[str]:
        """The workflows whose submitted tasks wait in the backlog now: those a downstream service they cannot
        run without was found down by readiness' last round (``Readiness.unready``)."""
        if self.readiness is None:
            return frozenset()
        return frozenset(workflow for workflow in TASK_TYPES if self.readiness.unready(workflow))

    def _downstream_back(self, name: str) -> None:
        """Readiness found ``name`` ready after not: a dispatcher back may be another build, serving another model
        or window (its DescribeModel is asked again). The submitted tasks held for it start (once the round has
        recorded it ready: :meth:`_start_submitted`)."""
        if name == "dispatcher" and self._deps is not None:
            self._deps.inference.dispatcher_back()
        asyncio.get_running_loop().call_soon(self._start_submitted)

    def not_ready(self) -> str | None:
        """Why the orchestrator does not take tasks of its default type now, as its health name
        ``agent.AgentService`` answers NOT_SERVING (a service it needs was not found ready, named with what its last
        health check found: :attr:`Readiness.why`), or it is draining or not yet checking; None when it does. The HTTP
        face's ``/readyz`` answers it."""
        if self._draining:
            return "the orchestrator is draining (SIGTERM); send to another replica"
        if self.readiness is None or not self.readiness.checked:
            return "the orchestrator is starting: its downstream services' health is not checked yet"
        unready = self.readiness.not_serving(self.config.orchestrator.default_task_type)
        if unready:
            service, target = unready[0]
            return f"{service} at {target}: {self.readiness.why.get(service) or 'not checked yet'}"
        return None

    async def begin_drain(self) -> None:
        """SIGTERM: ``switchyard_serving`` stays at the 0 the server set (readiness may still find the downstream
        services ready while the calls in flight drain), and no new task is taken (:meth:`_refuse_new_work`)."""
        self._draining = True

    def _refuse_new_work(self) -> None:
        """Refuse a new task (RunTask, SubmitTask) once the drain began: the gRPC server refuses new calls itself,
        but a call still being validated at SIGTERM, and a request on one of the HTTP face's keep-alive
        connections (its listener closes, its connections stay open through the drain), reached here, and were
        run (or queued, to be recorded FAILED at the stop) while ``/readyz`` said to send to another replica.

        Raises:
            SwitchyardError: UNAVAILABLE naming the drain (HTTP 503): nothing was accepted, so it may be sent
                again, to another replica.
        """
        if self._draining:
            raise SwitchyardError("orchestrator is draining (SIGTERM) and takes no new task; send it to another "
                                  "replica, or again once this one is back", grpc.StatusCode.UNAVAILABLE)

    async def end_streams(self, after_s: float) -> None:
        """The drain's end: RunTask streams still running ``after_s`` seconds (``server.shutdown_grace_s``) after
        SIGTERM are ended UNAVAILABLE naming the stop, on both faces (an ``error`` event on the HTTP face's). The
        gRPC server's own cancel, which came next, read 'Cancelling all calls', and cut an SSE stream with no event
        and its chunked body unterminated. The grace is waited out on every stream left, not on those running
        when it began only (a stream let in after that was ended at once, the grace unspent, once those had
        finished)."""
        clock = asyncio.get_running_loop().time
        deadline = clock() + after_s
        while self._streams and (left := deadline - clock()) > 0:
            await asyncio.wait(set(self._streams), timeout=left)
        error = SwitchyardError(
            f"orchestrator is stopping: the task was still running after server.shutdown_grace_s = {after_s:g} s "
            "of draining and was ended; run it again (on another replica, or once this one is back)",
            grpc.StatusCode.UNAVAILABLE)
        ended = set()
        for task in list(self._streams):
            self._ended_by_stop[task] = error  # before the cancel: _execute counts the task UNAVAILABLE by it
            if task.cancel():
                ended.add(task)
            else:
                del self._ended_by_stop[task]
        if ended:
            await asyncio.wait(ended)

    async def stop(self) -> None:
        """Stop: no submitted task starts any more; each still in the backlog is released, left QUEUED in the
        store for another orchestrator (or this one restarted) to adopt and run (:meth:`_release`); the running
        ones get ``server.shutdown_grace_s`` to finish, then are cancelled and recorded FAILED naming the stop (a
        task queue's warm shutdown: what runs finishes, what waits goes back to the queue) before the store
        closes. Cancel requests other replicas record are carried out until then (the gRPC server is closed by
        now: the store is the one way a CancelTask reaches a task running through its grace)."""
        if self.readiness is not None:
            await self.readiness.stop()
        self._stopping = True
        for handle in self._restarts:
            handle.cancel()
        self._restarts.clear()
        drained = self._submitted.drain_backlog()
        unstarted = [entry for entry in drained if entry.first_started_at is None]
        for entry in unstarted:  # forgotten at once: a status read meanwhile answers the store's QUEUED
            self._submitted.forget(entry.spec.task_id)
        await asyncio.gather(*(self._release(entry) for entry in unstarted))  # one group commit in SQLite
        for entry in drained:
            if entry.first_started_at is None:
                continue
            # it ran, and was refused for want of room: it may have generated tokens, and never runs twice
            _count_unrun(entry.spec, grpc.StatusCode.CANCELLED)
            entry.timings.total_s = time.monotonic() - entry.first_started_at  # from its first start, to its end
            consumed = entry.task.consumed().SerializeToString() if entry.task is not None else b""
            await self._record_finish(entry, agent_pb2.FAILED, consumed, "CANCELLED: the orchestrator stopped while "
                                      "the task waited to start again; resubmit it under a new task_id")
        if started := self._submitted.started():
            await asyncio.wait({e.runner for e in started if e.runner is not None},
                               timeout=self.config.server.shutdown_grace_s)
        runners = set()
        for entry in self._submitted.started():
            assert entry.runner is not None
            runners.add(entry.runner)
            if entry.started:  # one not begun yet sees ``_stopping`` as it begins
                entry.runner.cancel()
        if runners:  # each records its task as FAILED before the store closes
            await asyncio.wait(runners, timeout=5.0)
        if self._cancels is not None:  # read until no task runs: the store is the one way to it once the server is closed
            self._cancels.cancel()
            await asyncio.gather(self._cancels, return_exceptions=True)
        if self._recording is not None:
            self._recording.cancel()
            await asyncio.gather(self._recording, return_exceptions=True)
        self._closing_store = True
        if (self._unrecorded or self._undeleted) and await self._write_unrecorded():  # a last try before it closes
            if self._unrecorded:
                log.error("%d task outcome(s) the task store refused are lost with this orchestrator: %s",
                          len(self._unrecorded), ", ".join(sorted(self._unrecorded)[:10]))
            if self._undeleted:  # QUEUED records of a gone owner, keeping their requests: adopted elsewhere
                log.warning("%d refused task(s) keep their QUEUED records, which another orchestrator adopts and runs "
                            "once this one's lease runs out, though their SubmitTask was refused: %s",
                            len(self._undeleted), ", ".join(sorted(self._undeleted)[:10]))
        await self.tasks.close()
        deps, self._deps = self._deps, None
        if deps is not None:
            await deps.queue.stop()
            await deps.retrieval.close()
            await deps.inference.close()
            if deps.executor is not None:  # wait, so worker processes and their semaphores are reaped
                await asyncio.to_thread(deps.executor.shutdown, wait=True, cancel_futures=True)
        if self._dram is not None:
            await self._dram.close()
            self._dram = None

    # ------------------------------------------------------------------ running a task

    def _new_task(self, spec: TaskSpec, emit, context: grpc.aio.ServicerContext | None,
                  started_at: float | None = None) -> Task:
        """The task's state. Its deadline is its type's time limit from ``started_at`` (monotonic seconds; now
        when None) or the caller's gRPC deadline, whichever comes first (the orchestrator owns a task's
        lifetime); ``started_at`` is its ``t0`` too, what its timings count from: a RunTask's arrival, before
        its validation (which may ask the dispatcher what it serves, and count a long question's tokens: its
        caller's wait, counted as the dispatcher counts its own validation in its TTFT); a submitted task's
        first start (started again after a refusal: ``total_s`` and ``ttft_s`` from its first start, over every
        run, as its time limit; from the last run's start they read 3 ms for a task that tried for 5 s)."""
        assert self._deps is not None, "start() not called"
        orch = self.config.orchestrator
        now = time.monotonic()
        limit = orch.task_time_limit_s[spec.workflow]
        deadline = (now if started_at is None else started_at) + limit
        source = f"orchestrator.task_time_limit_s.{spec.workflow} = {limit:g}"
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None and now + remaining < deadline:
            deadline, source = now + remaining, "the caller's gRPC deadline"
        return Task(spec=spec, deps=self._deps, emit=emit, deadline_s=deadline, deadline_source=source,
                    inline=orch.inference_mode == "inline", trace_id=_trace_id(),
                    t0=now if started_at is None else started_at)

    def _record_metadata(self, metadata: Mapping[str, str]) -> None:
        """The allow-listed metadata (``orchestrator.metadata_span_keys``) as attributes of the RPC's span."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        for key in self.config.orchestrator.metadata_span_keys:
            if key in metadata:
                span.set_attribute(f"switchyard.metadata.{key}", metadata[key][:256])

    async def _run(self, task: Task) -> None:
        """Send ``accepted`` and run the task's workflow inside its deadline: every downstream call it
        starts gets at most the time left (channels.deadline_scope), and the workflow is cancelled when
        none is left.

        ``accepted`` carries the task's place in the orchestration queue: the items waiting there
        now. Inline, the whole workflow is the queue's item, and the task waits for a worker first.

        Raises:
            QueueFullError: the orchestration queue is full (before ``accepted``).
            QueueTimeoutError: inline, no worker took the task within the queue's timeout.
            TaskDeadlineExceeded: the deadline passed first.
            Exception: what the workflow raised.
        """
        workflow, queue = WORKFLOWS[task.spec.workflow], task.deps.queue
        with deadline_scope(task.deadline_s):
            limit = asyncio.timeout(task.deadline_s - time.monotonic())
            try:
                async with limit:
                    if task.inline:
                        ticket = queue.submit(lambda: workflow(task))
                        task.accept(ticket.position)
                        _, wait = await ticket.result()
                        task.add_wait(queue.name, wait)
                    else:
                        task.accept(queue.place())
                        await workflow(task)
            except TimeoutError:
                if not limit.expired():
                    raise  # a stage's own timeout, reported by that stage
                raise task.out_of_time() from None
            except SwitchyardError as exc:
                # A downstream call's gRPC deadline is the task's time left: it may fire a moment before the
                # task's own timer does, as the hop's bare "Deadline Exceeded". The task ran out of time.
                if (exc.code != grpc.StatusCode.DEADLINE_EXCEEDED or isinstance(exc, TaskRefusedEarly)
                        or not _out_of_time(task)):
                    raise  # not a deadline, or the task's own refusal, which names why
                raise task.out_of_time() from exc

    async def _execute(self, task: Task, submitted: Submitted | None = None) -> agent_pb2.FinalEvent:
        """Run the task; returns the final event (also emitted). A submitted task's run (``submitted``) refused
        for want of room goes back to the backlog (``submitted.waits_again``, :meth:`_waits_again`): no task
        finished, none is counted."""
        AGENTS_CONCURRENT.inc()
        code = grpc.StatusCode.OK
        waits_again = False
        workflow = task.spec.workflow
        try:
            await self._run(task)
            final = task.final_event()
            task.emit(agent_pb2.TaskEvent(final=final))
            TASK_DURATION.labels(workflow).observe(final.timings.total_s)
            if task.token_index:
                TASK_TTFT.labels(workflow).observe(final.timings.ttft_s)
            return final
        except BaseException as exc:
            code = status_for(exc)[0]
            if isinstance(exc, asyncio.CancelledError):  # the caller left, or its gRPC deadline (the task's) passed
                code = grpc.StatusCode.DEADLINE_EXCEEDED if _out_of_time(task) else grpc.StatusCode.CANCELLED
                if asyncio.current_task() in self._ended_by_stop:  # or the drain ended it (end_streams)
                    code = grpc.StatusCode.UNAVAILABLE
            if submitted is not None:
                waits_again = submitted.waits_again = self._waits_again(submitted, exc)
            raise
        finally:
            AGENTS_CONCURRENT.dec()
            if not waits_again:
                TASKS.labels(workflow, code.name).inc()

    async def _new_task_spec(self, request: agent_pb2.RunTaskRequest,
                             context: grpc.aio.ServicerContext) -> TaskSpec:
        """A new task at the edge, the one path of RunTask and SubmitTask (the HTTP face's included): the
        ``x-agent-id`` and ``x-priority`` headers fill what the request left unset (:func:`apply_edge_headers`),
        the caller's tenant is chosen (:func:`edge_tenant`), the request is checked (:meth:`_validate`), and a
        task that passes is still refused while the orchestrator drains (:meth:`_refuse_new_work`).

        Raises:
            SwitchyardError: INVALID_ARGUMENT naming the field or header, NOT_FOUND naming the model,
                PERMISSION_DENIED naming ``x-tenant-id`` (another tenant than the bearer token's), UNAVAILABLE
                naming the dispatcher (it could not be asked what it serves) or the drain.
        """
        apply_edge_headers(request, context.invocation_metadata(), self.config.limits.max_id_chars)
        tenant = edge_tenant(context.invocation_metadata(), self.bearer_tokens())
        spec = await self._validate(request, tenant)
        self._refuse_new_work()
        return spec

    async def _validate(self, request: agent_pb2.RunTaskRequest, tenant: str) -> TaskSpec:
        """:func:`validate` against what the dispatcher serves (asked once): the model a request naming none
        is served, and the model names it serves (a step engine's one, or those its upstream lists: another is
        NOT_FOUND before the task is accepted; an upstream whose list was not read refuses none);
        and a max_tokens out of range, or a question too long for the model's context window beside it, is
        refused here, not after acceptance (:func:`check_question_fits`)."""
        assert self._deps is not None, "start() not called"
        named = request.model if len(request.model) <= self.config.limits.max_id_chars else ""  # validate names it
        info = await self._deps.inference.model_info(model=named)
        reported = reported_window(info, request.model or info.model)
        # a dispatcher of an earlier build lists no models: its step engine's one model is what serves_only_model said
        served = list(info.models) or ([info.model] if info.serves_only_model else [])
        spec = validate(request, self.config, info.model, tenant, served=served, reported_window=reported)
        model = spec.model or info.model
        window = self.config.limits.context_window(model, reported, self._deps.inference.prompt_token_ratio(model))
        await check_question_fits(spec, model, window, self.config.limits, request.max_tokens)
        return spec

    def _check_ready(self, workflow: str) -> None:
        """Refuse a RunTask of ``workflow`` at once while a service it needs does not answer its health check
        (readiness, every ``orchestrator.health_check_interval_s``): a stopped dispatcher (SIGSTOP, a hung
        process) keeps its connections open, and the task would wait for it until its deadline.

        Raises:
            ServiceUnavailable: naming the first such service and its address (UNAVAILABLE).
        """
        unready = self.readiness.unready(workflow) if self.readiness is not None else []
        if unready:
            service, target = unready[0]
            raise ServiceUnavailable(service, target, self.readiness.why.get(service) or "not checked yet")

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException, keep: Iterable[str] = ()) -> None:
        """End the call with ``exc``'s status (:func:`abort`), its details as the caller reads them
        (:meth:`shown`; ``keep``: the caller's own ids the details quote, :meth:`EdgeText.text`). Always raises."""
        await abort(context, exc, self.name, shown=lambda details, hop: self.shown(details, hop, keep))

    def shown(self, details: str, hop: str = "", keep: Iterable[str] = ()) -> str:
        """``details`` (an error message of ``hop``) as a caller of either face reads it (:class:`EdgeText`:
        internal addresses hidden unless ``orchestrator.show_addresses_to_callers``; ``keep``: the caller's own
        ids it quotes, left). Where that changes them, the whole message stays in the operator's view: an event
        on the call's span (``addresses.ERROR_EVENT``) and a log line."""
        text = self.edge.text_kept_on_span(details, hop, keep)
        if text != details:
            log.info("a caller was answered with internal addresses hidden (orchestrator.show_addresses_to_callers "
                     "= false); in full, from %s: %s", hop or self.name, details)
        return text

    # ------------------------------------------------------------------ RPCs

    async def RunTask(
        self, request: agent_pb2.RunTaskRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.TaskEvent]:
        """Run one task and stream its events: accepted, then stage, token, tool_call and tool_result
        events as they happen, then final. Tokens waiting together leave as one token event; a BATCH
        task's tokens after its first gather for ``orchestrator.batch_token_flush_interval_ms``.

        The stream ends with an error status instead: INVALID_ARGUMENT naming the field (before
        accepted; ``payload`` after it when the prompt overflows the context window),
        RESOURCE_EXHAUSTED naming the orchestration queue (before accepted), DEADLINE_EXCEEDED naming
        the task's time limit or a queue's timeout, UNAVAILABLE naming a downstream service that did
        not answer, or the status a downstream service answered, its hop named.
        """
        arrived = time.monotonic()  # its timings and time limit count from here, its validation included
        try:
            spec = await self._new_task_spec(request, context)
            self._check_ready(spec.workflow)
        except SwitchyardError as exc:
            await self._abort(context, exc, _caller_ids(request))
        self._record_metadata(request.metadata)
        events = event_stream()
        task = asyncio.create_task(self._execute(self._new_task(spec, events.put, context, started_at=arrived)),
                                   name=f"task-{spec.task_id}")
        task.add_done_callback(lambda _: events.close())
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        read = False
        # a BATCH task's tokens after the first gather for the flush interval and leave as one event (its model
        # calls carry the same hold to the dispatcher: InferenceClient)
        hold_s = self.config.orchestrator.token_hold_s(spec.priority)
        clock = asyncio.get_running_loop().time
        hold_until: float | None = None
        try:
            while (event := await events.get(hold_until)) is not None:
                yield event
                if hold_s and event.HasField("token"):
                    hold_until = clock() + hold_s
            ended = self._ended_by_stop.pop(task, None)  # the drain ended it (end_streams): its error, not a cancel
            exc, read = (ended if ended is not None else task.exception()), True
        finally:
            if not task.done():
                task.cancel()
            if not read:
                # The caller is gone (its deadline cancelled this handler), maybe just as the task ended with
                # an error of its own (the same deadline): that outcome has no reader left, so read it here.
                settle(task, expected=lambda e: not own_fault(e, self.name))
        if exc is not None:
            _log_failure(spec.task_id, exc)
            await self._abort(context, exc, _caller_ids(request))  # its ids quoted back whole, as its refusals'

    async def SubmitTask(
        self, request: agent_pb2.RunTaskRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.Accepted:
        """Validate the task, record it in the task store (QUEUED) and place it in the backlog of submitted
        tasks (submitted.py); returns once it is recorded, with its ``queue_position`` there.

        At most ``orchestrator.max_running_submitted_tasks`` submitted tasks run at once; the rest wait in
        priority-class order, then arrival, and start as running ones finish. What can be checked before the
        task runs is answered here: INVALID_ARGUMENT naming the field (validation.py, the model's context
        window included), RESOURCE_EXHAUSTED when ``orchestrator.max_unfinished_submitted_tasks`` tasks are
        held (nothing recorded), UNAVAILABLE naming the task store. What the task meets once it runs (a prompt
        over the window with its passages, a full orchestration queue, a downstream error, its time limit) is
        its FAILED status, read with GetTaskStatus.

        The same task_id with the same request answers the task already recorded (idempotent, any
        orchestrator sharing the store); with a different request it is ALREADY_EXISTS naming task_id. A task
        recorded is placed in the backlog even where its caller left meanwhile (its deadline passed while the
        store wrote): the retry that caller makes is answered that task, which runs.
        """
        try:
            spec = await self._new_task_spec(request, context)
            limit = self.config.orchestrator.max_unfinished_submitted_tasks
            if len(self._submitted) >= limit and not request.task_id:  # a task_id may name a task already recorded:
                raise self._backlog_full()  # its answer adds nothing to the backlog (a new one is refused below)
            if self._stopping:
                raise SwitchyardError("orchestrator is stopping; submit to another replica or retry after its restart",
                                      grpc.StatusCode.UNAVAILABLE)
            fields = {**vars(spec), "metadata": dict(request.metadata)}
            if not request.task_id:
                fields.pop("task_id")
            # Shielded: a caller that leaves (its deadline) once the store has the record must not leave a task
            # recorded QUEUED that no backlog holds (it never ran, and its identical retry was answered QUEUED).
            placing = settle(asyncio.create_task(self._record_submitted(spec, fields, _trace_id()),
                                                 name=f"submit-{spec.task_id}"),
                             expected=lambda e: isinstance(e, SwitchyardError))
            record, accepted = await asyncio.shield(placing)
        except SwitchyardError as exc:
            await self._abort(context, exc, _caller_ids(request))
        if accepted is not None:
            self._record_metadata(request.metadata)  # a task's, as RunTask records it: not a refused request's
            return accepted
        owner = record.tenant_id or DEFAULT_TENANT
        if owner != spec.tenant_id:
            if not self._visible_to_caller(record.tenant_id, context):  # nothing said of it but that it is taken
                await self._abort(context, SwitchyardError(
                    f"task_id: {shown(spec.task_id)} is taken (task ids are one namespace across tenants); use a "
                    "new task_id, or leave it empty for a random one", grpc.StatusCode.ALREADY_EXISTS),
                    _caller_ids(request))
            await self._abort(context, SwitchyardError(
                f"task_id: {shown(spec.task_id)} already exists under tenant {owner!r}, and this request is tenant "
                f"{spec.tenant_id!r}; send x-tenant-id: {owner} to get that task, or use a new task_id",
                grpc.StatusCode.ALREADY_EXISTS), _caller_ids(request))
        if record.fingerprint != fingerprint(fields):
            await self._abort(context, SwitchyardError(
                f"task_id: {shown(spec.task_id)} already exists with a different request; resubmit the identical "
                "request to get that task, or use a new task_id", grpc.StatusCode.ALREADY_EXISTS), _caller_ids(request))
        self._record_metadata(request.metadata)  # the task it submitted, answered again
        live = self._submitted.get(record.task_id)  # this process's state where it holds the task
        state = live.to_status(0).state if live is not None else record.state
        return agent_pb2.Accepted(task_id=record.task_id, queue_position=self._queue_position(record.task_id),
                                  trace_id=record.trace_id, state=state)

    async def _record_submitted(self, spec: TaskSpec, fields: dict[str, object],
                                trace_id: str) -> tuple[TaskRecord, agent_pb2.Accepted | None]:
        """Record ``spec`` in the task store (QUEUED) and place it in the backlog; (the record, the answer),
        the answer None where the store had the task_id already (the record is that task's). SubmitTask awaits
        it shielded: once the record is written it is placed, refused (deleted) or failed whatever its caller
        does.

        Raises:
            SwitchyardError: the store refused the record (UNAVAILABLE), or the backlog filled while it was
                written (RESOURCE_EXHAUSTED; the record is deleted).
        """
        kept = json.dumps(dataclasses.asdict(spec), separators=(",", ":"))  # what an adopter starts it from
        record, created = await self.tasks.create(spec.task_id, fingerprint(fields), trace_id, spec.agent_id,
                                                  spec.tenant_id, kept)
        if not created and spec.task_id in self._undeleted:
            # This orchestrator refused that task and the store kept its record (its delete is tried again
            # later): the record is of no task. Taken away now, and this submit recorded anew; read as the task
            # submitted, the caller's identical retry was answered QUEUED for a task no backlog held.
            await self.tasks.delete(spec.task_id)
            self._undeleted.discard(spec.task_id)
            record, created = await self.tasks.create(spec.task_id, fingerprint(fields), trace_id, spec.agent_id,
                                                      spec.tenant_id, kept)
        if not created:
            return record, None
        if self._stopping:  # stop() began while the record was written: it will not start here, but elsewhere
            await self._release(Submitted(spec, trace_id, contextvars.copy_context()))
            return record, agent_pb2.Accepted(task_id=spec.task_id, trace_id=trace_id, state=agent_pb2.QUEUED)
        if len(self._submitted) >= self.config.orchestrator.max_unfinished_submitted_tasks:
            # others were admitted while the record was written (no await from here on)
            await self._delete_refused(spec.task_id)
            raise self._backlog_full()
        position = self._submitted.add(Submitted(spec, trace_id, contextvars.copy_context(), record))
        self._start_submitted()
        return record, agent_pb2.Accepted(task_id=spec.task_id, queue_position=position, trace_id=trace_id,
                                          state=agent_pb2.QUEUED)

    async def _release(self, entry: Submitted) -> None:
        """Give up ``entry``, a task that never started here (this orchestrator stops): its record stays QUEUED,
        released (:meth:`TaskStore.release`), and a live orchestrator on the store adopts it at its next sweep
        (:meth:`_adopt_queued`); the entry is forgotten. A release the store refuses leaves the record this
        orchestrator's, adopted once its lease runs out: the task is not lost either way."""
        task_id = entry.spec.task_id
        self._submitted.forget(task_id)
        try:
            await self.tasks.release(task_id)
        except SwitchyardError as exc:
            log.warning("task %s: could not release it (%s); it is adopted once this orchestrator's lease runs out",
                        task_id, exc)

    async def _adopt_queued(self) -> None:
        """Adopt the QUEUED tasks that orchestrators which stopped (released them) or lost their lease left in the
        store, as many as this backlog has room for (``orchestrator.max_unfinished_submitted_tasks``, the bound
        a submit is refused by), the earliest submitted first; the rest wait for the next sweep or another
        replica. Each is claimed with a compare-and-set on its owner (:meth:`TaskStore.claim`): of orchestrators
        sweeping at once, one takes it. It joins the backlog last of its class, its wait counted from its submit.
        Called at start and after each sweep (every ``task_store.lease_s``). A draining orchestrator adopts none:
        it would start them beside its drain, where its stop may cut them, or release them again.

        Raises:
            TaskStoreUnavailable: the store could not be read or written.
        """
        limit = self.config.orchestrator.max_unfinished_submitted_tasks
        if self._stopping or self._draining or self._deps is None:
            return
        adopted = 0
        for record in await self.tasks.adoptable(limit - len(self._submitted)):
            if self._stopping or len(self._submitted) >= limit:
                break
            if not await self.tasks.claim(record):  # another orchestrator took it first
                continue
            if self._stopping or self._draining or len(self._submitted) >= limit:
                # the drain or stop() began during the claim (its backlog released already), or submits filled
                # the backlog meanwhile: given back for another sweep or replica
                await self.tasks.release(record.task_id)
                break
            try:
                spec = task_spec_of(record.spec)
            except (ValueError, TypeError) as exc:
                error = f"INTERNAL: its recorded request could not be read to start it ({exc}); resubmit it"
                log.error("task %s: %s", record.task_id, error)
                await self.tasks.finish(record.task_id, agent_pb2.FAILED, error=error)
                continue
            entry = Submitted(spec, record.trace_id, contextvars.copy_context(), record)
            # its wait in the backlog counts from its submit, whichever orchestrator it waited on
            entry.submitted_at -= max(0.0, time.time() - record.created_at)
            self._submitted.add(entry)
            TASKS_ADOPTED.inc()
            adopted += 1
        if adopted:
            log.info("orchestrator: adopted %d QUEUED task(s) of stopped orchestrators", adopted)
            self._start_submitted()

    def _backlog_full(self) -> SwitchyardError:
        """The RESOURCE_EXHAUSTED answer to a SubmitTask refused by a full backlog (``limit`` unfinished tasks
        held), counted as the refusal of a full queue: ``switchyard_queue_rejected_total{queue="submitted",
        reason="full"}``, where the alert on refusing queues reads it (the refusal was counted nowhere, and a
        stack refusing every submit raised no alert)."""
        QUEUE_REJECTED.labels(SUBMITTED_QUEUE, "full").inc()
        limit = self.config.orchestrator.max_unfinished_submitted_tasks
        return SwitchyardError(
            f"orchestrator holds {limit} unfinished submitted tasks (orchestrator.max_unfinished_submitted_tasks); "
            "poll GetTaskStatus and retry later", grpc.StatusCode.RESOURCE_EXHAUSTED)

    def _queue_position(self, task_id: str) -> int:
        """``task_id``'s place in this orchestrator's backlog; 0 when it is not queued here."""
        try:
            return self._submitted.position(task_id)
        except KeyError:
            return 0

    def _start_submitted(self) -> None:
        """Start backlog tasks while fewer than ``orchestrator.max_running_submitted_tasks`` run. A task whose
        workflow cannot run now (readiness found a service it needs down: a dispatcher restarting) is not started
        to fail at once: it waits, its place kept, until readiness finds the service back
        (:meth:`_downstream_back`), as a task queue holds its tasks while a worker restarts."""
        held = self._held_workflows()
        if held == frozenset(TASK_TYPES):
            return
        while not self._stopping and (entry := self._submitted.start_next(held)) is not None:
            entry.runner = asyncio.create_task(self._run_submitted(entry), name=f"submitted-{entry.spec.task_id}",
                                               context=entry.context)

    async def _run_submitted(self, entry: Submitted) -> None:
        """Run one submitted task (started from the backlog) and record its outcome. Its time limit counts
        from its first start; the wait in the backlog is ``timings.queue_wait_s["submitted"]``. A run refused
        for want of room goes back to the backlog instead (:meth:`_waits_again`)."""
        entry.started = True
        spec = entry.spec
        executing = adopted_away = False
        entry.waits_again = False
        t0 = time.monotonic()
        if entry.first_started_at is None:
            entry.first_started_at = t0
        task: Task | None = None
        try:
            if entry.cancelled or self._stopping:  # asked before this runner began
                raise asyncio.CancelledError
            # no reader: its status is read instead
            task = self._new_task(spec, lambda event: None, None, started_at=entry.first_started_at)
            task.trace_id = entry.trace_id
            task.timings = entry.timings  # one Timings: its status shows the task's waits and stages as they come
            if entry.task is not None:  # an earlier run was refused for want of room: what it consumed counts too
                task.count_earlier_run(entry.task)
            entry.task = task  # this run's wait in the backlog is in its timings already (SubmittedTasks.start_next)
            if not await self._record_running(entry):
                # another orchestrator adopted it while this one's lease had run out (a stall, a partition from
                # the store): it runs there, and must not run twice
                log.warning("task %s: adopted by another orchestrator before it started here; not run here",
                            spec.task_id)
                adopted_away = True
                raise asyncio.CancelledError
            executing = True  # _execute counts the task from here
            final = await self._execute(task, entry)
            state, result, error = agent_pb2.SUCCEEDED, final.SerializeToString(), ""
        except BaseException as exc:  # noqa: BLE001 - recorded for GetTaskStatus
            if not executing and not adopted_away:
                _count_unrun(spec, grpc.StatusCode.CANCELLED if isinstance(exc, asyncio.CancelledError)
                             else status_for(exc)[0])
            if isinstance(exc, asyncio.CancelledError):
                error = ("CANCELLED: cancelled by CancelTask while RUNNING" if entry.cancelled
                         else "CANCELLED: the orchestrator stopped before the task finished")
            else:
                code, details = status_for(exc)
                error = f"{code.name}: {details}"
                _log_failure(spec.task_id, exc)
            # from its first start, over every run (its waits and stages are in already: the task's own)
            entry.timings.total_s = time.monotonic() - entry.first_started_at
            # what it consumed before it failed (a react_loop cancelled in its third turn used two), its earlier
            # runs' included (``entry.task``: this run's, or the last run's where this one failed before it began)
            state, result = agent_pb2.FAILED, (entry.task.consumed().SerializeToString() if entry.task is not None
                                               else b"")
        finally:
            self._submitted.stopped(entry)
            if entry.waits_again:  # back in the backlog at once (no await between): the next task to end starts it
                self._submitted.wait_again(entry)
                if entry.refused_alone:  # none is running to end: a timer does
                    self._start_later(self._alone_pause(entry))
            else:
                self._start_submitted()
        if adopted_away:  # its record is the adopter's: nothing of it is this orchestrator's to answer or write
            self._submitted.forget(spec.task_id)
            return
        if entry.waits_again:
            log.debug("task %s: %s; it waits again in the backlog, first of its class, and starts when another "
                      "submitted task ends", spec.task_id, error)
            return
        self._keep_outcome(entry, state, result, error)  # from here CancelTask no longer cancels it
        await self._record_finish(entry, state, result, error)

    def _waits_again(self, entry: Submitted, exc: BaseException) -> bool:
        """Whether a submitted task whose run ended with ``exc`` goes back to the backlog instead of failing.

        So it does when the run was refused for want of room (RESOURCE_EXHAUSTED: a full queue here or
        downstream, the model server's rate limit) within its time limit from its first start: an accepted task
        waits in the backlog, as in a task queue, rather than failing with 'retry later' on a load its caller
        cannot see. Another submitted task's end starts it again; with none running here (the queue held by
        RunTask calls, or another orchestrator's work), it starts again after a pause
        (:data:`ALONE_RESTART_S`, doubling per such refusal in a row), and fails naming the refusal once that
        pause would pass its time limit. Running it again repeats nothing (its tools only read, and agent
        memory is written once a run succeeds). A task cancelled or an orchestrator stopping fails as ever."""
        if self._stopping or entry.cancelled or not isinstance(exc, Exception):
            return False
        if status_for(exc)[0] != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        assert entry.task is not None  # its deadline: the time limit from its first start (:meth:`_new_task`)
        if self._submitted.running >= 2:  # another's end starts it
            entry.refused_alone = 0
            return time.monotonic() < entry.task.deadline_s
        entry.refused_alone += 1
        return time.monotonic() + self._alone_pause(entry) < entry.task.deadline_s

    @staticmethod
    def _alone_pause(entry: Submitted) -> float:
        """Seconds before a task refused for want of room with no other submitted task running starts again."""
        first, most = ALONE_RESTART_S
        return min(most, first * 2 ** (entry.refused_alone - 1))

    def _start_later(self, delay_s: float) -> None:
        """Start backlog tasks (:meth:`_start_submitted`) in ``delay_s`` seconds; cancelled when the
        orchestrator stops."""
        def fire() -> None:
            self._restarts.discard(handle)
            self._start_submitted()

        handle = asyncio.get_running_loop().call_later(delay_s, fire)
        self._restarts.add(handle)

    async def _delete_refused(self, task_id: str) -> None:
        """Delete the record of a task refused after it was written; where the store refuses, again later
        (:meth:`_record_again`) until it takes it."""
        try:
            await self.tasks.delete(task_id)
        except SwitchyardError as exc:
            log.warning("task %s: refused before it was queued, but the task store did not delete its record: %s; "
                        "deleted again until the store takes it", task_id, exc)
            self._undeleted.add(task_id)
            self._write_again_later()

    def _visible_to_caller(self, tenant_id: str, context: grpc.aio.ServicerContext) -> bool:
        """Whether the caller may read a task of ``tenant_id``: always with auth off or a token that names no
        tenant (an ``x-tenant-id`` header is the caller's own word, not a credential), else only its own."""
        own = token_tenant(context.invocation_metadata(), self.bearer_tokens())
        return not own or own == (tenant_id or DEFAULT_TENANT)

    async def _record_running(self, entry: Submitted) -> bool:
        """Record RUNNING before the task's first step: from then on no other orchestrator adopts it (a task
        that may have generated tokens is never run twice). False when the record is another orchestrator's
        now (it adopted the task); a record the store lost (a Redis restarted without persistence) is written
        again from ``entry.record`` and the task runs. A store that refuses the write is logged and the task runs,
        as GetTaskStatus answers this process's live state meanwhile; where this orchestrator alone lost the store
        for longer than ``task_store.lease_s`` (a network partition), another one may have adopted the task as
        well."""
        try:
            return await self.tasks.mark_running(entry.spec.task_id, entry.record)
        except SwitchyardError as exc:
            log.warning("task %s: could not record RUNNING: %s", entry.spec.task_id, exc)
            return True

    @staticmethod
    def _keep_outcome(live: Submitted, state: int, result: bytes, error: str) -> None:
        """Set ``live.final``, the outcome this process answers until the store has it (as the store will)."""
        live.state, live.final = state, task_status(live.spec.task_id, state, error, live.tenant_id, live.timings,
                                                    result)

    async def _record_finish(self, live: Submitted, state: int, result: bytes, error: str) -> None:
        """Write the outcome; while the store refuses (tenacity: 5 tries, backoff to 2 s), keep answering
        it from this process."""
        task_id = live.spec.task_id
        if live.final is None:
            self._keep_outcome(live, state, result, error)
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(5), wait=wait_exponential(multiplier=RECORD_TRY_WAIT_S, max=2.0),
                retry=retry_if_exception_type(TaskStoreUnavailable), reraise=True,
            ):
                with attempt:
                    await self.tasks.finish(task_id, state, result=result, error=error,
                                            timings=live.timings.SerializeToString(), recorded=live.record)
        except SwitchyardError as exc:
            if self._closing_store:
                log.error("task %s: %s, but the task store did not record it: %s; the orchestrator is stopping, "
                          "so the outcome is lost", task_id, agent_pb2.TaskState.Name(state), exc)
                return
            log.warning("task %s: %s, but the task store did not record it: %s; this orchestrator answers it and "
                        "writes it again until the store takes it", task_id, agent_pb2.TaskState.Name(state), exc)
            self._unrecorded[task_id] = (live, state, result, error)
            self._write_again_later()
            return
        self._submitted.forget(task_id)

    def _write_again_later(self) -> None:
        """Start :meth:`_record_again` unless it runs."""
        if self._recording is None or self._recording.done():
            self._recording = asyncio.create_task(self._record_again(), name="record-outcomes-again")

    async def _write_unrecorded(self) -> int:
        """One try at each outcome the store refused, and at each refused task's delete; returns how many are
        still not written."""
        for task_id in list(self._undeleted):
            if task_id not in self._undeleted:  # an identical submit took it meanwhile (_record_submitted)
                continue
            try:
                await self.tasks.delete(task_id)
            except SwitchyardError:
                continue
            self._undeleted.discard(task_id)
            log.info("task %s: refused before it was queued, its record is deleted now", task_id)
        for task_id, (live, state, result, error) in list(self._unrecorded.items()):
            try:
                await self.tasks.finish(task_id, state, result=result, error=error,
                                        timings=live.timings.SerializeToString(), recorded=live.record)
            except SwitchyardError:
                continue
            del self._unrecorded[task_id]
            self._submitted.forget(task_id)
            log.info("task %s: its outcome (%s) is in the task store now", task_id, agent_pb2.TaskState.Name(state))
        return len(self._unrecorded) + len(self._undeleted)

    async def _record_again(self) -> None:
        """Write the refused outcomes again, every :data:`RECORD_AGAIN_S` seconds doubled up to
        :data:`RECORD_AGAIN_MAX_S`, until the store has taken them all (a finished task must not read as lost
        after this process stops: its store row says RUNNING until then), and delete the refused tasks' records
        the store kept."""
        wait = RECORD_AGAIN_S
        while self._unrecorded or self._undeleted:
            await asyncio.sleep(wait)
            if await self._write_unrecorded():
                wait = min(wait * 2, RECORD_AGAIN_MAX_S)

    async def CancelTask(
        self, request: agent_pb2.CancelTaskRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.TaskStatus:
        """Cancel a submitted task and answer its status after it (GetTaskStatus's shape).

        A task in this orchestrator's backlog is taken out (it never starts); a running one is cancelled, its
        downstream calls with it, and answered once its outcome is recorded. Either ends FAILED with error
        ``CANCELLED: cancelled by CancelTask while QUEUED`` (or ``RUNNING``). A finished task is answered
        unchanged (cancelling twice answers the first outcome).

        Errors: INVALID_ARGUMENT naming task_id when empty; NOT_FOUND naming task_id when the store has no
        such task, the record is one of a task this orchestrator refused (its delete not yet taken by the store),
        or the caller's token names another tenant than the task's (as GetTaskStatus);
        UNAVAILABLE naming the task store, or naming the orchestrator that holds the task when it neither ended
        it nor lost its lease within ``task_store.lease_s`` of the request (or, where the caller's deadline comes
        sooner, just before it).

        Any replica answers: a task another orchestrator holds is cancelled by it, asked through the task store
        (:meth:`TaskStore.request_cancel`, taken every ``task_store.cancel_poll_s``), and answered once its
        outcome is recorded; a task whose orchestrator died is answered FAILED naming it.
        """
        task_id = request.task_id
        if not task_id:
            await self._abort(context, InvalidArgument("task_id", "the id SubmitTask returned"))
        await self._check_lookup_ids(context, task_id)
        unknown = self._no_task(task_id)
        live = self._submitted.get(task_id)
        if live is not None and not self._visible_to_caller(live.tenant_id, context):
            await self._abort(context, SwitchyardError(unknown, grpc.StatusCode.NOT_FOUND), (task_id,))
        status = await self._cancel_held(task_id)
        if status is not None:
            return self.edge.status(status)
        if task_id in self._undeleted:  # no task: nothing holds it, and nothing would end it
            await self._abort(context, SwitchyardError(self._refused_task(task_id), grpc.StatusCode.NOT_FOUND),
                              (task_id,))
        try:
            record = await self.tasks.get(task_id)
            if record is None or not self._visible_to_caller(record.tenant_id, context):
                raise SwitchyardError(unknown, grpc.StatusCode.NOT_FOUND)
            if not record.finished:  # another's, or this one's not yet in its backlog (SubmitTask between the two)
                record = await self._cancel_elsewhere(record, context.time_remaining())
        except SwitchyardError as exc:
            await self._abort(context, exc, (task_id,))
        return self.edge.status(record.to_status())

    def _no_task(self, task_id: str) -> str:
        """NOT_FOUND's words for a task_id the store has no record of (CancelTask's and GetTaskStatus's)."""
        retention = self.config.orchestrator.task_store.retention_s
        return (f"task_id: no task {shown(task_id)} (never submitted, or finished more than {retention:g} s ago: "
                "orchestrator.task_store.retention_s)")

    @staticmethod
    def _refused_task(task_id: str) -> str:
        """NOT_FOUND's words for a task_id this orchestrator refused after its record was written (the backlog
        filled meanwhile) and whose record the store has not deleted yet (:meth:`_delete_refused`): no task."""
        return (f"task_id: no task {shown(task_id)} (its SubmitTask was refused RESOURCE_EXHAUSTED, the backlog "
                "full: orchestrator.max_unfinished_submitted_tasks; submit it again)")

    async def _cancel_held(self, task_id: str) -> agent_pb2.TaskStatus | None:
        """Cancel ``task_id`` if this orchestrator holds it and answer its status after it; None when it holds
        no such task. A queued task is taken out of the backlog, a running one cancelled and awaited until its
        outcome is recorded, a finished one answered unchanged. A queued task's outcome is recorded (and its
        entry forgotten) whatever the caller does meanwhile: out of the backlog, nothing else would."""
        entry = self._submitted.remove_queued(task_id)
        if entry is not None:
            entry.cancelled = True
            _count_unrun(entry.spec, grpc.StatusCode.CANCELLED)
            error = "CANCELLED: cancelled by CancelTask while QUEUED, before it started"
            if entry.first_started_at is None:
                entry.timings.total_s = 0.0
            else:  # it ran, and waits again (its run refused for want of room): its time from its first start
                entry.timings.total_s = time.monotonic() - entry.first_started_at
                error = ("CANCELLED: cancelled by CancelTask while QUEUED, waiting to start again (its run was "
                         "refused for want of room)")
            consumed = entry.task.consumed().SerializeToString() if entry.task is not None else b""  # its runs'
            # Shielded: a caller that left (its deadline) while the store wrote cut the write from the forget after
            # it, and the entry held a place of orchestrator.max_unfinished_submitted_tasks for good.
            await asyncio.shield(settle(asyncio.create_task(self._record_finish(
                entry, agent_pb2.FAILED, consumed, error), name=f"record-cancel-{task_id}"), expected=lambda e: False))
            return entry.to_status()
        entry = self._submitted.get(task_id)
        if entry is not None and entry.final is None and entry.runner is not None:
            entry.cancelled = True
            if entry.started:  # else the runner sees ``cancelled`` as it begins
                entry.runner.cancel()
            await asyncio.wait({entry.runner})
            return entry.to_status()
        if entry is not None and entry.final is not None:
            return entry.final
        return None

    async def _cancel_elsewhere(self, record: TaskRecord, caller_left_s: float | None) -> TaskRecord:
        """Ask ``record.owner`` (another orchestrator, or this one for a task recorded but not yet held) to
        cancel the task through the store and wait for its outcome: the record once
        finished (by the owner's cancel, by its own end meanwhile, or as an orphan when the owner's lease ran
        out). Raises NOT_FOUND when the record is gone (the task was refused after it was recorded), and
        UNAVAILABLE naming the owner when none of these came within ``lease_s`` (plus two polls),
        or, sooner, just before the caller's deadline (``caller_left_s``, None: none) so that it hears this."""
        store = self.config.orchestrator.task_store
        if (cancelled := await self._cancel_unheld(record)) is not None:
            return cancelled
        await self.tasks.request_cancel(record)
        asked = record.owner
        started = time.monotonic()
        bound = store.lease_s + 2 * store.cancel_poll_s
        by_caller = caller_left_s is not None and caller_left_s - CANCEL_ANSWER_MARGIN_S < bound
        ends = started + (max(0.0, caller_left_s - CANCEL_ANSWER_MARGIN_S) if by_caller else bound)
        pause = min(0.02, store.cancel_poll_s)
        while (now := time.monotonic()) < ends:
            await asyncio.sleep(min(pause, ends - now))
            pause = min(pause * 2, store.cancel_poll_s)
            current = await self.tasks.get(record.task_id)
            if current is None:  # refused after it was recorded (its backlog filled meanwhile): no such task
                raise SwitchyardError(self._no_task(record.task_id), grpc.StatusCode.NOT_FOUND)
            if current.finished:
                return current
            if current.state == agent_pb2.QUEUED and (cancelled := await self._cancel_unheld(current)) is not None:
                return cancelled  # its holder released it (a stop) or lost its lease meanwhile
            if current.owner != asked and current.owner != RELEASED:  # adopted meanwhile: ask its new holder
                await self.tasks.request_cancel(current)
                asked = current.owner
        waited = time.monotonic() - started
        why = (f"has not ended it within {waited:.3g} s, all that this CancelTask's gRPC deadline (its caller's) "
               "left" if by_caller else
               f"has neither ended it nor lost its lease within {waited:.3g} s "
               f"(orchestrator.task_store.lease_s = {store.lease_s:g})")
        raise SwitchyardError(
            f"task_id: task {shown(record.task_id)} is held by orchestrator {record.owner}, which was asked to "
            f"cancel it and {why}; the request stays recorded: it cancels the task when it reads it",
            grpc.StatusCode.UNAVAILABLE)

    async def _cancel_unheld(self, record: TaskRecord) -> TaskRecord | None:
        """Cancel a QUEUED task that no live orchestrator holds (released by one that stopped, or of one whose
        lease ran out): claimed here (:meth:`TaskStore.claim`, so no orchestrator adopts it meanwhile) and recorded
        FAILED ``CANCELLED: cancelled by CancelTask while QUEUED``; returns the record after it. None when it is
        held (or another orchestrator adopted it first)."""
        if not await self.tasks.adoptable_now(record) or not await self.tasks.claim(record):
            return None
        with contextlib.suppress(ValueError, TypeError):
            _count_unrun(task_spec_of(record.spec), grpc.StatusCode.CANCELLED)
        await self.tasks.finish(record.task_id, agent_pb2.FAILED,
                                error="CANCELLED: cancelled by CancelTask while QUEUED, before it started")
        return await self.tasks.get(record.task_id)

    async def _carry_out_cancels(self) -> None:
        """Every ``task_store.cancel_poll_s``: cancel the tasks other orchestrators asked this one to (a CancelTask
        answered by a replica that does not hold the task; see :meth:`_cancel_elsewhere`). A task no longer held
        (finished and forgotten) needs nothing; one not held yet, which the store says is this orchestrator's and
        unfinished (a SubmitTask between its record and its backlog), is asked again, for the next poll."""
        interval = self.config.orchestrator.task_store.cancel_poll_s
        outage = OutageLog(log, "orchestrator: reading the cancel requests other replicas recorded")
        while True:
            await asyncio.sleep(interval)
            try:
                task_ids = await self.tasks.take_cancels()
            except SwitchyardError as exc:
                outage.failed(exc, interval)
                continue
            outage.worked()
            outcomes = await asyncio.gather(*(self._cancel_held(task_id) for task_id in task_ids),
                                            return_exceptions=True)
            for task_id, outcome in zip(task_ids, outcomes):
                if isinstance(outcome, BaseException):
                    log.error("orchestrator: the cancel of task %s another orchestrator asked for failed: %r",
                              task_id, outcome)
                elif outcome is None:
                    await self._cancel_later(task_id)

    async def _cancel_later(self, task_id: str) -> None:
        """Record again a cancel request this orchestrator took for a task it does not hold yet (its record is
        written, its backlog entry not yet made); a task finished or not its own needs nothing."""
        try:
            record = await self.tasks.get(task_id)
            if record is not None and not record.finished and record.owner == self.tasks.owner:
                await self.tasks.request_cancel(record)
        except SwitchyardError as exc:
            log.warning("orchestrator: the cancel of task %s another orchestrator asked for is lost: %s", task_id, exc)

    async def _check_lookup_ids(self, context: grpc.aio.ServicerContext, task_id: str, agent_id: str = "") -> None:
        """INVALID_ARGUMENT for a ``task_id`` or ``agent_id`` SubmitTask would refuse (too long, or holding a
        control character): no task has it, and the caller hears why, as at submit. An ``x-tenant-id`` header
        is refused as SubmitTask refuses it (malformed or sent twice with different values: INVALID_ARGUMENT;
        another tenant than the bearer token's: PERMISSION_DENIED), whether or not the lookup reads it: a header
        that says something wrong is refused, not ignored (a task_id lookup answered 200 beside 'bad/tenant')."""
        limits = self.config.limits
        for name, value, most, key in (("task_id", task_id, limits.max_task_id_chars, "max_task_id_chars"),
                                       ("agent_id", agent_id, limits.max_id_chars, "max_id_chars")):
            try:
                check_id(value, name, most, key)
            except InvalidArgument as exc:
                await self._abort(context, exc, (task_id, agent_id))
        try:
            edge_tenant(context.invocation_metadata(), self.bearer_tokens())
        except SwitchyardError as exc:
            await self._abort(context, exc)

    async def GetTaskStatus(
        self, request: agent_pb2.GetTaskStatusRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.TaskStatus:
        """State, result, error, compute_score_used, memory_peak_bytes and timings of a submitted task: the one
        named by ``task_id``, else the one ``agent_id`` submitted last (NOT_FOUND naming the agent when none):
        the agent of the caller's tenant (its token's, else ``x-tenant-id``, else the default, as SubmitTask
        resolves it; two tenants' agents of one id are two agents). Given both, the task must be that agent's:
        another agent's task is NOT_FOUND, naming both.

        A task waiting in this orchestrator's backlog is QUEUED with its ``queue_position`` there; a task_id whose
        SubmitTask it refused after writing the record (the backlog filled meanwhile), kept until the store takes
        its delete, is NOT_FOUND saying so. A task that
        was queued or running on an orchestrator that has since died is FAILED, naming it. A caller whose bearer
        token names a tenant sees only that tenant's tasks: another tenant's is NOT_FOUND, in the words of a task
        that does not exist (its existence is not told). A task this orchestrator holds (queued, running, or
        finished with its outcome not yet recorded) is answered from here while the store is down or has no record
        of it (a Redis restarted without persistence); any other task then reads UNAVAILABLE, or NOT_FOUND.
        """
        if not request.task_id and not request.agent_id:
            await self._abort(context, SwitchyardError(
                "task_id: expected the id SubmitTask returned (or agent_id: an agent's latest task)",
                grpc.StatusCode.INVALID_ARGUMENT))
        ids = (request.task_id, request.agent_id)  # the caller's own, left as they are in its errors
        await self._check_lookup_ids(context, request.task_id, request.agent_id)
        retention = self.config.orchestrator.task_store.retention_s
        # A task this process holds is answered from here where the store cannot say (down, or it lost the record:
        # a Redis restarted without persistence): its caller read UNAVAILABLE, or NOT_FOUND "never submitted", for
        # a task queued or running here, whose outcome the store gets again once it answers.
        held = self._submitted.get(request.task_id) if request.task_id else None
        try:
            # the agent is the caller's tenant's, resolved as SubmitTask resolves it
            tenant = edge_tenant(context.invocation_metadata(), self.bearer_tokens()) if request.agent_id else ""
            if request.task_id:
                record = await self.tasks.get(request.task_id)
            else:
                record = await self.tasks.latest_of_agent(request.agent_id, tenant)
        except SwitchyardError as exc:
            if held is None or held.record is None:
                await self._abort(context, exc, ids)
            record = None
        if record is None and held is not None:
            record = held.record
        if record is not None and not self._visible_to_caller(record.tenant_id, context):
            record = None
        if (record is not None and request.task_id and request.agent_id
                and agent_key(record.tenant_id or DEFAULT_TENANT, record.agent_id) != agent_key(tenant, request.agent_id)):
            await self._abort(context, SwitchyardError(
                f"agent_id: no task {shown(request.task_id)} of agent {shown(request.agent_id)} (the task_id names "
                "another agent's task; give the task_id alone, or the agent_id alone for its latest task)",
                grpc.StatusCode.NOT_FOUND), ids)
        if record is not None and request.task_id and record.task_id in self._undeleted:
            await self._abort(context, SwitchyardError(self._refused_task(record.task_id), grpc.StatusCode.NOT_FOUND),
                              ids)
        if record is None:
            await self._abort(context, SwitchyardError(
                self._no_task(request.task_id) if request.task_id else
                f"agent_id: agent {shown(request.agent_id)} submitted no task (or none in the last {retention:g} s: "
                "orchestrator.task_store.retention_s)", grpc.StatusCode.NOT_FOUND), ids)
        live = self._submitted.get(record.task_id)
        return self.edge.status(live.to_status(self._queue_position(record.task_id)) if live is not None
                                else record.to_status())


def _caller_ids(request: agent_pb2.RunTaskRequest) -> tuple[str, ...]:
    """The ids a new task's caller gave (task_id, agent_id, the x-agent-id header's once applied, model), which its
    errors quote and it reads back as it wrote them (:meth:`EdgeText.text`'s ``keep``)."""
    return request.task_id, request.agent_id, request.model


class GrpcEdge(agent_pb2_grpc.AgentServiceServicer):
    """AgentService as the gRPC server serves it: the servicer's own methods, with each RunTask event's write
    bounded by ``orchestrator.grpc_stream_write_timeout_s``.

    grpc's write of an event waits while the caller's HTTP/2 flow-control window is full: a caller that stops
    reading without cancelling (and without a deadline) held the call, and the events unsent, without end (its
    task went on to its end meanwhile, its tokens gathered unread). Past the bound the call's status is sent,
    DEADLINE_EXCEEDED naming the key (it leaves after the events already written, which such a caller reads
    first), and the write is cancelled, which closes the stream as a caller's cancel does: RunTask's task is
    cancelled. One timer per call, checking the write in progress every quarter of the bound (the HTTP face bounds
    its own writes: ``orchestrator.http.write_timeout_s``).
    """

    def __init__(self, service: OrchestratorService) -> None:
        self._service = service
        self._ending: set[asyncio.Task[None]] = set()
        """The status sends of stalled calls, held until done (the loop keeps only weak references to tasks)."""
        self.SubmitTask = service.SubmitTask
        self.GetTaskStatus = service.GetTaskStatus
        self.CancelTask = service.CancelTask

    async def RunTask(self, request: agent_pb2.RunTaskRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.TaskEvent]:
        """:meth:`OrchestratorService.RunTask`'s events, each write bounded (see the class)."""
        timeout_s = self._service.config.orchestrator.grpc_stream_write_timeout_s
        loop = asyncio.get_running_loop()
        call = asyncio.current_task()  # grpc writes each event in the call's task, the one iterating this
        assert call is not None
        writing_since: float | None = None  # when grpc began writing the event it holds; None between writes
        timer: asyncio.TimerHandle | None = None

        def check() -> None:
            """One timer per call, every quarter of the bound (a timer per event cost 4-5 us an event; this costs
            two clock reads): a write waiting past the bound is cut within 1.25 times it."""
            nonlocal timer
            if writing_since is not None and loop.time() - writing_since >= timeout_s:
                timer = None
                CLIENT_WRITE_TIMEOUTS.labels("grpc").inc()
                log.warning("RunTask: the caller %s took no event for %g s (orchestrator.grpc_stream_write_timeout_s)"
                            ": its task is cancelled", context.peer(), timeout_s)
                # the status first (its batch is begun at once, before the cancel below reaches the call's task)
                ending = loop.create_task(_end_stalled(context, timeout_s))
                self._ending.add(ending)
                ending.add_done_callback(self._ending.discard)
                call.cancel()
                return
            timer = loop.call_later(timeout_s / 4, check)

        timer = loop.call_later(timeout_s / 4, check)
        try:
            async with contextlib.aclosing(self._service.RunTask(request, context)) as events:
                async for event in events:
                    writing_since = loop.time()
                    yield event
                    writing_since = None
        finally:
            if timer is not None:
                timer.cancel()


async def _end_stalled(context: grpc.aio.ServicerContext, timeout_s: float) -> None:
    """Send a stalled RunTask call's status (its ``abort`` raises once the status is under way: that is the end)."""
    with contextlib.suppress(grpc.aio.AbortError, grpc.aio.UsageError):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"RunTask: the caller took no event for {timeout_s:g} s (the call's flow-control window "
                            "stayed full; orchestrator.grpc_stream_write_timeout_s): the task is cancelled")

