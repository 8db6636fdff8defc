"""The engine loops' shared base (:class:`LoopBase`) and the step loop (:class:`StepLoop`), the one loop that
applies the scheduler's decisions to a step engine (the stream loop, for upstream engines, is
:mod:`switchyard.dispatcher.stream_loop`).

It computes nothing about queues: the scheduler (:mod:`switchyard.dispatcher.scheduler`)
owns every request, and the engine owns the model. Each turn:

1. ``scheduler.schedule(now)`` swaps the double buffer (what arrived during
   the last step joins now), expires, admits and preempts; admitted
   requests whose KV state waits in the DRAM tier get it back before their
   step (``out.restore``; a miss means the prefill recomputes it), after the
   prefill of the core requests admitted with them: a restore never waits in
   front of core work, and neither does a preempted victim's copy to DRAM,
   which runs in the background (the KV budget frees the victim's reservation
   at once, :mod:`switchyard.dispatcher.tiers`; a victim preempted mid-step
   keeps its live bytes held until the step in flight ends);
2. the admitted requests join the running set in mixed steps (their
   prefill rides along with one decode token of every running request:
   chunked-prefill scheduling, as in vLLM V1 and Sarathi-Serve), at most
   ``scheduler.max_step_prefill_tokens`` prompt tokens per step (a longer
   prompt split over steps on an engine with chunked prefill,
   ``StepEngine.supports_chunked_prefill``, else alone
   in its step), or are prefilled alone when nothing else runs or a core
   request is among them (its first token then waits for no decode). The
   bound keeps every step short: a step of many long prompts would make core
   work wait for its next layer boundary (a step's length / layers) and every
   running request for its next token;
3. the running set decodes, one token per request per step, until the time
   slice ends, a request finishes, or new requests wait in the buffer (then
   they join at this step boundary: iteration-level batching, as in vLLM and
   Orca), or core work joined during the step or waits (below).

The scheduler fails the requests past their own deadline whenever it takes a
step's result in (``update_from_output``, which calls ``expire_deadlines``) and
at every decision: DEADLINE_EXCEEDED within one step of it.

A swapped agent's KV comes back ahead of its tool's expected return: a
decision (``schedule``, or ``on_idle`` while nothing runs; the loop's waits end
when the next one falls due, ``scheduler.until_prefetch``) hands over the restores that are due
(``out.prefetch``), and the loop loads each DRAM copy in the background,
beside the steps (``MemoryTiers.prefetch``), then gives it back to the
scheduler (``scheduler.prefetched``), which parks the agent's step again, warm.

Core work does not wait for the step boundary (``scheduler.core_preemption``
``layer``, with an engine that has the capability,
``StepEngine.supports_layer_preemption``). A core request
arriving while a step runs (one that prefills no core request itself) starts
one small task: the scheduler admits the core work, preempting lower-class
running work for it at once when it does not fit (``scheduler.admit_core``;
the victims' KV leaves when the step in flight ends), and the engine prefills
it at the next layer boundary of the step in flight (``execute_between_layers``),
as REEF preempts best-effort DNN inference for real-time work (Han et al.,
OSDI 2022). The core request waits for one layer (step time / layers) instead
of the rest of the step; the step in flight lasts longer by the core prefill,
which is what its requests pay for the class (their inter-token latency).
Its TTFT is recorded as the step's are, and the turn's decode loop ends at
that step's boundary, so the core requests decode with the running set from
the next step. When the step ends before reaching another layer boundary, the
core requests are newcomers of the next turn, prefilled alone first as above.

An idle engine takes a request at once: an arrival wakes the loop, and the
buffer is swapped with reason ``idle``. Each step's result goes to the scheduler
(``update_from_output``: tokens, the one stop check, finished requests' KV
freed or their agent parked), and the loop publishes the per-request outputs it
returns to the requests' output streams (the one writer of those streams).
A step that fails with a real out-of-memory error (CUDA's
``OutOfMemoryError``, or ``MemoryError``) is counted and handed to
``scheduler.on_oom``, which preempts its requests and evicts: the process
and the tasks go on.

The loop owns the scheduler's telemetry: after each scheduler call that
changes what it reports it publishes ``scheduler.make_stats()``
(:func:`switchyard.dispatcher.metrics.publish_stats`: gauges, the increase of
the scheduler's counters, its observations) and makes one ``dispatcher.batch``
span per batch the double buffer flushed meanwhile; the compute-score gauge
re-samples the scheduler's monitor at scrape time once the loop has started.
On the busy path (an accepted request, a decision, a step's result, the
flush timer) it publishes at most once per :data:`STATS_INTERVAL_S`: a
report skipped there is not lost, the next one carries its counts and
events (the scheduler reports what it counted since the previous report).
When the loop waits with nothing to do a pending report is published at
once; when it waits with work held (work that fits nowhere yet, or the
stream loop between its decisions) at once if it is due, else by a timer
when it falls due; and whatever is pending when the loop drains or stops. Refusals, aborts, failed steps and tool-wait decisions are
published at once. So the counters stay exact, and the gauges, histograms
and batch spans trail the scheduler by at most the interval. (The stream
loop waits after every decision, each stream's end waking it: publishing
at each wait made a report per call, 4.4 % of its event loop's time in front
of ``sim-openai`` at 8 streams, docs/benchmarks.md.)

:class:`LoopBase` holds what the step loop and the stream loop
(:mod:`switchyard.dispatcher.stream_loop`) share: submit/abort, the
tool-wait calls (``tool_wait``, ``forget_agent``), publishing the outputs
and the reports, the flush timer, the busy ratio, drain and stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from opentelemetry import context as otel_context

from switchyard.common.priority import PriorityClass
from switchyard.common import telemetry
from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import DispatcherNotServing
from switchyard.dispatcher import metrics
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.engines.base import StepBatch, StepEngine, StepResult, StreamEngine
from switchyard.dispatcher.scheduler.base import BatchFlush
from switchyard.dispatcher.scheduler.core import SchedulerCore, loop_failure
from switchyard.dispatcher.scheduler.tool_wait import ToolWaitDecision
from switchyard.dispatcher.request import Request, RequestOutput, RequestStatus, request_links

log = logging.getLogger(__name__)
tracer = telemetry.get_tracer(__name__)

BUSY_WINDOW_S = 1.0
"""The engine busy ratio is measured over windows of at least this many seconds."""

STATS_INTERVAL_S = 0.05
"""On the busy path the loop publishes the scheduler's report at most this often, seconds (see the module
docstring). Prometheus scrapes every few seconds; a report per step and per request (some hundreds a second
under load) cost the event loop more than the steps' own bookkeeping."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A real device allocation failure: ``torch.cuda.OutOfMemoryError`` (matched by name, so torch need
    not be imported) or ``MemoryError``."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def batch_spans(flushed: list[BatchFlush]) -> None:
    """One ``dispatcher.batch`` span per flushed batch: a root span (a batch has no single parent) linked to
    every member's request span, whichever request's handler happened to trigger the flush; attributes
    ``switchyard.batch_size`` and ``switchyard.flush_reason``. It starts at the flush (``flush.at``,
    monotonic seconds) and ends now, when the report that carries it is published (at most
    :data:`STATS_INTERVAL_S` later)."""
    now_ns, mono = time.time_ns(), time.monotonic()
    for flush in flushed:
        start = now_ns - int(max(0.0, mono - flush.at) * 1e9)
        tracer.start_span(
            "dispatcher.batch", context=otel_context.Context(), links=request_links(flush.members),
            attributes={"switchyard.batch_size": len(flush.members), "switchyard.flush_reason": flush.reason.label},
            start_time=start,
        ).end()


