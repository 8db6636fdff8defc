"""The dispatcher's one request queue: intake, waiting, running and parked, owned here.

Shape after vLLM's scheduler (``add_request`` / ``schedule`` /
``finish_requests``) and Triton's dynamic batcher, which alone owns the queue
bound, the queue timeout, priorities and the batching delay. Every request the
dispatcher holds is in exactly one place, recorded in ``req.status``
(:class:`~switchyard.dispatcher.request.RequestStatus`); the status names the
place, so no registry is kept beside the places (:meth:`SchedulerCore.finish_requests`
takes the requests themselves, which every caller holds):

``buffered`` (the double buffer's active list) -> ``waiting`` (ordered by the
policy) -> ``running`` (the engine's running set) -> ``finished``; a running
request may go back to ``waiting`` (preempted), to ``preempting`` (preempted
while a step it belongs to is in flight: out of the running set, its KV
leaving when that step ends, then ``waiting``) or to ``parked`` (a react_loop
agent waiting on a tool, its KV kept warm).

This class is the only place that

- refuses a request when the queue is full (RESOURCE_EXHAUSTED at once, naming
  the queue and its capacity; :meth:`SchedulerCore.add_request`);
- expires requests that waited ``queues.inference.timeout_ms`` before their
  first admission (DEADLINE_EXCEEDED naming the queue; :meth:`SchedulerCore.schedule`);
- enforces every request's own deadline (``req.deadline``, from its caller's
  ``timeout_s`` or gRPC deadline), waiting or running, on every engine:
  DEADLINE_EXCEEDED, its place and KV freed (:meth:`SchedulerCore.expire_deadlines`,
  called at every decision and by the step loop after every step);
- writes what the engine produced into its requests and ends them, for every
  engine (:meth:`SchedulerCore.update_from_output`: the one stop check,
  :func:`.update.check_stop`); every request that ends is handed back as a
  :class:`~switchyard.dispatcher.request.RequestOutput` for the engine loop
  to publish;
- frees KV state (``kv.free``, the engine's
  :class:`~switchyard.dispatcher.engines.base.KVCacheManager`): on finish,
  preemption, parking expiry and agent hand-over;
- moves KV state between memory tiers (:mod:`switchyard.dispatcher.tiers`; the methods that do, with
  the tool waits' and the hand-over's, live in its base class :class:`.kv_memory.KvMemory`, so that this
  module reads as the request path in one pass):
  a preempted request or an evicted parked agent goes to the DRAM tier when
  swapping is cheaper than recomputing, and comes back at admission
  (``SchedulerOutput.restore``); the HBM scan (every ``[scan]
  hbm_scan_interval_s``) evicts at ``emergency_evict_ratio`` and
  defragments while the compute score is below ``defrag_below_score``.
  A swap-out's copy runs in the background (the sim engine models no time
  for it in front of any step), and the swap-or-recompute choice counts the
  delay a copy would put on waiting higher-class work
  (:meth:`.kv_memory.KvMemory._swap_out`).

Runnable work never waits behind parked state: before a waiting request is
refused for KV memory, parked agents' state leaves HBM for it, lowest value
first whatever its value (:meth:`.kv_memory.KvMemory._make_room`); a core agent's
parked state is valued higher, so it leaves last, but it leaves. One bounded
exception: an agent's KV restored for its turn by a planned restore, or kept
by its tool-wait decision, stays until its tool's revisit time
(:mod:`.tool_wait`): that turn is due by then and needs the prefix; once the turn
has come, the prefix stays with its waiting step for ``tool_wait_turn_hold_s``
against waiting work of another class than core while running work can free the
room (:meth:`.kv_memory.KvMemory._cool_handovers`).

A policy (:mod:`.priority`, :mod:`.fifo`, :mod:`.fair`) subclasses :class:`SchedulerCore`
and decides four things only: the order of the waiting set (its request
queue, :meth:`SchedulerCore.make_queue`: the queue's ``order_key``,
:mod:`.request_queue`), whether the head may start
(:meth:`SchedulerCore._policy_refusal`, memory aside), what to preempt
(:meth:`SchedulerCore._preempt` at a decision, :meth:`SchedulerCore._victim_candidates`
mid-step), and what it refuses at intake for its own reason
(:meth:`SchedulerCore._refuse_early`: the fair policy's requests that cannot make their deadline).

Capacity comes from the hardware (:mod:`.capacity`): the running set is bounded
by the compute score and by KV memory within the HBM budget (step engines), or
by the upstream's adaptive concurrency limit (stream engines); never by a fixed
count. ``max_admitted_per_decision`` (the field's 10) is the admission wave: the most
requests admitted in one scheduling decision, so that a burst joins the
running set over a few steps instead of stalling every running decode behind
one huge prefill. ``queues.inference.capacity`` bounds the requests that wait
(buffered or waiting, never admitted yet).

All times are ``time.monotonic()`` seconds, passed in as ``now``.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable

import grpc

from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import (
    DispatcherNotServing,
    InvalidArgument,
    QueueFullError,
    QueueTimeoutError,
    RequestDeadlineExceeded,
    SwitchyardError,
)
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.adaptive_flush import AdaptiveFlush
from switchyard.dispatcher.double_buffer import DoubleBuffer, FlushReason
from switchyard.dispatcher.scheduler.accounting import Accounting, held_kv_bytes
from switchyard.dispatcher.scheduler.admission import Admission
from switchyard.dispatcher.scheduler.base import (
    QUEUE_NAME,
    BatchFlush,
    SchedulerCounters,
    SchedulerEvents,
    SchedulerStats,
    should_park,
)
from switchyard.dispatcher.engines.base import (
    KVCacheManager,
    NullKVCacheManager,
    StepBatch,
    StepResult,
    StreamEngine,
)
from switchyard.dispatcher.scheduler.capacity import KV_MEMORY, Capacity, HeldBesideRunning, KvBudget, Unbounded
from switchyard.dispatcher.scheduler.update import apply_output, compose_batch, release_kv
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
from switchyard.dispatcher.scheduler.parking import ParkedAgents
from switchyard.dispatcher.scheduler.kv_memory import KvMemory
from switchyard.dispatcher.scheduler.tool_wait import ToolWaitPlans
from switchyard.dispatcher.scheduler.request_queue import RequestQueue
from switchyard.dispatcher.request import (
    FlushedBatch,
    Request,
    RequestOutput,
    RequestStatus,
    SchedulerOutput,
)
from switchyard.dispatcher.tiers import MemoryTiers

log = logging.getLogger(__name__)

FRAGMENTATION_INTERVAL_S = 1.0
"""The fragmentation ratio reported is recomputed at scheduling decisions at most this often (seconds)."""

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING
PREEMPTING = RequestStatus.PREEMPTING
PARKED = RequestStatus.PARKED
_UNFINISHED = frozenset({RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})
"""Ends that cut a request short: what it waited on then is kept (``Request.waited_on``)."""


SHUTTING_DOWN = "it is shutting down (draining what it accepted)"
"""Why a dispatcher whose intake :meth:`SchedulerCore.close` closed with no reason refuses requests
(:class:`~switchyard.common.errors.DispatcherNotServing`)."""


def loop_failure(exc: BaseException) -> str:
    """Why a dispatcher whose engine loop ended with ``exc`` refuses new requests and fails those it held (the
    reason its scheduler is closed with, :class:`~switchyard.common.errors.DispatcherNotServing`)."""
    return f"its engine loop failed ({type(exc).__name__}: {exc})"


class SchedulerCore(KvMemory):
    """Implements :class:`~switchyard.dispatcher.scheduler.base.Scheduler` but the policy hooks.

    Args:
        config: the whole config (``scheduler``, ``queues.inference``,
            ``batching``, ``memory.hbm``).
        engine: the engine (its ``kv``, the :class:`KVCacheManager` this scheduler owns); None: one
            without KV memory.
        monitor: compute-score source; default a :class:`ComputeScoreMonitor`
            reading NVML, falling back to the engine's own activity.
        capacity: the running set's limit; default :class:`KvBudget` from the
            engine's memory facts (:class:`Unbounded` when it has none).
        adaptive_flush: the flush-interval controller (``batching.flush_interval_ms`` ``"auto"``): the double
            buffer's interval, told of each accepted arrival and each flushed batch's service time; None: the
            fixed ``flush_interval_ms`` (``min_interval_ms`` where the setting is ``"auto"``).
        tiers: the memory tiers (swap to DRAM); default one without a DRAM
            store: evicted state is recomputed.
        queue: the waiting queue (:class:`.request_queue.RequestQueue`: its ``order_key`` orders the
            waiting work); default the policy's (:meth:`make_queue`).
    """

    name = "base"

    def __init__(
        self,
        config: SwitchyardConfig,
        engine: Any = None,
        monitor: ComputeScoreMonitor | None = None,
        capacity: Capacity | None = None,
        adaptive_flush: AdaptiveFlush | None = None,
        tiers: MemoryTiers | None = None,
        queue: RequestQueue | None = None,
    ) -> None:
        self.scheduler_config = config.scheduler
        """The ``scheduler`` section alone (``scheduler_config.json``), not the whole config."""
        self.memory = config.memory
        self.queue_config = config.queues.inference
        self.engine = engine
        self.kv: KVCacheManager = engine.kv if engine is not None else NullKVCacheManager()
        self.engine_enforces_max_tokens: bool = engine.enforces_max_tokens if engine is not None else False
        """A stream engine's upstream ends each stream at ``max_tokens`` (see :func:`.update.check_stop`)."""
        self.tiers = tiers or MemoryTiers(config.memory, config.scheduler.priority_boost, self.kv)
        self._outbox: list[RequestOutput] = []  # requests ended since the last public call returned
        streams = isinstance(engine, StreamEngine)
        # NVML reads this host's GPU: the compute score reads it only for an engine that computes on it. The sim
        # engine's GPU is its model's, a stream engine's its model server's (whose adaptive concurrency limit is
        # the one limit on it): NVML here reads whatever else this host runs.
        host_gpu = engine is None or engine.runs_on_host_gpu
        self.monitor = monitor or ComputeScoreMonitor(self.scheduler_config, engine=engine,
                                                      nvml=None if host_gpu else False)
        self.counters = SchedulerCounters()
        """What this scheduler has counted since it was built (:class:`.base.SchedulerCounters`)."""
        self._reported = SchedulerCounters()  # the counters at the last make_stats
        self._events = SchedulerEvents()  # observed since the last make_stats
        self.admission = Admission(self.scheduler_config, self.counters.admissions_refused,
                                   by_score=not streams)
        # a step's allocation counts as it runs; the rule itself, not this scheduler's method (no call back into it)
        self.accounting = Accounting(functools.partial(held_kv_bytes, self.kv), self.monitor)
        self.parking = ParkedAgents(self.scheduler_config.tool_wait_ttl_s, functools.partial(release_kv, self.kv),
                                    self.kv.kv_bytes, self._demote_parked, self.counters)
        self._held_beside_running = HeldBesideRunning(self.parking, self.kv)
        """KV bytes held beside the running set (parked prefixes, the prefix cache), read by the KV budget."""
        self.tool_waits = ToolWaitPlans(self.counters.tool_decisions, self.counters.tool_resumes,
                                        self.counters.tool_prefetches)
        """Each agent's tool wait as decided at tool start, its restore plan, and the per-tool counts."""
        info = self.kv.memory_info()
        self._kv_bytes_per_token = info.kv_bytes_per_token if info is not None else 0
        """KV bytes one token of one request needs (0: the engine holds no KV here): what a step allocates."""
        if capacity is None:
            capacity = (KvBudget(config.memory.hbm, info, self._held_beside_running, self.kv.device_used_bytes,
                                 taken_over=self.parking.handed_over_bytes) if info else Unbounded())
        self.capacity = capacity
        flush = config.batching
        self.adaptive_flush = adaptive_flush
        """The flush-interval controller, or None (a fixed interval): its window is the double buffer's interval,
        and it hears of each request the buffer took (:meth:`AdaptiveFlush.record_arrival`, never the loop's
        wake-up: the loop wakes itself once :meth:`add_request` returns) and of each flushed batch's service time
        (:meth:`AdaptiveFlush.record_batch_service`)."""
        interval: float | AdaptiveFlush = (
            adaptive_flush if adaptive_flush is not None
            else float(flush.flush_interval_ms) / 1000 if not flush.adaptive else flush.min_interval_ms / 1000)
        self.intake: DoubleBuffer[Request] = DoubleBuffer(flush.max_batch_size, interval)
        self._closed_because = SHUTTING_DOWN  # why the intake is closed, once it is (close's reason)
        self.queue: RequestQueue = queue if queue is not None else self.make_queue()
        """The waiting requests in the policy's order (:mod:`.request_queue`)."""
        self._running: list[Request] = []
        self._leaving: list[Request] = []
        """Members of the step in flight preempted during it (``preempting``): out of the running set, their
        live KV (``req.kv_leaving_bytes``) held in the budget until that step ends, when they leave."""
        self._room_for: Request | None = None  # the waiting head parked state is evicted for (_make_room)
        self._queued = 0  # accepted, never admitted: what queues.inference.capacity bounds
        self._next_expiry = math.inf
        self._next_deadline = math.inf  # the earliest own deadline among the requests held (an upper bound)
        self.score = 0.0
        """Compute score (0-100) read at the last decision."""
        self.preemption_enabled = self.scheduler_config.preemption_enabled and not streams
        """``scheduler.preemption_enabled``, and never for a stream engine: an upstream's stream cannot be paused
        (decided here, with the engine, whoever drives this scheduler)."""
        self._next_hbm_scan = 0.0
        self._next_fragmentation = 0.0
        self._fragmentation = 0.0  # the fragmentation ratio last computed
        self._now = 0.0  # the time of the decision in progress (value scores' recency)
        self._kv_refused: Request | None = None  # the head last refused for KV memory (counted once)
        self._announced = False  # a tool-wait announcement has come: undecided parked steps are held for theirs

    # ------------------------------------------------------------------ views

    @property
    def kv_budget(self) -> KvBudget | None:
        """The capacity as a KV budget in bytes, None for one that counts no bytes (an upstream's concurrency
        limit, an engine that reports no memory, fixed slots): what the memory management prices and holds. Read
        from ``capacity`` each time: a bench replaces it after the scheduler is built."""
        return self.capacity if isinstance(self.capacity, KvBudget) else None

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests, in the order they will be admitted (buffered ones not included)."""
        return list(self.queue)

    @property
    def running(self) -> list[Request]:
        """The running set, in step order (a copy)."""
        return list(self._running)

    @property
    def preempting(self) -> list[Request]:
        """Requests preempted during the step in flight: out of the running set, their KV held until it ends."""
        return list(self._leaving)

    @property
    def parked(self) -> list[Request]:
        """The last step of each agent task waiting on a tool with its prefix state in HBM, oldest first
        (:mod:`.parking`)."""
        return self.parking.requests

    @property
    def parked_kv_bytes(self) -> int:
        """Bytes of KV the parked steps hold in HBM, those being handed over to their agent's next step included,
        read from the engine (``kv.kv_bytes``) each time."""
        return self.parking.kv_bytes

    @property
    def num_running(self) -> int:
        """Requests in the running set."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, buffered ones included."""
        return len(self.queue) + self.intake.active_size

    @property
    def num_queued(self) -> int:
        """Requests accepted and never admitted (the inference queue's depth)."""
        return self._queued

    @property
    def has_work(self) -> bool:
        """Anything buffered, waiting, running or leaving the running set."""
        return bool(self._running or self.queue or self._leaving or self.intake.active_size)

    @property
    def core_waiting(self) -> bool:
        """A core request waits for admission (the step loop then ends its decode slice at the next step)."""
        return any(req.priority is PriorityClass.CORE for req in self.queue)

    @property
    def core_pending(self) -> bool:
        """A core request is buffered or waits for admission."""
        return self.core_waiting or any(req.priority is PriorityClass.CORE for req in self.intake)

    @property
    def next_deadline(self) -> float:
        """The earliest own deadline among the requests held, monotonic seconds (inf: none); may be earlier
        than the true one (a request that left), never later."""
        return self._next_deadline

    # ------------------------------------------------------------------ intake

    def add_request(self, req: Request, now: float) -> None:
        """Accept ``req`` into the double buffer, or refuse it at once.

        Refusals in this order: draining, the policy's own (:meth:`_refuse_early`), the queue full, the engine
        too small.

        Raises:
            DispatcherNotServing: the intake is closed (:meth:`check_open`; UNAVAILABLE).
            CannotMeetDeadline: the ``fair`` policy: its task's slack is already negative (DEADLINE_EXCEEDED).
            QueueFullError: ``queues.inference.capacity`` requests already wait (RESOURCE_EXHAUSTED).
            InvalidArgument: ``req`` could never fit the engine (its KV exceeds the HBM budget).
        """
        self.check_open()
        self._refuse_early(req, now)
        if self._queued >= self.queue_config.capacity:
            self.counters.queue_rejections["full"] += 1
            raise QueueFullError(QUEUE_NAME, self.queue_config.capacity)
        why = self.capacity.never_fits(req)
        if why is not None:
            self.counters.kv_oom_avoided += 1
            raise InvalidArgument("max_tokens", f"a request that fits the engine: {why}", req.max_tokens)
        req.status = RequestStatus.BUFFERED
        self._queued += 1
        self._next_expiry = min(self._next_expiry, req.arrival + self._timeout_s)
        if req.deadline is not None:
            self._next_deadline = min(self._next_deadline, req.deadline)
        full = self.intake.put(req, now)
        if self.adaptive_flush is not None:
            self.adaptive_flush.record_arrival(now)
        if full:
            self.flush(FlushReason.SIZE, now)

    def flush(self, reason: FlushReason, now: float) -> int:
        """Swap the double buffer: its whole active list joins the waiting set. Returns how many."""
        if not self.intake.active_size:
            return 0
        return self._join_waiting(self.intake.swap(), reason, now)

    def _join_waiting(self, batch: list[Request], reason: FlushReason, now: float) -> int:
        """``batch`` left the double buffer for ``reason``: it joins the waiting set as one flushed batch."""
        size = len(batch)
        flushed = FlushedBatch(size, now)
        self.counters.flushes[reason.label] += 1
        # the report's own copy: ``batch`` is the double buffer's list, reused at its next swap, and the loop
        # may publish the report later than that (engine_loop.STATS_INTERVAL_S); the loop makes its span
        self._events.flushed.append(BatchFlush(list(batch), reason, now))
        for req in batch:
            req.batch_size = size
            req.flush_reason = int(reason)
            req.batch = flushed
            if req.resume and req.agent_key:
                self._resume_prefix(req, now)
            self._enqueue(req, now)
        return size

    def close(self, reason: str | None = None) -> None:
        """Refuse new requests from now on (:meth:`check_open`); what is buffered is flushed at the next decision
        (DRAIN). ``reason``: why, as the refusals say it (None: :data:`SHUTTING_DOWN`, or the reason given
        before); a reason given replaces the one before (an engine loop that fails during a drain is what
        the refusals then name)."""
        if reason is not None:
            self._closed_because = reason
        self.intake.close()

    def check_open(self) -> None:
        """Refuse when the intake is closed (``intake.closed``, the one drain flag): the scheduler's own
        :meth:`add_request`, and the processor for a request that will not reach it.

        Raises:
            DispatcherNotServing: naming why it closed (:meth:`close`'s reason; UNAVAILABLE).
        """
        if self.intake.closed:
            raise DispatcherNotServing(self._closed_because)

    # ------------------------------------------------------------------ decisions

    def schedule(self, now: float) -> SchedulerOutput:
        """Flush the intake, expire, admit and preempt; returns the decision and the running set after it.

        Preempted requests have already lost their KV state (``kv.free``, or swapped to DRAM)
        when this returns; expired ones have failed with :class:`QueueTimeoutError`.
        """
        if self.intake.active_size:
            reason = FlushReason.DRAIN if self.intake.closed else FlushReason.STEP if self._running else FlushReason.IDLE
            self.flush(reason, now)
        out = SchedulerOutput()
        self._end_preemptions(now, out)
        if now >= self._next_expiry:
            self._expire(now, out)
        out.expired.extend(self.expire_deadlines(now))
        self._now = now
        score = self.monitor.read(now)
        self.score = score
        self.accounting.charge(self._running, now)
        self.parking.expire(now)
        if now >= self._next_hbm_scan:
            self.hbm_scan(now, out)
        self._refresh_fragmentation(now)
        # Due restores take the free room before admission, unless waiting work of a higher class is there
        # (its turn is expected about now: the room it takes its turn would take; the rest after admission).
        out.prefetch = self._prefetches(now, self.queue.peek() if self.queue else None)
        onto_idle = not self._running
        baseline = score if onto_idle else self.accounting.running_score  # what admitted work is measured from
        projected = score
        wave = 0
        while self.queue:
            req = self.queue.peek()
            reason = self._refusal_making_room(req, projected, wave)
            if reason is not None and reason in self.capacity.CLASS_REFUSALS:
                core = self._waiting_core_behind(req, projected, wave)
                if core is not None:  # CORE may take the slots held back from the head's class
                    self.queue.remove(core)
                    self._start(core, now, out)
                    wave += 1
                    projected += self.admission.expected.get(core.task_type)
                    continue
            if reason is not None:
                self.admission.refuse(reason)
                if reason == KV_MEMORY and self._kv_refused is not req:
                    self._kv_refused = req  # admitting it would overrun the HBM budget: an OOM avoided
                    self.counters.kv_oom_avoided += 1
                break
            self.queue.pop()
            self._start(req, now, out)
            wave += 1
            projected += self.admission.expected.get(req.task_type)
        self._preempt(now, out)
        out.prefetch += self._prefetches(now)
        for req in out.admitted:
            self.accounting.start(req, now, baseline, len(out.admitted), onto_idle)
        out.running = list(self._running)
        out.outputs = self._drain()
        return out

    def admit_core(self, now: float) -> SchedulerOutput:
        """Admit core work while the engine runs a step, preempting for it when it must: the layer-boundary path.

        The step loop calls it when a core request arrives during a step
        (``scheduler.core_preemption`` ``layer``). The buffered core requests
        leave the double buffer (flush reason ``preempt``; the rest stays for
        the step boundary) and join the waiting set in the policy's order. Then,
        from the head of that order and while the head is a core request, each
        is admitted as :meth:`schedule` admits (the policy's admission rule; its
        KV reserved in the budget; it joins the running set), at most
        ``max_admitted_per_decision`` of them (the admission wave: a wave that is
        full ends the call, as preempting frees nothing it bounds). One that does not
        fit (KV memory, or the compute score) preempts at once, as it would at
        the step boundary: the policy's victims (:meth:`_victim_candidates`,
        the fewest whose room lets it start) leave the running set now
        (``preempting``); they belong to the step in flight, so their KV stays
        held in the budget until that step ends, when it leaves in the
        background (a swap to DRAM) or is dropped (:meth:`schedule` does it
        first thing). Nothing is evicted for it, and one whose KV waits in the
        DRAM tier waits for the step boundary (restores happen between steps).
        Whatever is not admitted waits, in its place, for the next
        :meth:`schedule`. Admitting a core request behind waiting work of
        another class would break the policy's order, so none is (with
        ``fifo``, only a core request that is the oldest waiting work is
        admitted here, and it preempts nothing).

        Returns:
            ``admitted``: the requests admitted, in admission order; each needs
            its prefill (the step loop asks the engine for it at a layer
            boundary), empty when none fits; ``outputs``: requests that ended.
        """
        out = SchedulerOutput()
        taken = self.intake.take(lambda req: req.priority is PriorityClass.CORE)
        if taken:
            self._join_waiting(taken, FlushReason.PREEMPT, now)
        if now >= self._next_expiry:
            self._expire(now, out)
        self._now = now
        projected = self.score
        while self.queue and not self.admission.wave_full(len(out.admitted)):  # no preemption makes the wave room
            req = self.queue.peek()
            if req.priority is not PriorityClass.CORE or req.swap_key:
                break
            if ((self._policy_refusal(req, projected, len(out.admitted)) is not None
                    or self.capacity.refusal(req) is not None) and not self._preempt_mid_step(req, now, out)):
                break
            self.queue.pop()
            self._start(req, now, out)
            projected += self.admission.expected.get(req.task_type)
        for req in out.admitted:
            self.accounting.start(req, now, self.accounting.running_score, len(out.admitted))
        out.outputs = self._drain()
        return out

    def _preempt_mid_step(self, req: Request, now: float, out: SchedulerOutput) -> bool:
        """Make ``req`` fit while a step is in flight by preempting the fewest of the policy's victims; True
        when it now fits (the victims are ``preempting``), False (nothing changed) when they cannot make it fit.

        Each victim's reservation is freed; its live KV (:meth:`_kv_bytes`, a prefill's step allocation included; kept as ``req.kv_leaving_bytes``) stays held until the step in
        flight ends (:meth:`_end_preemptions`), so a victim adds only its reserved-but-unused bytes now.
        """
        budget = self.kv_budget
        chosen = self._fewest_victims(req, self._victim_candidates(req, out),
                                      lambda victim: victim.kv_reserved_bytes - self._kv_bytes(victim)
                                      if budget is not None else 0)
        if chosen is None:
            return False
        for victim in chosen:
            held = self._kv_bytes(victim)
            self._stop(victim, now)
            victim.status = PREEMPTING
            self._leaving.append(victim)
            if budget is not None:
                victim.kv_leaving_bytes = held
                budget.hold_leaving(held)
        if self.capacity.refusal(req) is not None:  # a capacity whose room the victims' bytes do not measure
            return False
        return True

    def _fewest_victims(self, req: Request, candidates: list[Request],
                        freed: Callable[[Request], int]) -> list[Request] | None:
        """The first of ``candidates`` (first victim first) whose preemption lets ``req`` fit: at least one (its
        slot, for a capacity that counts no bytes), more while the bytes ``freed(victim)`` leaves free now do not
        cover ``req``'s shortfall; None when all of them do not. The one rule of both preemptions: at a decision
        (the policy's ``_preempt``: a victim's whole reservation leaves) and mid-step (:meth:`_preempt_mid_step`:
        its live KV stays held until the step ends)."""
        shortfall = self._shortfall(req)  # a prefix it takes over is its own already
        chosen: list[Request] = []
        room = 0
        for victim in candidates:
            chosen.append(victim)
            room += freed(victim)
            if room >= shortfall:
                return chosen
        return None

    def _end_preemptions(self, now: float, out: SchedulerOutput) -> None:
        """The step the ``preempting`` requests belonged to has ended: each that finished in it ends (or
        parks); the others' KV leaves (to DRAM in the background where cheaper, else dropped) and they wait
        again at their place."""
        if not self._leaving:
            return
        leaving, self._leaving = self._leaving, []
        for victim in leaving:
            self._end_leaving(victim)
            self._evict_running(victim, now, out)

    def _end_leaving(self, req: Request) -> None:
        """The step ``req`` was preempted during has ended (or ``req`` ended): its live KV leaves the budget."""
        if self.kv_budget is not None:
            self.kv_budget.end_leaving(req.kv_leaving_bytes)
        req.kv_leaving_bytes = 0

    def expire_deadlines(self, now: float) -> list[Request]:
        """Fail every request held here whose own deadline (``req.deadline``) is ``now`` or earlier, wherever
        it is (buffered, waiting, running, preempting) and on every engine: DEADLINE_EXCEEDED
        (:class:`~switchyard.common.errors.RequestDeadlineExceeded`), its place and KV freed. The step loop
        calls it after every step (so a deadline is answered within one step), every decision calls it.

        Returns:
            the requests failed (O(held) work only when the earliest deadline has passed).
        """
        if now < self._next_deadline:
            return []
        nxt = math.inf

        def due(req: Request) -> bool:
            nonlocal nxt
            if req.deadline is None or req.is_finished:
                return False
            if req.deadline <= now:
                return True
            nxt = min(nxt, req.deadline)
            return False

        expired = self.intake.take(due)
        expired += [req for req in [*self.waiting, *self._running, *self._leaving] if due(req)]
        self._next_deadline = nxt
        for req in expired:
            where = (f"after {len(req.output_tokens)} tokens" if req.output_tokens
                     else "waiting for admission" if not req.reached_engine else "before its first token")
            waiting = req.waiting_on(now)
            if waiting and req.reached_engine:  # what it waited on: its upstream (the queue's wait is said above)
                where = f"{where}, waiting for {waiting}"
            self._end(req, now, RequestStatus.FINISHED_ERROR,
                      RequestDeadlineExceeded(req.request_id, req.deadline - req.arrival, where))  # type: ignore[operator]
            self.counters.deadlines_exceeded[req.priority.label] += 1
        return expired

    def on_idle(self, now: float) -> list[Request]:
        """What time alone changes while nothing is scheduled: the compute score and the KV fragmentation
        ratio are re-read (an idle engine's score falls, and autoscalers must not read a stale load), parked agents whose
        ``tool_wait_ttl_s`` ran out give their KV back, and swapped agents whose restore is due are
        returned (as ``SchedulerOutput.prefetch``: the loop restores each, then calls :meth:`prefetched`)."""
        self._now = now
        self.score = self.monitor.read(now)
        self.parking.expire(now)
        if now >= self._next_hbm_scan:
            self.hbm_scan(now, SchedulerOutput())
        self._refresh_fragmentation(now)  # the last busy reading stayed on the gauge of an idle engine
        return self._prefetches(now)

    def _refresh_fragmentation(self, now: float) -> None:
        """Recompute the KV fragmentation ratio (:meth:`fragmentation_ratio`, 0-1) that :meth:`make_stats`
        reports, at most every :data:`FRAGMENTATION_INTERVAL_S` seconds (``now``: monotonic seconds): it is
        O(running), so it is read about once a second, not at every decision; both :meth:`schedule` and
        :meth:`on_idle` call it, so an engine gone idle reports its state now, not its last busy step's."""
        if now >= self._next_fragmentation:
            self._next_fragmentation = now + FRAGMENTATION_INTERVAL_S
            self._fragmentation = self.fragmentation_ratio()

    def on_oom(self, reqs: list[Request], now: float, error: BaseException) -> SchedulerOutput:
        """An engine step over ``reqs`` failed with a real out-of-memory error: keep the process and the tasks.

        Each running member is preempted (its KV dropped, not swapped: a failed
        step may have left it half written; it waits again and recomputes) and
        the HBM scan runs at once. A request whose
        step fails
        this way a second time fails with RESOURCE_EXHAUSTED. Returns the
        preempted requests, those failed (``expired``) and their outputs.
        """
        self.counters.kv_oom += 1
        log.warning("engine step of %d requests ran out of device memory (%s); preempting them and evicting",
                    len(reqs), error)
        out = SchedulerOutput()
        failed = []
        for req in reqs:
            if req.status is not RUNNING:
                continue
            req.oom_retries += 1
            if req.oom_retries > 1:
                self._end(req, now, RequestStatus.FINISHED_ERROR, SwitchyardError(
                    f"device memory ran out twice in this request's engine steps ({error}); the HBM budget "
                    "(memory_policy.toml [hbm] capacity_ratio) is larger than what the device has free",
                    grpc.StatusCode.RESOURCE_EXHAUSTED))
                failed.append(req)
                continue
            self._preempt_one(req, now, out, swap=False)
        self.hbm_scan(now, out)
        out.expired = failed
        out.outputs = self._drain()
        return out

    def update_from_output(self, batch: StepBatch, result: StepResult, now: float) -> list[RequestOutput]:
        """Write an engine step's ``result`` into ``batch``'s requests and end those it finished.

        For every engine (a stream engine's items come as one-request results): tokens, tool calls and the
        computed prefix are written (:func:`.update.apply_output`), then the one stop check
        (:func:`.update.check_stop`: end-of-sequence -> stop or tool_calls, ``max_tokens`` or the engine's
        length limit -> length) ends a request, freeing its place and KV or parking its agent
        (``react_loop``, tool_calls). A request the engine failed ends with its error. Requests past
        their own deadline end too (:meth:`expire_deadlines`, so a deadline is answered within one step).

        Returns:
            one output per request that produced something or ended, in ``batch`` order; the engine loop
            publishes them.
        """
        prefilled = set()
        for req, _ in batch.prefill:
            prefilled.add(id(req))
            req.step_kv_bytes = 0  # the step ended: what it holds now is the engine's to say (kv.kv_bytes)
        for req in batch.requests:
            seq = result.outputs.get(req.seq_id)
            if seq is None or req.status not in (RUNNING, PREEMPTING):
                continue
            out, status = apply_output(req, seq, prefilled=id(req) in prefilled, now=now, kv=self.kv,
                                       engine_enforces_max_tokens=self.engine_enforces_max_tokens)
            if status is not None:
                self._end(req, now, status, req.error, out)
            elif out.tokens or out.tool_calls:
                self._outbox.append(out)
        self.expire_deadlines(now)
        return self._drain()

    def compose_batch(self, prefill: list[Request], decode: list[Request], budget: int | None = None) -> StepBatch:
        """One engine step over ``prefill`` and ``decode`` (:func:`.update.compose_batch`: prefix-cache hits,
        then the prompt tokens each prefill computes, chunked under ``budget`` when given). Each
        prefill's ``step_kv_bytes`` is the KV the step allocates for it (its prefix after the step, its computed
        tokens and those the step computes), held from now until the step's result comes (:meth:`update_from_output`):
        a request cancelled, failed or preempted while its prefill runs has held it (:meth:`_kv_bytes`)."""
        batch = compose_batch(self.kv, prefill, decode, budget)
        per_token = self._kv_bytes_per_token
        if per_token:  # a decode's one token more is the engine's count within a step: prefills only (few a step)
            for req, tokens in batch.prefill:
                req.step_kv_bytes = (req.num_computed_tokens + tokens) * per_token
        return batch

    def step_not_run(self, batch: StepBatch) -> None:
        """``batch`` was composed but computed nothing (a layer-boundary prefill whose step in flight ended first,
        a step that ran out of device memory: its allocation was refused):
        its prefills hold no allocation of it (``step_kv_bytes`` back to 0; their next step's composition sets it)."""
        for req, _ in batch.prefill:
            req.step_kv_bytes = 0

    def finish_requests(self, reqs: list[Request], status: RequestStatus, now: float,
                        error: BaseException | None = None) -> list[RequestOutput]:
        """End ``reqs`` with ``status`` (``FINISHED_ABORTED``: the caller went away; ``FINISHED_ERROR`` with
        ``error``), wherever they are (``req.status`` names the place): free their place and KV.
        Requests never accepted (``NEW``) or finished (``PARKED`` included) are skipped (idempotent).
        Returns the outputs of every request that ended since the last call that returned outputs."""
        for req in reqs:
            if not req.is_finished:
                self._end(req, now, status, error)
        return self._drain()

    def _drain(self) -> list[RequestOutput]:
        outputs, self._outbox = self._outbox, []
        return outputs

    def _end(self, req: Request, now: float, status: RequestStatus, error: BaseException | None = None,
             out: RequestOutput | None = None, *, taken_out: bool = False) -> None:
        """``req`` ends with ``status`` wherever it is: free what it holds, queue its output. Idempotent. The
        one way a request ends (``taken_out``: a waiting ``req`` the caller already took out of the queue, as
        :meth:`_expire` takes many at once).

        A react_loop agent's step that ended in tool calls is parked instead
        (:func:`~switchyard.dispatcher.scheduler.base.should_park`): its KV stays
        warm; anything else has its KV freed. Recomputed and restored tokens count only for a request that
        reached the engine (a resumed step that never ran recomputed nothing).
        """
        state = req.status
        if state is RequestStatus.NEW or req.is_finished:  # a parked step is finished: its parking releases it
            return
        if status in _UNFINISHED:  # what it waited on as it was cut short, for its caller's words (GenerateDone)
            req.waited_on = req.waiting_on(now)
        req.status = status
        if error is not None:
            req.error = error
        if state is RUNNING:
            self._stop(req, now)
            self._learn(req)
        elif state is PREEMPTING:  # out of the running set already; its KV held until now
            self._leaving.remove(req)
            self._end_leaving(req)
        elif state is WAITING and not taken_out:
            self.queue.remove(req)
        elif state is RequestStatus.BUFFERED:
            self.intake.remove(req)
        if not req.reached_engine:
            self._queued -= 1
            req.queue_wait_s = max(0.0, now - req.arrival)  # all its life: what its done (or error's consumed) says
            # its wait ended unserved: observed too, or the histogram would leave out the waits of an overload
            expired = status is RequestStatus.FINISHED_ERROR and isinstance(
                req.error, (QueueTimeoutError, RequestDeadlineExceeded))
            self._events.queue_waits_s.append(("expired" if expired else "cancelled", req.queue_wait_s))
        self._end_handover(req)
        self._batch_member_done(req, now)
        if req.swap_key:  # a DRAM copy it will not come back for
            self.tiers.discard(req.swap_key)
            req.swap_key, req.swap_tokens = "", 0
        if req.reached_engine:
            self.counters.recomputed_tokens += req.recomputed_tokens
            self.counters.restored_tokens += req.restored_tokens
        if state is RUNNING and should_park(req):
            req.status = PARKED
            self.parking.park(req, now)
        elif state in (RUNNING, PREEMPTING):
            self._release(req)
        out = out or RequestOutput(req)
        out.finished = True
        self._outbox.append(out)

    def resume(self, req: Request, now: float) -> None:
        """Accept a react_loop agent's next step (``resume`` set) straight into the waiting set: the benches' and
        tests' way in, on their own clock. A dispatcher's resumed step comes as every request does
        (:meth:`add_request` from the loop's ``submit``, ``GenerateRequest.resume`` set), flushed at the next
        decision (``schedule`` flushes what the buffer holds), which this does at once."""
        req.resume = True
        self.add_request(req, now)
        self.flush(FlushReason.STEP, now)

    def shutdown(self) -> None:
        """Release NVML. The engine loop calls it once at shutdown."""
        self.monitor.close()

    # ------------------------------------------------------------------ policy hooks

    def make_queue(self) -> RequestQueue:
        """The policy's waiting queue (:mod:`.request_queue`: its ``order_key`` is the policy's order)."""
        raise NotImplementedError

    def _refuse_early(self, req: Request, now: float) -> None:
        """Refuse ``req`` at :meth:`add_request` for the policy's own reason, after the drain check (default:
        never); raises the refusal (a :class:`~switchyard.common.errors.SwitchyardError`)."""

    def _refusal_making_room(self, req: Request, projected_score: float, wave: int) -> str | None:
        """None when the head ``req`` may start now, else the refusal reason: the policy's admission rule,
        then KV memory (evicting what :meth:`_make_room` may to make it fit).

        ``wave``: requests admitted earlier in this decision.
        """
        reason = self._policy_refusal(req, projected_score, wave)
        if reason is not None:
            return reason
        return self._make_room(req)

    def _waiting_core_behind(self, head: Request, projected_score: float, wave: int) -> Request | None:
        """The first waiting CORE request behind ``head`` (refused for its class) when it may start now, else None.

        A capacity may hold slots back for CORE (:class:`.capacity.ConcurrencyCapacity`,
        ``upstream_core_reserve``): the head of a lower class then waits in its place while the
        first CORE request in the waiting order takes a held slot. The policy's order stands
        within CORE, and every other request keeps its place.
        """
        if head.priority is PriorityClass.CORE:
            return None
        for req in self.queue:
            if req.priority is PriorityClass.CORE:
                return req if self._refusal_making_room(req, projected_score, wave) is None else None
        return None

    def _policy_refusal(self, req: Request, projected_score: float, wave: int) -> str | None:
        """The policy's admission rule alone (memory aside): None when ``req`` may start, else the reason.

        Default: the compute score and the admission wave (:class:`.admission.Admission`).
        """
        return self.admission.check(req.task_type, len(self._running), projected_score, wave)

    def _preempt(self, now: float, out: SchedulerOutput) -> None:
        """Preempt running work for waiting work, after the admission pass (default: never)."""

    def _victim_candidates(self, req: Request, out: SchedulerOutput) -> list[Request]:
        """Running requests the waiting ``req`` may preempt now, first victim first; [] when it may not
        (default: never). Requests admitted in this decision (``out.admitted``) are never candidates."""
        return []

    # ------------------------------------------------------------------ helpers for policies

    @property
    def _timeout_s(self) -> float:
        return self.queue_config.timeout_ms / 1000

    def _enqueue(self, req: Request, now: float) -> None:
        req.status = WAITING
        self.queue.add(req, now)

    def _start(self, req: Request, now: float, out: SchedulerOutput) -> None:
        first = not req.reached_engine
        req.admitted_at = now
        req.status = RUNNING
        self._running.append(req)
        self.capacity.take(req)
        if first:
            req.queue_wait_s = now - req.arrival
            self._events.queue_waits_s.append(("admitted", max(0.0, req.queue_wait_s)))
            self._queued -= 1
        else:  # a request that reached the engine waits again only after a preemption
            self.counters.resumes["preempted"] += 1
        handover = self.parking.handover(req)
        if handover is not None:  # its agent's parked step holds the warm prefix: take it over
            shared = self.kv.share_prefix(handover.parked, req)
            if shared != req.num_computed_tokens:  # an engine whose requests hold their own caches
                if not shared:  # nothing copied: the prefix is recomputed
                    req.recomputed_tokens += min(req.num_computed_tokens, req.prompt_tokens)
                req.num_computed_tokens = shared
        self._end_handover(req)
        out.admitted.append(req)
        if req.swap_key:
            out.restore.append(req)

    def requeue(self, req: Request, now: float) -> None:
        """``req``, running, got nothing from its engine, which refused it for load (an upstream's 429 after
        the gateway's retries): it leaves the running set and waits again at its original place, as a
        preempted request does (counted as a preemption, its span's ``preempted`` event), to be admitted
        again under the limit the refusal backed off."""
        self._stop(req, now)
        self._wait_again(req, now)

    def _wait_again(self, req: Request, now: float) -> None:
        """``req``, out of the running set, waits again at its original place: a preemption."""
        req.mark_preempted()
        self._enqueue(req, now)
        self.counters.preemptions[req.priority.label] += 1

    def _stop(self, req: Request, now: float) -> None:
        self.accounting.stop(req, len(self._running), now)
        self._running.remove(req)
        self.capacity.give(req)

    def _preempt_one(self, victim: Request, now: float, out: SchedulerOutput, swap: bool = True,
                     delays: int = 0) -> bool:
        """Take ``victim``'s slot: its KV goes to DRAM (when ``swap`` and cheaper than recomputing it,
        counting the ``delays`` higher-class waiting requests the copy would hold up: :meth:`_swap_out`) or
        is dropped, and it waits again at its original place. True when it was swapped."""
        self._stop(victim, now)
        return self._evict_running(victim, now, out, swap, delays)

    def _evict_running(self, victim: Request, now: float, out: SchedulerOutput, swap: bool = True,
                       delays: int = 0) -> bool:
        """``victim`` left the running set: its KV leaves HBM (see :meth:`_preempt_one`); True when swapped."""
        swapped = swap and self._swap_out(victim, self.tiers.request_key(victim), delays)
        if not swapped:
            self.counters.hbm_evictions += 1  # dropped: its next prefill recomputes
        self._release(victim)
        self._wait_again(victim, now)
        out.preempted.append(victim)
        return swapped

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        """Fail every never-admitted waiting request older than ``queues.inference.timeout_ms``; the next expiry
        is the earliest of the rest, buffered ones included (:meth:`admit_core` expires with the buffer
        holding requests)."""
        deadline = self._timeout_s
        for req in self.queue.remove_where(lambda r: not r.reached_engine and now - r.arrival > deadline):
            self.counters.queue_rejections["timeout"] += 1
            self._end(req, now, RequestStatus.FINISHED_ERROR, QueueTimeoutError(
                QUEUE_NAME, now - req.arrival, self.queue_config.timeout_ms, "admission to the engine"),
                taken_out=True)
            out.expired.append(req)
        self._next_expiry = min((r.arrival + deadline for r in (*self.queue, *self.intake) if not r.reached_engine),
                                default=math.inf)

    def _batch_member_done(self, req: Request, now: float) -> None:
        batch, req.batch = req.batch, None
        if batch is None:
            return
        batch.left -= 1
        if batch.left <= 0 and self.adaptive_flush is not None:
            self.adaptive_flush.record_batch_service(max(0.0, now - batch.flushed_at))

    @property
    def flush_deadline(self) -> float | None:
        """When the double buffer's first buffered request will have waited the flush interval
        (``batching.flush_interval_ms``), monotonic seconds; None while the buffer is empty. The loop owns
        the timer: at that time it calls :meth:`flush` with ``FlushReason.INTERVAL``."""
        return self.intake.deadline()

    def _learn(self, req: Request) -> None:
        """``req`` ended: its marginal score joins its task type's expected score (admission), its score used and
        memory peak the task histograms. A ``prefill_only`` warm-up's score is no task of its type's (a burst of
        prefill, one token): learnt, it held its type's answers back at admission behind one running decode."""
        observed = self.accounting.marginal_score(req)
        if observed is not None and not req.prefill_only:
            self.admission.expected.learn(req.task_type, observed)
        self._events.task_compute_score_used.append(req.compute_score_used)
        self._events.task_memory_peak_bytes.append(req.memory_peak_bytes)

    def _kv_bytes(self, req: Request) -> int:
        """KV bytes held for ``req`` now (:func:`.accounting.held_kv_bytes`: the engine's count, or what the step in
        flight allocated for it when more)."""
        return held_kv_bytes(self.kv, req)

    def _release(self, req: Request) -> None:
        """Free ``req``'s KV (:func:`.update.release_kv`; a parked step leaving its parking ends as tool_calls)."""
        release_kv(self.kv, req)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state now, and what it counted and observed since the previous call
        (:class:`~switchyard.dispatcher.scheduler.base.SchedulerStats`). The engine loop is its one caller: it
        publishes every report (a report not published loses its counts and events to the metrics, not to
        :attr:`counters`)."""
        counted = self.counters.copy()
        events, self._events = self._events, SchedulerEvents()
        monitor = self.monitor
        nvml = monitor.sample.source.startswith("nvml")
        stats = SchedulerStats(num_running=len(self._running), num_waiting=self.num_waiting,
                               num_queued=self._queued, queue_capacity=self.queue_config.capacity,
                               parked=len(self.parking.requests), parked_kv_bytes=self.parking.kv_bytes,
                               compute_score=self.score, gpu_available=monitor.gpu_available,
                               gpu_utilization=monitor.sample.cuda_util / 100.0 if nvml else None,
                               gpu_memory_utilization=monitor.sample.bandwidth_util / 100.0 if nvml else None,
                               fragmentation_ratio=self._fragmentation,
                               expected_scores=self.admission.expected.snapshot(),
                               counters=counted.since(self._reported), events=events)
        self._reported = counted
        for s in self._running:
            stats.running[s.priority.label] += 1
        for s in (*self.queue, *self.intake):  # waiting for admission, as num_waiting counts: buffered ones too
            stats.waiting[s.priority.label] += 1
        if self.kv_budget is not None:
            stats.hbm_held_bytes = self.kv_budget.held_bytes
        return stats

    def fragmentation_ratio(self) -> float:
        """Share of the KV block pool's allocated bytes holding no token state, 0-1.

        Allocated: each running request's reservation (or the engine's
        allocation, when larger), parked agents' state and the prefix cache.
        Live: tokens whose KV is computed x KV bytes per token, plus the parked
        and cached state. The waste PagedAttention measures in existing systems
        (reserved slots and internal fragmentation; Kwon et al., SOSP 2023,
        section 2.3 and Fig. 2: 20-38 % of KV memory held token state there).
        """
        per_token = self.kv_budget.info.kv_bytes_per_token if self.kv_budget is not None else 0
        held = self._held_beside_running()
        allocated, live = held, held
        for req in self._running:
            allocated += max(req.kv_reserved_bytes, self._kv_bytes(req))
            live += req.num_computed_tokens * per_token
        return max(0.0, 1.0 - live / allocated) if allocated else 0.0
