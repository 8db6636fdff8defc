"""The scheduler's one interface: a state machine the engine loop drives, one call at a time.

Shape after vLLM's v1 scheduler interface (``vllm/v1/core/sched/interface.py``)
and its engine core's step (``vllm/v1/engine/core.py`` ``step()``:
``schedule()`` -> ``execute_model()`` -> ``update_from_output()``). The loop
(:mod:`switchyard.dispatcher.engine_loop` for step engines,
:mod:`switchyard.dispatcher.stream_loop` for stream engines) drives it, and
every call comes through the loop's own methods, on the event loop's thread,
one at a time (no call awaits inside the scheduler): the RPC handlers' submit,
abort and tool-wait calls (``LoopBase.submit``, ``abort``, ``tool_wait``), the
prefetches the loop starts, and mid-step preemption (the step loop admits CORE
work while a step runs; the stream loop starts CORE streams as they arrive).
It runs, turn after turn:

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
away, the engine failed), :meth:`Scheduler.requeue` (an upstream refused a
running request for load before its first token), :meth:`Scheduler.make_stats` (what the loop publishes
to the metrics after each decision), :meth:`Scheduler.flush` (the flush-interval timer),
:meth:`Scheduler.admit_core` (core work mid-step), :meth:`Scheduler.on_idle` (time passing with
nothing scheduled), :meth:`Scheduler.on_oom` (a step ran out of device memory),
:meth:`Scheduler.tool_wait` and :meth:`Scheduler.prefetched` (an agent's tool wait and its planned
restore), :meth:`Scheduler.close` and :meth:`Scheduler.shutdown` (drain and stop). :class:`Scheduler`
declares every call and attribute the loops and the service use (``tests/test_scheduler_purity.py``
checks it); a policy implements it by subclassing
:class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`. Every call that ends requests returns
their outputs; nothing inside the scheduler writes to a stream, starts a timer,
touches asyncio, records a metric or makes a span: the loop owns time (the
double buffer's flush-interval timer included: :attr:`Scheduler.flush_deadline`)
and telemetry. The scheduler records what happened as plain data
(:class:`SchedulerCounters`, :class:`SchedulerEvents`), reported by
:meth:`Scheduler.make_stats`; the loop publishes it as Prometheus metrics
(:func:`switchyard.dispatcher.metrics.publish_stats`) and makes the
``dispatcher.batch`` span of each flushed batch (``tests/test_scheduler_purity.py``
checks that no module of this package imports ``prometheus_client``,
``opentelemetry`` or ``asyncio``).

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

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from switchyard.common.priority import LABELS
from switchyard.dispatcher.double_buffer import DoubleBuffer, FlushReason
from switchyard.dispatcher.request import Request, RequestOutput, RequestStatus, SchedulerOutput
from switchyard.dispatcher.scheduler.tool_wait import RESUME_KINDS

if TYPE_CHECKING:
    from switchyard.dispatcher.engines.base import StepBatch, StepResult
    from switchyard.dispatcher.scheduler.capacity import Capacity
    from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor
    from switchyard.dispatcher.scheduler.tool_wait import ToolWaitDecision
    from switchyard.dispatcher.tiers import MemoryTiers

__all__ = ["QUEUE_NAME", "REACT_TASK_TYPE", "SEQUENCE_RESUME_KINDS", "BatchFlush", "Scheduler", "SchedulerCounters", "SchedulerEvents",
           "SchedulerOutput", "SchedulerStats", "should_park"]


QUEUE_NAME = "inference"
"""The scheduler's queue's name: in its refusals (:class:`~switchyard.common.errors.QueueFullError`,
:class:`~switchyard.common.errors.QueueTimeoutError`), its queue-wait span and the ``queue`` label of the shared
``switchyard_queue_*`` metrics."""


REACT_TASK_TYPE = "react_loop"
"""The task type whose agents alternate GPU thinking and tool waits."""


SEQUENCE_RESUME_KINDS: tuple[str, ...] = ("preempted", *RESUME_KINDS)
"""How a sequence came back (:attr:`SchedulerCounters.resumes`, ``switchyard_resumes_total{resume}``): re-admitted
after preemption, or a react_loop agent back from a tool call as :data:`.tool_wait.RESUME_KINDS` says (its prefix
state warm in HBM, restored from the DRAM tier, or cold: the one set of ``switchyard_tool_resumes_total``'s
``resume`` label)."""


def should_park(req: Request) -> bool:
    """True when ``req`` ended its step waiting on a tool and will come back.

    That is a ``react_loop`` request with an ``agent_id`` that finished with
    ``finish_reason == "tool_calls"``: the agent's next Generate (``resume``
    set) continues the same prefix.
    """
    return req.task_type == REACT_TASK_TYPE and bool(req.agent_id) and req.finish_reason == "tool_calls"


@dataclass
class SchedulerCounters:
    """What the scheduler has counted, as plain numbers: each field only grows. The engine loop publishes
    the increase between two reports as the Prometheus counter named beside it
    (:func:`switchyard.dispatcher.metrics.publish_stats`).

    Per-label counts are :class:`collections.Counter` keyed by the label value, always from a bounded
    set: ``flushes`` by flush reason (:data:`~switchyard.dispatcher.double_buffer.FLUSH_REASON_LABELS`;
    ``switchyard_flushes_total``), ``queue_rejections`` by reason (full, timeout;
    ``switchyard_queue_rejected_total{queue="inference"}``), ``admissions_refused`` by reason (the
    admission rule's and the capacity's; ``switchyard_admissions_refused_total``), ``preemptions`` and
    ``deadlines_exceeded`` by the request's priority class (``switchyard_preemptions_total``,
    ``switchyard_request_deadline_exceeded_total``), ``refused_early`` by the request's priority class (the
    ``fair`` policy's refusals of work that cannot make its task's deadline;
    ``switchyard_requests_refused_early_total``), ``resumes`` by kind (:data:`SEQUENCE_RESUME_KINDS`;
    ``switchyard_resumes_total``). Per tool, keyed ``(tool, label)`` (the tool
    a bounded label: :data:`switchyard.common.metrics.TOOL_NAMES` or ``other``): ``tool_decisions`` by
    decision (``switchyard_tool_wait_decisions_by_tool_total``; summed over the tools, :attr:`tool_wait_decisions`,
    ``switchyard_tool_wait_decisions_total``), ``tool_resumes`` by warm / restored /
    cold (:data:`.tool_wait.RESUME_KINDS`; ``switchyard_tool_resumes_total``), ``tool_prefetches`` by the tool's return, early / on_time / late
    (``switchyard_tool_wait_prefetches_total``; :mod:`.tool_wait`). ``tenant_service``: the tokens of
    service the ``fair`` policy charged each tenant (its attained service, not decayed), by the tenant's
    label (:func:`.fair.tenant_labels`: the tenants ``scheduler.tenant_weights`` names, ``default``, and
    ``other``; ``switchyard_tenant_service_tokens_total``).

    Plain counts: parked agents whose state left HBM at TTL expiry (``tool_wait_expired``) or to make
    room (``parked_evicted``); the HBM tier's lookups found (``hbm_hits``) and not found
    (``hbm_misses``), KV state dropped or moved out of it (``hbm_evictions``: the one count of both; the tiers
    count the move down as a demotion) and its scans
    (``hbm_scans``; ``switchyard_tier_*_total{tier="hbm"}``); requests whose KV would not fit even after
    eviction, refused at intake as never fitting or held at admission (``kv_oom_avoided``), real device allocation failures (``kv_oom``), KV
    block-table compactions and the bytes they gave back (``defragmentations``,
    ``defrag_freed_bytes``), and the prefix tokens of ended requests restored from a lower tier or
    computed again (``restored_tokens``, ``recomputed_tokens``; counted when the request ends).
    """

    flushes: Counter[str] = field(default_factory=Counter)
    queue_rejections: Counter[str] = field(default_factory=Counter)
    admissions_refused: Counter[str] = field(default_factory=Counter)
    preemptions: Counter[str] = field(default_factory=Counter)
    deadlines_exceeded: Counter[str] = field(default_factory=Counter)
    refused_early: Counter[str] = field(default_factory=Counter)
    resumes: Counter[str] = field(default_factory=Counter)
    tool_decisions: "Counter[tuple[str, str]]" = field(default_factory=Counter)
    tool_resumes: "Counter[tuple[str, str]]" = field(default_factory=Counter)
    tool_prefetches: "Counter[tuple[str, str]]" = field(default_factory=Counter)
    tenant_service: Counter[str] = field(default_factory=Counter)
    tool_wait_expired: int = 0
    parked_evicted: int = 0
    hbm_hits: int = 0
    hbm_misses: int = 0
    hbm_evictions: int = 0
    hbm_scans: int = 0
    kv_oom_avoided: int = 0
    kv_oom: int = 0
    defragmentations: int = 0
    defrag_freed_bytes: int = 0
    restored_tokens: int = 0
    recomputed_tokens: int = 0

    @property
    def tool_wait_decisions(self) -> Counter[str]:
        """Tool-wait decisions by decision (keep, swap, drop): ``tool_decisions`` summed over the tools, the one
        count of them (a second counter, kept beside it, was counted at another line)."""
        out: Counter[str] = Counter()
        for (_tool, decision), n in self.tool_decisions.items():
            out[decision] += n
        return out

    def copy(self) -> "SchedulerCounters":
        """An independent copy (the per-label counts copied too)."""
        out = SchedulerCounters.__new__(SchedulerCounters)  # the engine loop reports up to every 50 ms: kept cheap
        vars(out).update({name: _copied(value) for name, value in vars(self).items()})
        return out

    def since(self, earlier: "SchedulerCounters") -> "SchedulerCounters":
        """What was counted after ``earlier`` (an earlier :meth:`copy` of these counters): field by field,
        this minus ``earlier``; a per-label count keeps only the labels that grew."""
        before = vars(earlier)
        out = SchedulerCounters.__new__(SchedulerCounters)
        vars(out).update({name: _grown(value, before[name]) if isinstance(value, Counter) else value - before[name]
                          for name, value in vars(self).items()})
        return out


def _copied(value: "Counter[str] | int") -> "Counter[str] | int":
    if not isinstance(value, Counter):
        return value
    out: Counter[str] = Counter.__new__(Counter)  # Counter() and its update cost ~20x a dict's
    dict.update(out, value)
    return out


def _grown(now: "Counter[str]", before: "Counter[str]") -> "Counter[str]":
    out: Counter[str] = Counter.__new__(Counter)
    for label, n in now.items():
        if n > before.get(label, 0):
            dict.__setitem__(out, label, n - before.get(label, 0))
    return out


@dataclass
class BatchFlush:
    """One swap of the double buffer: its members in order, why it was flushed, and when (monotonic
    seconds). The engine loop makes the ``dispatcher.batch`` span from it."""

    members: list[Request]
    reason: FlushReason
    at: float


@dataclass
class SchedulerEvents:
    """What happened between two reports that is observed one by one (histograms, spans), in order.

    ``flushed``: the batches the double buffer flushed (``switchyard_batch_size`` and the
    ``dispatcher.batch`` span); ``queue_waits_s``: each request's (outcome, wait) from arrival to its first
    admission (``admitted``), or to its end without one (``expired``: ``queues.inference.timeout_ms`` or its own
    deadline passed; ``cancelled``: its caller left, or it failed otherwise), seconds
    (``switchyard_queue_wait_seconds{queue="inference",outcome}``); ``tool_wait_expected_s``:
    the expected tool waits of the tool-wait decisions, seconds (``switchyard_tool_wait_expected_seconds``);
    ``task_compute_score_used`` / ``task_memory_peak_bytes``: per request that ended after running, its
    compute score x seconds and its peak KV bytes (``switchyard_task_compute_score_used``,
    ``switchyard_task_memory_peak_bytes``).
    """

    flushed: list[BatchFlush] = field(default_factory=list)
    queue_waits_s: list[tuple[str, float]] = field(default_factory=list)
    tool_wait_expected_s: list[float] = field(default_factory=list)
    task_compute_score_used: list[float] = field(default_factory=list)
    task_memory_peak_bytes: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats:
    """What :meth:`Scheduler.make_stats` reports; the loop publishes it to the metrics (after vLLM's
    ``SchedulerStats`` in ``vllm/v1/metrics/stats.py``, which its scheduler's ``make_stats`` also fills with
    what was counted since the last call).

    State now (gauges): ``running`` / ``waiting``: requests by priority class label (core, normal, batch;
    waiting counts the double buffer's too, as ``num_waiting`` does); ``num_waiting``: waiting plus buffered; ``num_queued``: accepted
    and never admitted (the inference queue's depth); ``queue_capacity``: ``queues.inference.capacity``;
    ``parked``, ``parked_kv_bytes``: react_loop agents waiting on a tool and the bytes of prefix state kept
    warm for them; ``hbm_held_bytes``: bytes the KV budget holds (None: the capacity counts no bytes);
    ``compute_score``: 0-100, read at the last decision; ``gpu_available``: True once NVML answered, False
    once the compute score falls back to the engine, None before its first read; ``gpu_utilization`` /
    ``gpu_memory_utilization``: the last NVML sample's GPU and memory utilisation, 0-1 (None: the last
    sample was not NVML's); ``fragmentation_ratio``: the KV fragmentation ratio last computed (0-1;
    recomputed at decisions about once a second); ``expected_scores``: the learned expected compute score
    by task type (types never seen absent).

    Since the previous report: ``counters`` (:class:`SchedulerCounters`: what was counted in between;
    the scheduler's running totals are its ``counters``) and ``events`` (:class:`SchedulerEvents`).
    """

    running: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LABELS, 0))
    waiting: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LABELS, 0))
    num_running: int = 0
    num_waiting: int = 0
    num_queued: int = 0
    queue_capacity: int = 0
    parked: int = 0
    parked_kv_bytes: int = 0
    hbm_held_bytes: int | None = None
    compute_score: float = 0.0
    gpu_available: bool | None = None
    gpu_utilization: float | None = None
    gpu_memory_utilization: float | None = None
    fragmentation_ratio: float = 0.0
    expected_scores: dict[str, float] = field(default_factory=dict)
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    events: SchedulerEvents = field(default_factory=SchedulerEvents)


@runtime_checkable
class Scheduler(Protocol):
    """A scheduling policy behind the engine loop (see the module docstring for the call order)."""

    name: str
    """Policy name: ``priority``, ``fifo`` or ``fair`` (``scheduler.policy``)."""

    def add_request(self, req: Request, now: float) -> None:
        """Accept ``req`` (into the double buffer), or refuse it at once.

        A request with ``resume`` set is a react_loop agent back from a tool call: it goes ahead of new
        work of its class, and reuses its agent's warm prefix state when the TTL has not run out.

        Raises:
            DispatcherNotServing: closed (:meth:`close`; UNAVAILABLE).
            QueueFullError: ``queues.inference.capacity`` requests wait already (RESOURCE_EXHAUSTED).
            InvalidArgument: it could never fit the engine (``max_tokens``).
            CannotMeetDeadline: the ``fair`` policy: its task's slack is already negative (DEADLINE_EXCEEDED).
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

    def step_not_run(self, batch: "StepBatch") -> None:
        """``batch`` was composed but computed nothing (a layer-boundary prefill whose step in flight ended first, a
        step that ran out of device memory):
        what its composition recorded as allocated for its prefills (``Request.step_kv_bytes``) is let go."""

    def finish_requests(self, reqs: list[Request], status: RequestStatus, now: float,
                        error: BaseException | None = None) -> list[RequestOutput]:
        """End ``reqs`` with ``status`` wherever they are (``req.status`` names the place); idempotent.

        Returns:
            their outputs (each ``finished``).
        """

    def requeue(self, req: Request, now: float) -> None:
        """``req``, running, got nothing from its engine, which refused it for load: it waits again at its
        original place (counted as a preemption)."""

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state now and what it counted and observed since the previous call, for the loop
        to publish (:class:`SchedulerStats`); the loop is its one caller."""

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

    def flush(self, reason: FlushReason, now: float) -> int:
        """Swap the double buffer (``reason``: the loop's timer gives ``INTERVAL``); its whole active list joins
        the waiting set. Returns how many requests it moved."""

    def close(self, reason: str | None = None) -> None:
        """Refuse new requests from now on (draining, or ``reason``: :meth:`add_request` raises
        ``DispatcherNotServing`` naming it); what is buffered joins at the next decision. ``intake.closed`` is
        the one drain flag the loops and the processor read."""

    def check_open(self) -> None:
        """Refuse when the intake is closed: raises ``DispatcherNotServing`` (UNAVAILABLE) naming why
        (:meth:`close`'s reason)."""

    def admit_core(self, now: float) -> SchedulerOutput:
        """While a step runs: take the core requests out of the double buffer and admit the head of the waiting
        order while it is core work (preempting for it where the policy may, at most
        ``max_admitted_per_decision`` of them).

        Returns:
            ``admitted`` (each needs its prefill, at the step's next layer boundary) and the ``outputs`` of the
            requests that ended.
        """

    def on_idle(self, now: float) -> list[Request]:
        """Nothing is scheduled: re-read the compute score and the KV fragmentation ratio, release parked agents
        whose TTL ran out. Returns the swapped agents' parked steps whose planned restore is due (the loop
        restores each, then calls :meth:`prefetched`)."""

    def on_oom(self, reqs: list[Request], now: float, error: BaseException) -> SchedulerOutput:
        """A step over ``reqs`` failed with a real out-of-memory error: preempt them (a second time fails one,
        RESOURCE_EXHAUSTED) and run the HBM scan. Returns the preempted, the failed (``expired``) and the
        outputs."""

    def until_prefetch(self, timeout: float, now: float) -> float:
        """How long a loop that would wait ``timeout`` seconds may wait: less when a planned restore falls due
        sooner (seconds, >= 0)."""

    def prefetched(self, req: Request, restored: int, now: float) -> bool:
        """A planned restore into the parked step ``req`` ended with ``restored`` tokens loaded (0: a miss);
        True when it landed (``req`` parked again, warm)."""

    def tool_wait(self, program_key: str, expected_wait_s: float, now: float,
                  tool: str = "other") -> "ToolWaitDecision | None":
        """An agent's tool call on ``tool`` starts: keep, swap or drop its parked KV now; None when the agent has
        no parked step here.

        Raises:
            ValueError: ``expected_wait_s`` < 0.
        """

    def forget_agent(self, program_key: str) -> None:
        """``program_key``'s task ended between two steps (cancelled, past its deadline, refused): its parked KV,
        its DRAM copy and its tool-wait plan are released now."""

    def shutdown(self) -> None:
        """Release what the scheduler holds outside the process (NVML); the loop calls it once, at its end."""

    @property
    def preempting(self) -> list[Request]:
        """Requests preempted during the step in flight: out of the running set, their KV held until it ends."""

    @property
    def core_waiting(self) -> bool:
        """A core request waits for admission (the step loop ends its decode slice at the next step)."""

    @property
    def core_pending(self) -> bool:
        """A core request is buffered or waits for admission."""

    @property
    def next_deadline(self) -> float:
        """The earliest own deadline among the requests held, monotonic seconds (inf: none); may be earlier than
        the true one, never later (the loop waits no longer than it)."""

    intake: DoubleBuffer[Request]
    """The double buffer (the loops read ``closed``, the drain flag, and ``active_size``, requests buffered)."""

    tiers: "MemoryTiers"
    """The memory tiers the scheduler moves KV between; the step loop runs their transfers and scans, either loop closes them."""

    monitor: "ComputeScoreMonitor"
    """The compute-score source (the loop makes the ``switchyard_compute_score`` gauge re-sample it at scrape
    time)."""

    capacity: "Capacity"
    """The running set's limit (a stream engine's: a ``ConcurrencyCapacity`` over the upstream's limit)."""

    preemption_enabled: bool
    """Whether core work may preempt running work (``scheduler.preemption_enabled``; never on a stream engine)."""