OutputMarks = tuple[float | None, float | None, int]
"""A request's first and last token times (monotonic seconds, None before) and its output tokens, before a step."""


def output_marks(req: Request) -> OutputMarks:
    """``req``'s :data:`OutputMarks` now: what :func:`record_output` measures a step's output from."""
    return req.first_token_at, req.last_token_at, len(req.output_tokens)


def record_output(req: Request, first: float | None, last: float | None, count: int) -> int:
    """Observe what ``req`` produced since its first and last token times were ``first`` and ``last`` and it
    had ``count`` output tokens (its :func:`output_marks` then): its TTFT when its first output (a token or a
    tool call) came, else its inter-token latency when a token came; returns the tokens produced. The one rule of both loops (a step's
    requests, an upstream stream's items); a ``prefill_only`` request's one token is no caller's first token."""
    produced = max(0, len(req.output_tokens) - count)
    if req.prefill_only:
        return produced
    if first is None and req.first_token_at is not None:
        metrics.TTFT_BY_CLASS[req.priority.label].observe(req.first_token_at - req.arrival)
    elif last is not None and produced and req.last_token_at is not None:
        metrics.INTER_TOKEN_LATENCY_BY_CLASS[req.priority.label].observe(req.last_token_at - last)
    return produced


class LoopBase:
    """Submit, abort, the tool-wait calls, drain and the busy ratio: what every engine loop offers the service;
    and what both loops do alike: every scheduler output takes one path to its request's stream
    (:meth:`_apply_outputs`), the flush and report timers, the scheduler's reports to the metrics.

    Args:
        config: the whole config.
        engine: the engine the loop drives.
        scheduler: the scheduler that owns the requests.
    """

    def __init__(self, config: SwitchyardConfig, engine: StepEngine | StreamEngine, scheduler: SchedulerCore) -> None:
        metrics.start_tenant_labels(config.scheduler.tenant_weights)
        self.config = config
        self.engine = engine
        self.scheduler = scheduler
        self.time_slice_s = config.scheduler.time_slice_ms / 1000
        """``scheduler.time_slice_ms`` in seconds: a step loop's decode slice, a stream loop's longest wait between
        two decisions while the limit is taken."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._busy_mark = (time.monotonic(), self._busy_seconds())
        self._busy_counted = self._busy_mark[1]
        self._flush_timer: asyncio.TimerHandle | None = None
        self._stats_due = 0.0  # monotonic: a throttled report may be published from then on
        self._stats_pending = False  # a throttled report was skipped: the next publish carries it
        self._stats_timer: asyncio.TimerHandle | None = None  # publishes a pending report when it falls due
        self.failure: BaseException | None = None
        """What ended the loop's task with an exception (a bug in a decision), if anything did: every request the
        scheduler held then failed, and the dispatcher refuses new ones naming it (:meth:`_task_ended`)."""
        self.on_failure: Callable[[BaseException], None] | None = None
        """Called once with :attr:`failure` (the servicer: health NOT_SERVING, so that the pod is restarted)."""
        metrics.DECODE_BOUND.set(engine.decode_bound_tokens_per_s(config.batching.max_batch_size)
                                 if isinstance(engine, StepEngine) else 0.0)

    # ------------------------------------------------------------------ service calls

    def submit(self, req: Request) -> None:
        """Hand ``req`` to the scheduler; its output stream then carries what it generates. Once the
        scheduler has accepted it, the loop arms its flush timer (:meth:`_arm_flush_timer`), wakes where it
        would act on the new work (:meth:`_wake_for_intake`), and for a CORE request admits it ahead of the
        next decision where it can (:meth:`_admit_core_early`): the loop decides; the scheduler calls nothing
        of the loop back (it tells its adaptive flush of the arrival, where it has one).

        Raises:
            DispatcherNotServing, QueueFullError, InvalidArgument: see
                :meth:`SchedulerCore.add_request`.
            CannotMeetDeadline: the ``fair`` policy's early refusal (:meth:`~switchyard.dispatcher.scheduler.fair.FairScheduler._refuse_early`).
        """
        try:
            self.scheduler.add_request(req, time.monotonic())
        except BaseException:  # a refusal is counted, and published at once
            self._publish_stats()
            raise
        self._arm_flush_timer()
        self._wake_for_intake()
        if req.priority is PriorityClass.CORE:
            self._admit_core_early()
        self._publish_stats(throttled=True)

    def tool_wait(self, program_key: str, expected_wait_s: float, tool: str = "other") -> "ToolWaitDecision | None":
        """The task ``program_key`` names (:attr:`Request.program_key`): its tool call on ``tool`` (its name; counted under a bounded label) starts: the scheduler's tool-wait
        decision now (:meth:`SchedulerCore.tool_wait`: keep, swap or drop its parked KV), its report
        published; a swap's planned restore wakes the loop when it is due.

        Raises:
            ValueError: ``expected_wait_s`` < 0.
        """
        try:
            return self.scheduler.tool_wait(program_key, expected_wait_s, time.monotonic(), tool=tool)
        finally:
            self._publish_stats()
            self._wake.set()

    def forget_agent(self, program_key: str) -> None:
        """The task ``program_key`` names ended during its tool wait: :meth:`SchedulerCore.forget_agent`, its report published."""
        try:
            self.scheduler.forget_agent(program_key)
        finally:
            self._publish_stats()
            self._wake.set()

    def abort(self, req: Request) -> None:
        """The caller went away: end ``req`` now (``cancelled``) and free its place and KV. Idempotent."""
        self._apply_outputs(self.scheduler.finish_requests([req], RequestStatus.FINISHED_ABORTED,
                                                     time.monotonic()))
        self._wake.set()

    def _apply_outputs(self, outputs: list[RequestOutput], stats: bool = True, throttled: bool = False) -> None:
        """Apply the scheduler's per-request outputs, the one path every output takes: the engine work of each
        request that finished stops (:meth:`_cancel_finished_calls`: an upstream call still streaming), each
        output is pushed to its request's output stream (:meth:`RequestOutput.publish`; the one writer but for
        the processor's answer to a ``prefill_only`` request with nothing to prefill for, :class:`Request`),
        then (``stats``) the scheduler's report goes to the metrics (:meth:`_publish_stats`, ``throttled`` on
        the busy path)."""
        self._cancel_finished_calls(outputs)
        for out in outputs:
            out.publish()
        if stats:
            self._publish_stats(throttled)

    def _publish_stats(self, throttled: bool = False) -> None:
        """Publish the scheduler's report (:meth:`~switchyard.dispatcher.scheduler.base.Scheduler.make_stats`) to
        the metrics, and make the span of each batch it flushed since the last report. ``throttled`` (the
        busy path): only when the last report is at least :data:`STATS_INTERVAL_S` old, else it stays
        pending for the next publish (:meth:`_publish_pending_stats`)."""
        now = time.monotonic()
        if throttled and now < self._stats_due:
            self._stats_pending = True
            return
        self._stats_due = now + STATS_INTERVAL_S
        self._stats_pending = False
        self._cancel_stats_timer()  # this report carries the one it waited to publish
        stats = self.scheduler.make_stats()
        metrics.publish_stats(stats)
        if stats.events.flushed:
            batch_spans(stats.events.flushed)

    def _publish_pending_stats(self) -> None:
        """Publish the report a throttled call skipped, if any (when the loop drains or stops, or its due time
        came: :meth:`_publish_when_due`)."""
        self._stats_timer = None
        if self._stats_pending:
            self._publish_stats()

    def _publish_when_due(self) -> None:
        """The loop is about to wait: a pending report is published now if due or if the scheduler holds no work
        (the report of what just ended), else when it falls due (a timer; any publish before then carries it
        instead, and cancels the timer)."""
        if not self._stats_pending:
            return
        delay = self._stats_due - time.monotonic()
        if delay <= 0 or not self.scheduler.has_work:
            self._publish_stats()
        elif self._stats_timer is None:
            self._stats_timer = asyncio.get_running_loop().call_later(delay, self._publish_pending_stats)

    def _cancel_stats_timer(self) -> None:
        if self._stats_timer is not None:
            self._stats_timer.cancel()
            self._stats_timer = None

    def start(self) -> None:
        """Start the loop task on the running event loop (idempotent); from then on the compute-score gauge
        re-samples the scheduler's monitor at scrape time."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"dispatcher-{type(self).__name__}")
            self._task.add_done_callback(self._task_ended)
            metrics.publish_compute_score_at_scrape(self.scheduler.monitor)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """The loop's task ended. Having returned (a drain) or been cancelled (a stop) is the plan; an exception
        is a bug in a decision, after which no request would be answered again: log it, close the intake (new
        requests are refused UNAVAILABLE naming it, :class:`DispatcherNotServing`), fail every request the scheduler
        holds with the same error, and tell :attr:`on_failure`."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self.failure = exc
        log.critical("dispatcher: the engine loop failed; the requests it held fail, new ones are refused",
                     exc_info=exc)
        reason = loop_failure(exc)
        self.scheduler.close(reason)
        try:
            self._end_all(RequestStatus.FINISHED_ERROR, DispatcherNotServing(reason))
        except Exception:  # noqa: BLE001 - the scheduler's state is what failed: its requests may not all end
            log.exception("dispatcher: ending the requests held after the engine loop failed")
        if self.on_failure is not None:
            self.on_failure(exc)

    @property
    def _closing(self) -> bool:
        """The dispatcher drains or stops: its scheduler's intake is closed, the one drain flag (set by
        :meth:`drain`, :meth:`stop` and ``DispatcherService.begin_drain``); the loop ends once it has no work."""
        return self.scheduler.intake.closed

    async def drain(self) -> None:
        """Refuse new requests, run everything accepted to its end, then return."""
        self.scheduler.close()
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self._end_helpers(cancel=False)
        self._cancel_flush_timer()
        self._cancel_stats_timer()
        self._publish_pending_stats()
        self.scheduler.shutdown()
        await self.scheduler.tiers.aclose()

    async def stop(self) -> None:
        """Cancel at once: every request still held ends ``cancelled``."""
        self.scheduler.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._end_helpers(cancel=True)
        if self.failure is None:  # a failed loop ended what it held already; its scheduler's state is suspect
            self._end_all(RequestStatus.FINISHED_ABORTED)
        self._cancel_flush_timer()
        self._cancel_stats_timer()
        self.scheduler.shutdown()
        await self.scheduler.tiers.aclose()

    @property
    def busy_ratio(self) -> float:
        """Engine busy seconds / wall seconds over the current measuring window (0-1)."""
        since, busy = self._busy_mark
        wall = time.monotonic() - since
        return min(1.0, max(0.0, (self._busy_seconds() - busy) / wall)) if wall > 0 else 0.0

    # ------------------------------------------------------------------ for subclasses

    async def _run(self) -> None:
        raise NotImplementedError

    async def _end_helpers(self, cancel: bool) -> None:
        """The loop task has ended: end (``cancel``) or wait for the tasks a subclass started beside it."""

    def _wake_for_intake(self) -> None:
        """The intake gained work (an accepted request, a flush by interval): wake the loop where its next
        decision would act on it (default: always)."""
        self._wake.set()

    def _admit_core_early(self) -> None:
        """CORE work waits (accepted by :meth:`submit`, or pending when a step starts): a loop that can admit it
        before its next decision does (default: none can)."""

    def _cancel_finished_calls(self, outputs: list[RequestOutput]) -> None:
        """End the engine work still under way for each request of ``outputs`` that finished (default: none;
        a step engine's request runs only inside a step)."""

    def _arm_flush_timer(self) -> None:
        """Flush by INTERVAL when the first buffered request has waited ``flush_interval_ms``
        (``scheduler.flush_deadline``); the loop owns this timer, the scheduler none."""
        deadline = self.scheduler.flush_deadline
        if deadline is None or self._flush_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop (tests): the next decision flushes
            return
        # monotonic and the loop's clock agree on CPython's default and uvloop loops
        self._flush_timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._on_flush_timer)

    def _on_flush_timer(self) -> None:
        self._flush_timer = None
        deadline = self.scheduler.flush_deadline
        if deadline is None:  # swapped meanwhile (a step boundary, a full buffer)
            return
        now = time.monotonic()
        if deadline > now:  # a later buffer: its own first request's interval
            self._arm_flush_timer()
            return
        self.scheduler.flush(FlushReason.INTERVAL, now)
        self._publish_stats(throttled=True)
        self._wake_for_intake()

    def _cancel_flush_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None

    def _end_all(self, status: RequestStatus, error: BaseException | None = None) -> None:
        """End every request the scheduler holds, buffered, waiting, preempting or running, with ``status``."""
        now = time.monotonic()
        self.scheduler.flush(FlushReason.DRAIN, now)
        held = [*self.scheduler.running, *self.scheduler.preempting, *self.scheduler.waiting]
        self._apply_outputs(self.scheduler.finish_requests(held, status, now, error))

    async def _wait(self, timeout: float | None) -> None:
        self._publish_when_due()  # the loop pauses: what it reports is current within STATS_INTERVAL_S
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return
        # a timer that sets the event, not wait_for: wait_for wraps the wait in a task of its own on
        # every call, and the loop waits here after every decision
        timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()

    def _busy_seconds(self) -> float:
        return float(self.engine.busy_seconds)

    def _update_busy(self) -> None:
        busy = self._busy_seconds()
        if busy > self._busy_counted:
            metrics.ENGINE_BUSY_SECONDS.inc(busy - self._busy_counted)
            self._busy_counted = busy
        since, _ = self._busy_mark
        now = time.monotonic()
        if now - since >= BUSY_WINDOW_S:
            metrics.ENGINE_BUSY_RATIO.set(self.busy_ratio)
            self._busy_mark = (now, self._busy_seconds())


class StepLoop(LoopBase):
    """Drives a :class:`StepEngine` from the scheduler's decisions (see the module docstring).

    Args:
        config: the whole config (``scheduler.time_slice_ms``, ``scheduler.core_preemption``).
        engine: the step engine.
        scheduler: the scheduler built for this engine.
    """

    def __init__(self, config: SwitchyardConfig, engine: StepEngine, scheduler: SchedulerCore) -> None:
        super().__init__(config, engine, scheduler)
        self.max_step_prefill_tokens = config.scheduler.max_step_prefill_tokens
        self.chunked_prefill = engine.supports_chunked_prefill
        """Newcomers' prompts may be split over steps (``StepEngine.supports_chunked_prefill``)."""
        self.steps = 0
        self._idle = True
        self._idle_tick_s = min(BUSY_WINDOW_S, config.scheduler.score_sample_interval_ms / 1000)
        self.layer_preemption = config.scheduler.core_preemption == "layer" and engine.supports_layer_preemption
        """Core work may join a step in flight at a layer boundary (see the module docstring)."""
        self._preemptible = False  # a step that core work may interrupt is in flight
        self._transferring = False  # the loop sleeps a restore's modelled transfer: the engine computes nothing
        self._joined = False  # core work joined the running set during this turn: end it at the step boundary
        self._preempt_task: asyncio.Task[None] | None = None
        self._prefetches: set[asyncio.Task[None]] = set()  # planned restores of swapped agents' KV in flight

    def _wake_for_intake(self) -> None:
        if self._idle or self._closing:  # a busy loop swaps the buffer at its next step boundary
            self._wake.set()

    def _admit_core_early(self) -> None:
        """While a step that core work may join is in flight (or the loop only sleeps a restore's transfer),
        start the one task that admits core work and prefills it at a layer boundary (:meth:`_preempt_step`)."""
        if ((self._preemptible or self._transferring) and self._preempt_task is None and not self._closing):
            self._preempt_task = asyncio.create_task(self._preempt_step(), name="dispatcher-core-preemption")

    async def _preempt_step(self) -> None:
        """Prefill core work at a layer boundary of the step in flight (or at once while the loop only waits
        for a restore's transfer), while some is admitted and a step or transfer allows it."""
        engine = self.engine
        try:
            while (self._preemptible or self._transferring) and not self._closing:
                decision = self.scheduler.admit_core(time.monotonic())
                self._apply_outputs(decision.outputs, throttled=True)
                admitted = decision.admitted
                if not admitted:
                    return
                self._joined = True  # the running set changed: the turn ends at this step's boundary
                before = self._before(admitted)
                with tracer.start_as_current_span(
                    "dispatcher.layer_preemption", context=otel_context.Context(), links=request_links(admitted),
                    attributes={"switchyard.admitted": len(admitted)},
                ):
                    batch = self.scheduler.compose_batch(admitted, [])
                    if self._preemptible:
                        done = await self._call(engine.execute_between_layers, batch)
                    else:  # no step in flight: the copy engine moves the restore, the compute is free
                        done = await self._call(engine.execute_model, batch)
                if done is not False:  # a result, or it failed: what it did is recorded as a step's
                    self.steps += 1
                    self._record(admitted, before)
        finally:
            self._preempt_task = None

    async def _end_helpers(self, cancel: bool) -> None:
        task = self._preempt_task
        if task is not None:
            if cancel:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        prefetches = list(self._prefetches)
        for task in prefetches:
            task.cancel()
        await asyncio.gather(*prefetches, return_exceptions=True)

    def _prefetch(self, reqs: list[Request]) -> None:
        """Start the planned restores the scheduler handed over (``SchedulerOutput.prefetch``): each loads its
        agent's DRAM copy back in the background (:meth:`~switchyard.dispatcher.tiers.MemoryTiers.prefetch`,
        beside the steps) and then hands it to the scheduler (``scheduler.prefetched``)."""
        for req in reqs:
            task = asyncio.create_task(self._prefetch_one(req), name=f"dispatcher-prefetch-{req.agent_id}")
            self._prefetches.add(task)
            task.add_done_callback(self._prefetches.discard)

    async def _prefetch_one(self, req: Request) -> None:
        restored = 0
        try:
            restored = await self.scheduler.tiers.prefetch(req)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed prefetch is a miss: the agent's turn restores or recomputes
            log.exception("prefetch of agent %s's KV from the DRAM tier failed", req.agent_id)
        self.scheduler.prefetched(req, restored, time.monotonic())
        self._publish_stats()

    def _until_prefetch(self, timeout: float) -> float:
        """``timeout``, or less when a planned restore is due sooner (seconds, >= 0). A restore already due
        that waits for room in the KV budget does not shorten it (``scheduler.until_prefetch``)."""
        return self.scheduler.until_prefetch(timeout, time.monotonic())

    async def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            if not scheduler.has_work:
                if self._closing:
                    return
                self._idle = True
                await self._wait(self._until_prefetch(self._idle_tick_s))
                self._update_busy()  # idle: let the busy ratio fall
                # the compute score and parked agents' TTLs move on; planned restores that are due start
                self._prefetch(scheduler.on_idle(time.monotonic()))
                self._publish_stats()
                continue
            self._idle = False
            now = time.monotonic()
            out = scheduler.schedule(now)
            self._joined = False
            self._apply_outputs(out.outputs, throttled=True)
            self._prefetch(out.prefetch)
            running = [s for s in out.running if s.status is RequestStatus.RUNNING]
            if not running:
                await self._move_tiers(out.restore)
                # Work waits but none fits now: re-evaluate when something changes, after a slice, at the
                # earliest deadline of what waits, or when a planned restore is due.
                self._idle = True
                await self._wait(self._until_prefetch(min(self.time_slice_s,
                                                          scheduler.next_deadline - time.monotonic())))
                continue
            # One span per turn, linked to the requests it serves; the engine's steps are its children.
            with tracer.start_as_current_span(
                "dispatcher.step", context=otel_context.Context(), links=request_links(running),
                attributes={"switchyard.batch_size": len(running), "switchyard.admitted": len(out.admitted)},
            ):
                await self._turn(running, out.restore)

    def start(self) -> None:
        super().start()
        self.scheduler.tiers.start_scans()

    async def _move_tiers(self, restore: list[Request]) -> None:
        """Bring the DRAM copies of ``restore`` back; sleep their modelled transfer time (sim engine). Copies
        out of HBM owe nothing here: they run in the background."""
        tiers = self.scheduler.tiers
        if restore:
            await asyncio.gather(*(tiers.restore(req) for req in restore))
        owed = tiers.take_owed_seconds()
        if owed > 0:
            # A transfer leaves the compute idle: core work arriving meanwhile is prefilled at once.
            self._transferring = self.layer_preemption
            if self._transferring and self.scheduler.core_pending:
                self._admit_core_early()
            try:
                await asyncio.sleep(owed)
            finally:
                self._transferring = False
            task = self._preempt_task
            if task is not None:  # a core prefill still running: the next step waits for the engine
                await asyncio.gather(task, return_exceptions=True)

    async def _turn(self, running: list[Request], restore: list[Request]) -> None:
        """Prefill the newcomers among ``running`` (core ones first, then the DRAM copies of ``restore`` come
        back), then decode until the slice ends or the running set changes; a turn that has run no step by
        then decodes once whatever waits, so the running set always moves on."""
        scheduler = self.scheduler
        steps_before = self.steps
        waits_restore = set(restore)
        if any(not s.needs_prefill for s in running if s not in waits_restore):
            core = [s for s in running if s.needs_prefill and s not in waits_restore
                    and s.priority is PriorityClass.CORE]
        else:
            core = []
        if core:
            # Core work is prefilled on its own: its first token waits for no decode, no other newcomer and
            # no restore (nor for a later core arrival: this step is not preempted).
            await self._step(core, [])
            if self._left(core):
                await self._move_tiers(restore)
                return
        await self._move_tiers(restore)
        done = set(core)
        running = [s for s in running if s.status is RequestStatus.RUNNING]  # preempted meanwhile: gone
        prefill = [s for s in running if s.needs_prefill and s not in done]
        decode = [s for s in running if not s.needs_prefill and s not in done]
        if prefill and decode and self.chunked_prefill:
            # Chunked prefill: the newcomers' prompts go in order, at most max_step_prefill_tokens per step,
            # each step also decoding the running set.
            pending = prefill
            while pending:
                await self._step(pending, decode, preemptible=True, budget=self.max_step_prefill_tokens)
                if self._left(pending + decode) or self._joined:
                    return
                pending = [s for s in pending if s.needs_prefill and s.status is RequestStatus.RUNNING]
            prefill = []
        for group in self._prefill_groups(prefill):
            if decode:
                # Newcomers join the running set in mixed steps: the decodes do not wait for them.
                await self._step(group, decode, preemptible=True)
                if self._left(group + decode) or self._joined:
                    return
            else:
                preemptible = not any(s.priority is PriorityClass.CORE for s in group)
                await self._step(group, [], preemptible=preemptible)
                if self._left(group) or self._joined:
                    return
        # The decode slice. Work that waits (buffered, joined, a core request refused admission) ends it at
        # the next step, not before the first: a turn that ran no step yet decodes once, else a request that
        # waits for room only the running set can free (its KV, by finishing) would stop that set for good.
        slice_end = time.monotonic() + self.time_slice_s
        stepped = self.steps != steps_before
        while not stepped or (not scheduler.intake.active_size and not self._joined and not scheduler.core_waiting
                              and time.monotonic() < slice_end):
            decode = [s for s in running if not s.needs_prefill and s.status is RequestStatus.RUNNING]
            if not decode:
                break
            await self._step([], decode, preemptible=True)
            stepped = True
            if self._left(decode):
                break

    def _prefill_groups(self, prefill: list[Request]) -> list[list[Request]]:
        """``prefill`` in admission order, cut into groups of at most ``scheduler.max_step_prefill_tokens``
        uncomputed tokens each (a longer request alone): one engine step each."""
        groups: list[list[Request]] = []
        tokens = self.max_step_prefill_tokens
        for req in prefill:
            n = req.num_uncomputed_tokens
            if not groups or tokens + n > self.max_step_prefill_tokens:
                groups.append([])
                tokens = 0
            groups[-1].append(req)
            tokens += n
        return groups

    async def _step(self, prefill: list[Request], decode: list[Request], preemptible: bool = False,
                    budget: int | None = None) -> None:
        """One engine step: the scheduler composes it (``budget``: chunked prefill), the engine runs it, the
        scheduler takes its result in (``update_from_output``) and the outputs are published.
        ``preemptible``: core work may join it at a layer boundary while it runs."""
        batch = self.scheduler.compose_batch(prefill, decode, budget)
        reqs = batch.requests
        before = self._before(reqs)
        self._preemptible = preemptible and self.layer_preemption
        if self._preemptible and self.scheduler.core_pending:  # core work came while nothing could take it
            self._admit_core_early()
        try:
            await self._call(self.engine.execute_model, batch)
        finally:
            self._preemptible = False
        self.steps += 1
        self._record(reqs, before)

    async def _call(self, fn: Callable[[StepBatch], Awaitable[StepResult | None]], batch: StepBatch) -> Any:
        """Run ``fn(batch)`` and hand its result to the scheduler; False when it reached no layer boundary,
        None when it failed: an out-of-memory error is handed to the scheduler, any other fails every
        member of ``batch``."""
        scheduler = self.scheduler
        try:
            result = await fn(batch)
        except Exception as exc:  # noqa: BLE001 - every member of the step gets the error
            now = time.monotonic()
            if is_out_of_memory(exc):
                scheduler.step_not_run(batch)  # the device refused its allocation: its prefills held none of it
                out = scheduler.on_oom(batch.requests, now, exc)
                self._apply_outputs(out.outputs)
            else:
                log.exception("engine step failed for %d requests", len(batch.requests))
                self._apply_outputs(scheduler.finish_requests(batch.requests,
                                                        RequestStatus.FINISHED_ERROR, now, exc))
            return None
        if result is None:  # nothing computed (no layer boundary came): its prefills allocated nothing
            scheduler.step_not_run(batch)
            return False
        self._apply_outputs(scheduler.update_from_output(batch, result, time.monotonic()), throttled=True)
        return result

    @staticmethod
    def _before(reqs: list[Request]) -> list[OutputMarks]:
        return [output_marks(req) for req in reqs]

    def _record(self, reqs: list[Request], before: list[OutputMarks]) -> None:
        """Metrics of a step over ``reqs`` (``before``: each one's token times and count before it): TTFT or
        inter-token latency by priority class, tokens produced (:func:`record_output`), busy time."""
        produced = 0
        for req, (first, last, count) in zip(reqs, before):
            produced += record_output(req, first, last, count)
        metrics.GENERATED_TOKENS.inc(produced)
        self._update_busy()

    @staticmethod
    def _left(reqs: list[Request]) -> bool:
        """True when any member of ``reqs`` ended or left the running set (preempted, after an
        out-of-memory step): the turn ends at this step boundary."""
        return any(req.status is not RequestStatus.RUNNING for req in reqs)
