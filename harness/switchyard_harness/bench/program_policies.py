"""Scheduling policies for agent programs, compared on one workload: ``switchyard bench agents --policies``.

Every policy runs on the dispatcher's real scheduler: the same
:class:`~switchyard.dispatcher.scheduler.core.SchedulerCore` (double buffer,
admission, KV budget, parking of tool-waiting agents, preemption where the
policy has it), the same memory tiers (:class:`~switchyard.dispatcher.tiers.MemoryTiers`,
a real Redis as the DRAM tier: ``--dram``) and the same engine model (the sim
latency model on a simulated clock: :class:`AgentSimEngine`, the step loop of
``bench sched``: :func:`~switchyard_harness.bench.sched_bench.schedule_turn`,
:func:`~switchyard_harness.bench.sched_bench.run_slice`). The loop carries out the
scheduler's planned restores of swapped agents' KV as the dispatcher's step loop
does (:class:`~switchyard_harness.bench.sched_bench.BackgroundPrefetches`: handed
over by ``schedule`` and ``on_idle``, the wait bounded by
``SchedulerCore.until_prefetch``, the copy's transfer time spent in the background
on the simulated clock, then ``SchedulerCore.prefetched``). Only the waiting
order, the core class it plugs into, and what the orchestrator tells the
dispatcher differ:

- ``fcfs``: :class:`~switchyard.dispatcher.scheduler.fifo.FifoScheduler`
  (:class:`~switchyard.dispatcher.scheduler.request_queue.FcfsQueue`: per-request
  arrival order, vLLM's default; no classes, no preemption).
- ``priority``: :class:`~switchyard.dispatcher.scheduler.priority.PriorityScheduler`
  (:class:`~switchyard.dispatcher.scheduler.request_queue.PriorityAgingQueue`:
  per-request priority classes with aging, vLLM's priority policy generalised;
  compute-score admission, core preemption).
- ``llmd-las``: PriorityScheduler with :class:`SessionServiceQueue`: priority
  bands, and inside a band least attained service per agent session (llm-d
  inference scheduler's per-session fairness plugin), the service decayed with
  ``scheduler.fairness_half_life_s``.
- ``autellix-plas``: FifoScheduler with :class:`SessionServiceQueue` without
  classes and without decay: program-level least attained service (Autellix,
  Luo et al. 2025).
- ``continuum``: FifoScheduler with :class:`ProgramArrivalQueue`: program-level
  FCFS (by the task's start). Its KV time-to-live during tool calls is the
  core's parking, ``scheduler.tool_wait_ttl_s`` for every tool (Continuum, Li
  et al. 2025, pins the KV for its TTL; the core's parking lets a waiting
  request evict it for room, as every policy here does).
- ``switchyard``: :class:`~switchyard.dispatcher.scheduler.fair.FairScheduler`,
  the ``fair`` policy as shipped (its :class:`~switchyard.dispatcher.scheduler.fair.FairQueue`
  order: classes, least slack first for work at risk, tenant then session
  attained service; refusal of work that cannot make its deadline). The
  orchestrator's side is the orchestrator's own code
  (:class:`switchyard.orchestrator.program.Program`): each step carries the
  task's time left and :meth:`~switchyard.orchestrator.program.Program.remaining_after`,
  and at each tool start the dispatcher is told the tool's expected wait
  (:meth:`~switchyard.orchestrator.program.ToolDurations.expected_s`, measured
  from the calls that have returned) and decides at once
  (:meth:`SchedulerCore.tool_wait`:
  :func:`switchyard.dispatcher.scheduler.tool_wait.decide`).

The anchors' tool waits all use the core's parking with the fixed
``scheduler.tool_wait_ttl_s`` (the KV kept that long, evicted earlier only for
room). The anchors' orderings are not Switchyard's product: their keys
(:class:`SessionServiceQueue`, :class:`ProgramArrivalQueue`) live here, on the
scheduler's :class:`~switchyard.dispatcher.scheduler.request_queue.RequestQueue`
contract and the :class:`~switchyard.dispatcher.scheduler.fairness.FairnessLedger`,
charged from what each engine step computed (as the fair policy charges its own).

The workload (the field's locust mix, with tenants): ``--tenants`` tenants
(10); all but the last run ``--tenant-agents`` react agents each (10) whose
tools take ~0.3 / 1.5 / 4 s (search, code, browse; lognormal, sigma 0.4), the
last (the noisy tenant) runs ``--noisy-agents`` agents (100) whose one tool is
a ~15 s batch job; ``--load-scale`` multiplies every tenant's agents (1: the
issue's 10 tenants, one of them with 100 long-tool agents). Each agent runs
tasks one after another (a gap of 0.5-2 s between); a task's class is drawn
from ``--mix``, it opens with ``--prompt-tokens``, makes ``--tool-calls`` calls
(``--call-tokens`` each, ``--result-tokens`` back), then answers
(``--answer-tokens``); core tasks have ``core_deadline_s`` (30 s), normal ones
``normal_deadline_s`` (120 s), batch none.

Reported per policy: task completion P50/P95 (all and per class), throughput
(tasks and generated tokens per second of the run), CORE SLO attainment (core
steps whose TTFT is within ``slo.ttft.threshold_s``), Jain's fairness index of
normalized progress (the task's isolated time, its tools plus its steps alone on
the engine, / its completion time) across tenants and across agents, tool
resumes (warm in HBM, restored from DRAM, recomputed) and recomputed prefix
tokens, HBM held by parked agents during tool waits (GB x s), deadline misses
(served late) and early refusals, the tool-wait decisions (switchyard), the planned
restores started and landed, the tool returns against them as the scheduler counts
them (early, on time, late) and the swapped agents' resumes (warm, restored,
recomputed).

:func:`capacity_scale` finds the load FCFS can hold: the smallest load scale of a
sweep at which FCFS's throughput reaches 95 % of the sweep's peak (past it,
more agents only queue).
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from switchyard.common.config import DramTierConfig, SwitchyardConfig
from switchyard.common.priority import PriorityClass
from switchyard.common.tenant import agent_key
from switchyard.dispatcher.double_buffer import FlushReason
from switchyard.dispatcher.engines.base import SeqOutput, StepBatch, StepResult
from switchyard.dispatcher.engines.sim import decode_seconds, prefill_seconds
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.scheduler.base import REACT_TASK_TYPE
from switchyard.dispatcher.scheduler.core import SchedulerCore
from switchyard.dispatcher.scheduler.fair import charge_service
from switchyard.dispatcher.scheduler.fairness import FairnessLedger
from switchyard.dispatcher.scheduler.request_queue import OrderKey, RequestQueue
from switchyard.dispatcher.scheduler.slack import CannotMeetDeadline
from switchyard.dispatcher.scheduler.tool_wait import PREFETCH_TIMINGS, Decision
from switchyard.dispatcher.tiers import MemoryTiers
from switchyard.orchestrator.program import Program
from switchyard_harness.bench.sched_bench import (
    BackgroundPrefetches,
    VirtualSimEngine,
    kv_store,
    quiet_score_log,
    run_slice,
    schedule_turn,
)
from switchyard_harness.bench.report import percentile
from switchyard_harness.testing.step_plan import StepPlan

POLICY_NAMES = ("fcfs", "priority", "llmd-las", "autellix-plas", "continuum", "switchyard")
"""Every policy ``--policies`` accepts, in the order the table prints them."""

UNDECIDED = "undecided"
"""An announced tool wait that found no parked step of its agent (its KV had left HBM already, or its
step had not parked): the dispatcher decided nothing (``TOOL_WAIT_DECISION_UNSPECIFIED``)."""

LOST = "lost"
"""An announced tool wait that got no answer by its deadline (a real dispatcher's only): as the orchestrator's,
its KV stays parked under the parking's rules."""

SIMULATED_CLOCK = "simulated clock"
"""How :class:`PolicyRun` drives the scheduler (the table's heading)."""

TOOLS: dict[str, float] = {"search": 0.3, "code": 1.5, "browse": 4.0}
"""The quiet tenants' tools: median duration, seconds."""
NOISY_TOOL = ("batch_job", 15.0)
"""The noisy tenant's one tool and its median duration, seconds."""
TOOL_SIGMA = 0.4
"""Log-space spread of every tool's duration (lognormal)."""
MAX_TOKENS = 512
"""max_tokens of every step."""
IDLE_STEP_S = 0.25
"""Longest clock jump while the engine is idle (parking's TTL expiry is seen within this)."""
CLASSES = tuple(PriorityClass)


# --------------------------------------------------------------------------- the engine


class AgentSimEngine(VirtualSimEngine):
    """The sim latency model where each step ends as planned: a tool call, or the answer.

    ``on_step(batch, result)``, when set, is called after every step with what it computed (the policy
    bench charges attained service and integrates held memory there).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plans: dict[Request, StepPlan] = {}
        """Request -> its planned reply (the stack's engines read the same plan from the prompt)."""
        self.generated = 0
        self.largest_batch = 0
        self.on_step: Callable[[StepBatch, StepResult], None] | None = None

    async def execute_model(self, batch: StepBatch) -> StepResult:
        if not batch.prefill:
            self.largest_batch = max(self.largest_batch, len(batch.decode))
        result = await super().execute_model(batch)
        if self.on_step is not None:
            self.on_step(batch, result)
        return result

    def next_token(self, req: Request) -> SeqOutput:
        """The next token; end-of-sequence once the plan's tokens are out (with a tool call when the plan
        ends in one). ``max_tokens`` is the scheduler's stop check."""
        out = super().next_token(req)
        self.generated += 1
        plan = self.plans.get(req)
        if plan is not None and len(req.output_tokens) + 1 >= plan.tokens:
            out.eos = True
            out.tool_calls = plan.tool_calls(f"call-{req.request_id}")
            del self.plans[req]
        return out


# --------------------------------------------------------------------------- the anchors' orders


class SessionServiceQueue(RequestQueue):
    """Least attained service per agent session first (``order_key = ([class,] service, arrival)``).

    With ``by_class`` (llm-d's per-session fairness plugin inside its priority bands) the class comes first;
    without it and with a ledger without decay it is Autellix's program-level least attained service.

    Args:
        ledger: the attained service (charged by the caller from each engine step).
        by_class: order by priority class first.
    """

    name = "session-las"

    def __init__(self, ledger: FairnessLedger, by_class: bool) -> None:
        super().__init__()
        self.ledger = ledger
        self.by_class = by_class

    def order_key(self, req: Request, now: float) -> OrderKey:
        service = self.ledger.sessions.service(req.agent_key, now)
        if self.by_class:
            return (float(req.priority), service, req.arrival)
        return (service, req.arrival)


class ProgramArrivalQueue(RequestQueue):
    """Program-level FCFS: ``order_key = (the task's start, arrival)`` (Continuum's order).

    Args:
        task_start: the start time of the task a request belongs to (seconds, the run's clock).
    """

    name = "program-fcfs"

    def __init__(self, task_start: Callable[[Request], float]) -> None:
        super().__init__()
        self.task_start = task_start

    def order_key(self, req: Request, now: float) -> OrderKey:
        return (self.task_start(req), req.arrival)


@dataclass(frozen=True)
class PolicySpec:
    """How one policy is built on the real scheduler.

    ``scheduler``: the core's policy name (:data:`switchyard.dispatcher.scheduler.POLICIES`); ``queue``:
    the anchor's waiting order (None: the scheduler's own); ``hints``: the orchestrator's program hints are
    sent (time left, expected remaining work, the tool-wait announcement at each tool start).
    """

    scheduler: str
    queue: str | None = None
    hints: bool = False
    undecayed: bool = False


POLICIES: dict[str, PolicySpec] = {
    "fcfs": PolicySpec("fifo"),
    "priority": PolicySpec("priority"),
    "llmd-las": PolicySpec("priority", queue="session-by-class"),
    "autellix-plas": PolicySpec("fifo", queue="session", undecayed=True),
    "continuum": PolicySpec("fifo", queue="program-fcfs"),
    "switchyard": PolicySpec("fair", hints=True),
}


# --------------------------------------------------------------------------- workload and results


@dataclass
class Workload:
    """The workload's shape (see the module docstring)."""

    tenant_agents: int = 10
    noisy_agents: int = 100
    tenants: int = 10
    mix: tuple[float, float, float] = (20.0, 50.0, 30.0)
    prompt_tokens: tuple[int, int] = (1000, 3000)
    tool_calls: tuple[int, int] = (2, 4)
    call_tokens: tuple[int, int] = (20, 60)
    result_tokens: tuple[int, int] = (100, 400)
    answer_tokens: tuple[int, int] = (64, 512)
    gap_s: tuple[float, float] = (0.5, 2.0)
    core_deadline_s: float = 30.0
    normal_deadline_s: float = 120.0
    seconds: float = 60.0
    drain_limit: float = 3.0
    seed: int = 11
    load_scale: float = 1.0
    tool_time_scale: float = 1.0
    """Multiplies every tool's drawn duration (1: the stated distribution)."""

    def __post_init__(self) -> None:
        if not self.tool_time_scale > 0:
            raise ValueError(f"tool_time_scale: expected a number > 0, got {self.tool_time_scale!r}")

    def scaled(self, load_scale: float) -> "Workload":
        """The same workload with ``load_scale``."""
        return Workload(**{**self.__dict__, "load_scale": load_scale})

    @property
    def quiet_per_tenant(self) -> int:
        return max(1, round(self.tenant_agents * self.load_scale))

    @property
    def noisy(self) -> int:
        return max(1, round(self.noisy_agents * self.load_scale))


@dataclass(eq=False)
class Agent:
    """One agent and its current task."""

    name: str
    tenant: str
    rng: random.Random
    noisy: bool
    cls: PriorityClass = PriorityClass.NORMAL
    context: int = 0
    calls_left: int = 0
    steps_done: int = 0
    task_started: float = 0.0
    deadline: float = math.inf
    isolated_s: float = 0.0
    """The task's time alone: its tools, and its steps on an idle engine."""
    next_at: float = 0.0
    resume: bool = False
    busy: bool = False
    in_task: bool = False
    tool: str = ""
    tool_started: float = 0.0
    tool_s: float = 0.0
    decision: str = ""
    """The scheduler's tool-wait decision for the current tool ("" when none was announced)."""


@dataclass
class PolicyResult:
    """What one policy's run measured."""

    policy: str
    completion: dict[int, list[float]] = field(default_factory=lambda: {cls.value: [] for cls in PriorityClass})
    isolated: list[float] = field(default_factory=list)
    """Each completed task's isolated time (its tools, and its steps alone on the engine), seconds."""
    slowdown: list[float] = field(default_factory=list)
    """Each completed task's completion time / its isolated time."""
    window_tokens: int = 0
    """Tokens generated inside the load window (the first ``seconds``): the throughput while load is offered."""
    window_s: float = 0.0
    tenant_completion: dict[str, list[float]] = field(default_factory=dict)
    core_ttft: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tenant_progress: dict[str, list[float]] = field(default_factory=dict)
    agent_progress: dict[str, list[float]] = field(default_factory=dict)
    resumes: dict[str, int] = field(default_factory=lambda: {"warm": 0, "restored": 0, "recomputed": 0})
    recomputed_tokens: int | None = 0
    idle_byte_s: float | None = 0.0
    """Parked KV bytes x seconds (HBM held idle). This and ``recomputed_tokens``: None where not measured (an
    upstream's stream engine: its KV is not seen here)."""
    generated: int = 0
    missed_deadline: int = 0
    refused_early: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: {**{d.value: 0 for d in Decision}, UNDECIDED: 0,
                                                                LOST: 0})
    """The announced tool waits by the dispatcher's answer: keep, swap, drop, :data:`UNDECIDED`, or
    :data:`LOST` (no answer)."""
    makespan: float = 0.0
    unfinished: int = 0
    preemptions: int = 0
    busy_s: float = 0.0
    """Engine seconds of steps."""
    stall_s: float | None = 0.0
    """Seconds the step loop waited for restores from DRAM (owed transfer time); None where not measured
    (the real stack: its engine's restores sleep inside the step)."""
    slo_s: float = 1.0
    """The TTFT objective's threshold (``slo.ttft.threshold_s``)."""
    scheduler_decisions: dict[str, int] = field(default_factory=dict)
    """The tool-wait decisions the scheduler itself counted (``switchyard_tool_wait_decisions_total``)."""
    swapped_resumes: dict[str, int] = field(default_factory=lambda: {"warm": 0, "restored": 0, "recomputed": 0})
    """The resumes of agents whose tool wait was decided SWAP: warm (restored ahead, in HBM at the turn),
    restored at admission, recomputed."""
    prefetch_returns: dict[str, int] = field(default_factory=lambda: {k: 0 for k in PREFETCH_TIMINGS})
    """The swapped agents' tool returns against their planned restore, as the scheduler counted them
    (``switchyard_tool_wait_prefetches_total``: early, before the KV was back; on_time; late)."""
    prefetches_started: int = 0
    """Planned restores the scheduler handed over and the bench's loop started (in the background)."""
    prefetches_landed: int = 0
    """Of those, the ones that landed: the agent's step parked again, warm, before its turn."""
    scheduler: str = ""
    queue: str = ""
    """The core class and its waiting queue class that ran (what the tests check is the shipped code)."""


def jain(values: list[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n sum x^2) over every value, a zero included: 1 when all equal, 1/n
    when one has all (Jain et al. 1984); 0 when none has any (or there are none)."""
    squares = sum(v * v for v in values)
    if squares <= 0:
        return 0.0
    return sum(values) ** 2 / (len(values) * squares)


# --------------------------------------------------------------------------- one run


def anchor_queue(spec: PolicySpec, config: SwitchyardConfig, task_start: Callable[[Request], float],
                 ) -> tuple[RequestQueue | None, FairnessLedger | None]:
    """The anchor's waiting order of ``spec`` and the ledger its caller charges: (None, None) for a policy
    that orders by its scheduler's own queue. ``task_start(req)``: when the request's task started (the
    program FCFS order's key)."""
    if spec.queue in ("session", "session-by-class"):
        ledger = FairnessLedger(math.inf if spec.undecayed else config.scheduler.fairness_half_life_s)
        return SessionServiceQueue(ledger, by_class=spec.queue == "session-by-class"), ledger
    if spec.queue == "program-fcfs":
        return ProgramArrivalQueue(task_start), None
    return None, None


def build_scheduler(policy: str, config: SwitchyardConfig, engine: AgentSimEngine, tiers: MemoryTiers,
                    task_start: Callable[[Request], float]) -> tuple[SchedulerCore, FairnessLedger | None]:
    """The real scheduler of ``policy`` (:data:`POLICIES`) on ``engine``: (scheduler, the anchor's ledger to
    charge, None when the scheduler charges its own or orders by none).

    Raises:
        ValueError: unknown ``policy``.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {list(POLICY_NAMES)}, got {policy!r}")
    spec = POLICIES[policy]
    queue, ledger = anchor_queue(spec, config, task_start)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=False)
    sched = make_scheduler(config, engine, policy=spec.scheduler, monitor=monitor, tiers=tiers, queue=queue)
    return sched, ledger


BACKGROUND_IO_TIMEOUT_S = 10.0
"""Longest wall-clock wait for the tiers' background Redis calls at one turn (a stuck Redis fails them)."""


async def finish_background_io() -> None:
    """Let the tiers' background Redis calls (a swap-out's write, a copy's delete) finish before the
    simulated clock moves on.

    On the simulated clock the step loop never yields to the event loop, so without this those calls
    pile up while the run goes on, and how many a later restore finds written (or how many the Redis
    client refuses: too many connections) would depend on the machine's speed. The copy's modelled
    time is the clock's business (:mod:`switchyard.dispatcher.tiers`); Redis's wall time is not.
    """
    me = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not me and not task.done()]
    if pending:
        await asyncio.wait(pending, timeout=BACKGROUND_IO_TIMEOUT_S)


class PolicyRun:
    """One policy's run of the workload on the real scheduler (see the module docstring)."""

    def __init__(self, policy: str, workload: Workload, config: SwitchyardConfig,
                 dram: DramTierConfig | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {list(POLICY_NAMES)}, got {policy!r}")
        self.policy = policy
        self.spec = POLICIES[policy]
        self.w = workload
        # Every step is accepted (the benchmark measures scheduling, not the queue's bound).
        self.config = config.with_overrides(**{"queues.inference.capacity": 1_000_000,
                                               "queues.inference.timeout_ms": 3_600_000})
        # Redis's wall time is not the simulated clock's: a machine busy elsewhere must not fail a call.
        self.dram = dram.model_copy(update={"op_timeout_s": BACKGROUND_IO_TIMEOUT_S,
                                            "connect_timeout_s": BACKGROUND_IO_TIMEOUT_S}) if dram else None
        self.sim = self.config.sim
        self.result = PolicyResult(policy, slo_s=self.config.slo.ttft.threshold_s)
        self.agents = self._agents()
        self._by_name = {a.name: a for a in self.agents}
        for agent in self.agents:  # Jain's index is over every tenant and agent, one that completes nothing too
            self.result.tenant_progress.setdefault(agent.tenant, [])
            self.result.agent_progress.setdefault(agent.name, [])
        tools = [*TOOLS, NOISY_TOOL[0]]
        self.program = Program(self.config.orchestrator.program, tools, max(self.w.tool_calls[1], 1))
        """The orchestrator's measurements (tool durations, step times) and its remaining-work rule."""
        self.sched: SchedulerCore | None = None
        """The scheduler the run drove (set by :meth:`run`)."""
        self.ledger: FairnessLedger | None = None
        """The anchor's attained-service ledger the run charged (None for the others)."""
        self.prefetches: BackgroundPrefetches | None = None
        """The planned restores the run's loop carried out (set by :meth:`run`)."""

    # ------------------------------------------------------------------ workload

    def _agents(self) -> list[Agent]:
        master = random.Random(self.w.seed)
        agents = []
        for tenant in range(self.w.tenants):
            is_noisy = tenant == self.w.tenants - 1
            for i in range(self.w.noisy if is_noisy else self.w.quiet_per_tenant):
                agents.append(Agent(f"t{tenant}-a{i}", f"tenant-{tenant}", random.Random(master.random()), is_noisy))
        for agent in agents:
            self._new_task(agent, agent.rng.uniform(0, 2.0))
        return agents

    def _new_task(self, agent: Agent, at: float) -> None:
        rng = agent.rng
        agent.cls = rng.choices(CLASSES, weights=self.w.mix)[0]
        agent.context = rng.randint(*self.w.prompt_tokens)
        agent.calls_left = rng.randint(*self.w.tool_calls)
        agent.steps_done = 0
        agent.task_started = agent.next_at = at
        agent.isolated_s = 0.0
        limit = {PriorityClass.CORE: self.w.core_deadline_s, PriorityClass.NORMAL: self.w.normal_deadline_s}
        agent.deadline = at + limit.get(agent.cls, math.inf)
        agent.resume = False
        agent.in_task = False

    def _due(self, agent: Agent) -> bool:
        return not agent.busy and (agent.in_task or agent.next_at < self.w.seconds)

    def _end_task(self, agent: Agent, t: float, refused: bool = False) -> None:
        if not refused:
            took = t - agent.task_started
            self.result.completion[int(agent.cls)].append(took)
            self.result.isolated.append(agent.isolated_s)
            self.result.slowdown.append(took / agent.isolated_s if agent.isolated_s > 0 else 1.0)
            self.result.tenant_completion.setdefault(agent.tenant, []).append(took)
            progress = min(1.0, agent.isolated_s / took) if took > 0 else 1.0
            self.result.tenant_progress.setdefault(agent.tenant, []).append(progress)
            self.result.agent_progress.setdefault(agent.name, []).append(progress)
            if t > agent.deadline:
                self.result.missed_deadline += 1
            self.program.steps.observe_turns(agent.steps_done)
        self._new_task(agent, t + agent.rng.uniform(*self.w.gap_s))

    # ------------------------------------------------------------------ one agent's steps (both clocks)

    def _next_step(self, agent: Agent) -> tuple[int, str]:
        """The agent's next model step: its planned output tokens and how it ends (``tool_calls``, or
        ``stop`` for the task's answer); its time alone is added to the task's."""
        last = agent.calls_left == 0
        length = min(MAX_TOKENS, agent.rng.randint(*(self.w.answer_tokens if last else self.w.call_tokens)))
        agent.isolated_s += prefill_seconds(self.sim, agent.context) + length * decode_seconds(self.sim, 1)
        return length, "stop" if last else "tool_calls"

    @staticmethod
    def _request_id(agent: Agent) -> str:
        return f"{agent.name}-{agent.task_started:.3f}-{agent.steps_done}"

    def _hints(self, agent: Agent, now: float) -> tuple[float, float] | None:
        """The step's ``(task_time_left_s, expected_remaining_work_s)`` as the orchestrator sends them (its
        Program's rule), or None when this policy sends none or the task has no deadline. A step that starts
        past its task's deadline is sent 1 ms left (0 would read as "not given"): the dispatcher refuses it."""
        if not self.spec.hints or not math.isfinite(agent.deadline):
            return None
        return max(1e-3, agent.deadline - now), self.program.remaining_after(REACT_TASK_TYPE, agent.steps_done)

    def _tool_call(self, agent: Agent, output_tokens: int) -> tuple[str, float]:
        """The step ended in a tool call after ``output_tokens``: the conversation grows by them and the tool's
        result; returns the tool drawn and its duration (seconds; added to the task's time alone)."""
        agent.calls_left -= 1
        agent.context += output_tokens + agent.rng.randint(*self.w.result_tokens)
        tool, median = NOISY_TOOL if agent.noisy else agent.rng.choice(list(TOOLS.items()))
        seconds = median * math.exp(agent.rng.gauss(0, TOOL_SIGMA)) * self.w.tool_time_scale
        agent.isolated_s += seconds
        agent.resume = True
        return tool, seconds

    def _count_resume(self, decision: str, recomputed: int, restored: int) -> None:
        """A tool-return step found its prefix warm in HBM, restored from a tier, or recomputed."""
        kind = "recomputed" if recomputed else "restored" if restored else "warm"
        self.result.resumes[kind] += 1
        if decision == Decision.SWAP.value:
            self.result.swapped_resumes[kind] += 1

    # ------------------------------------------------------------------ the run

    def run(self) -> PolicyResult:
        """Run the workload; returns what was measured."""
        with quiet_score_log():
            return asyncio.run(self._run())

    async def _run(self) -> PolicyResult:
        engine = AgentSimEngine(self.sim)
        tiers = MemoryTiers(self.config.memory, self.config.scheduler.priority_boost, engine.kv, kv_store(self.dram))
        sched, ledger = build_scheduler(self.policy, self.config, engine, tiers,
                                        lambda req: self._by_name[req.agent_id].task_started)
        self.sched, self.ledger = sched, ledger
        self.result.scheduler = type(sched).__name__
        self.result.queue = type(sched.queue).__name__
        result = self.result
        in_flight: dict[Request, Agent] = {}
        seen_first: set[Request] = set()
        slice_s = self.config.scheduler.time_slice_ms / 1000
        limit = self.w.seconds * self.w.drain_limit
        clock = {"t": 0.0}

        result.window_s = self.w.seconds

        def on_step(batch: StepBatch, step: StepResult) -> None:
            result.idle_byte_s += sched.parked_kv_bytes * step.seconds
            if clock["t"] < self.w.seconds:
                result.window_tokens += len(batch.prefill) + len(batch.decode)  # one token each
            if ledger is not None:  # the anchor's attained service, as the fair policy charges its own
                charge_service(ledger, batch, step, clock["t"])

        engine.on_step = on_step

        def arrive(t: float) -> None:
            for agent in self.agents:
                if agent.next_at > t or not self._due(agent):
                    continue
                if agent.tool:  # the tool returned at next_at: the orchestrator measures it
                    self.program.tools.observe(agent.tool, agent.tool_s)
                    self.program.steps.observe(REACT_TASK_TYPE, "tool", agent.tool_s)
                    agent.tool = ""
                agent.in_task = True
                length, ending = self._next_step(agent)
                req = Request(
                    request_id=self._request_id(agent), agent_id=agent.name,
                    task_type=REACT_TASK_TYPE, priority=agent.cls, prompt_tokens=agent.context,
                    max_tokens=MAX_TOKENS, arrival=agent.next_at, tenant_id=agent.tenant,
                )
                if (hints := self._hints(agent, agent.next_at)) is not None:
                    req.task_time_left_s, req.expected_remaining_work_s = hints
                engine.plans[req] = StepPlan(length, ending, agent.task_started)
                try:
                    if agent.resume:
                        sched.resume(req, t)
                    else:
                        sched.add_request(req, t)
                        sched.flush(FlushReason.STEP, t)
                except CannotMeetDeadline:  # refused early, by name: the task ends here
                    engine.plans.pop(req, None)
                    result.refused_early += 1
                    self._end_task(agent, t, refused=True)
                    continue
                agent.busy = True
                in_flight[req] = agent

        def settle(running: list[Request], t: float) -> bool:
            ended = False
            for req in running:
                agent = in_flight.get(req)
                if agent is None:
                    continue
                if req.output_tokens and req not in seen_first:
                    seen_first.add(req)
                    result.ttft.append(t - req.arrival)
                    if agent.cls is PriorityClass.CORE:
                        result.core_ttft.append(t - req.arrival)
                if not req.is_finished:
                    continue
                ended = True
                del in_flight[req]
                seen_first.discard(req)
                agent.busy = False
                result.generated += len(req.output_tokens)
                result.recomputed_tokens += req.recomputed_tokens
                result.preemptions += req.preemptions
                if agent.steps_done > 0:  # a tool-return step
                    self._count_resume(agent.decision, req.recomputed_tokens, req.restored_tokens)
                    agent.decision = ""
                agent.steps_done += 1
                self.program.steps.observe(REACT_TASK_TYPE, "model", t - req.arrival)
                if req.finish_reason == "tool_calls":
                    tool, agent.tool_s = self._tool_call(agent, len(req.output_tokens))
                    agent.tool, agent.tool_started = tool, t
                    agent.next_at = t + agent.tool_s
                    if self.spec.hints:  # the orchestrator announces the tool wait at its start
                        decided = sched.tool_wait(agent_key(agent.tenant, agent.name), self.program.tools.expected_s(tool), t,
                                                  tool=tool)
                        result.decisions[decided.decision.value if decided is not None else UNDECIDED] += 1
                        if decided is not None:
                            agent.decision = decided.decision.value
                elif req.finish_reason in ("stop", "length"):
                    self._end_task(agent, t)
                else:
                    raise RuntimeError(f"step {req.request_id} ended {req.finish_reason!r}: {req.error!r}")
            return ended

        def next_arrival() -> float:
            return min((a.next_at for a in self.agents if self._due(a)), default=math.inf)

        prefetches = BackgroundPrefetches(sched, tiers)
        self.prefetches = prefetches
        t = 0.0
        while t < limit:
            clock["t"] = t
            # The restores whose copy ended before the returning tools' turns arrive land first; the
            # turns take the prefix over warm. A copy ending after a turn arrived is left for that turn.
            prefetches.land(min(t, next_arrival()), t)
            arrive(t)
            prefetches.land(t, t)
            if not sched.has_work:
                nxt = next_arrival()
                if not math.isfinite(nxt) and not sched.parked:
                    break
                step = min(nxt, t + IDLE_STEP_S) if math.isfinite(nxt) else t + IDLE_STEP_S
                # as the step loop waits while idle: woken by the next planned restore that is due
                step = min(step, t + sched.until_prefetch(step - t, t), prefetches.next_landing)
                result.idle_byte_s += sched.parked_kv_bytes * (max(t, step) - t)
                t = max(t, step)
                prefetches.land(t, t)
                await prefetches.start(sched.on_idle(t), t)
                if not math.isfinite(nxt) and not sched.parked:
                    break
                continue
            parked = sched.parked_kv_bytes
            await finish_background_io()
            t2, running, owed = await schedule_turn(sched, tiers, t, prefetches)
            result.idle_byte_s += parked * owed
            result.stall_s += owed
            t = t2
            clock["t"] = t
            if not running:
                # Work waits but none fits: the step loop waits a slice, or until a planned restore is due.
                wait = sched.until_prefetch(slice_s, t)
                result.idle_byte_s += sched.parked_kv_bytes * wait
                t += wait
                continue
            t = await run_slice(sched, engine, running, t, slice_s, settle, interrupt=lambda now: now >= next_arrival())
        result.makespan = t
        result.busy_s = engine.busy_seconds
        result.scheduler_decisions = {d.value: int(sched.counters.tool_wait_decisions[d.value]) for d in Decision}
        for (_, timing), n in sched.counters.tool_prefetches.items():
            result.prefetch_returns[timing] += int(n)
        result.prefetches_started, result.prefetches_landed = prefetches.started, prefetches.landed
        result.unfinished = sum(1 for a in self.agents if a.in_task)
        sched.shutdown()
        await tiers.aclose()
        return result


# --------------------------------------------------------------------------- report


def summarize(result: PolicyResult) -> dict[str, Any]:
    """One policy's row."""
    every = [v for values in result.completion.values() for v in values]
    resumes = sum(result.resumes.values())
    core = result.core_ttft
    tenants = [sum(v) / len(v) if v else 0.0 for v in result.tenant_progress.values()]  # none completed: 0
    agents = [sum(v) / len(v) if v else 0.0 for v in result.agent_progress.values()]
    return {
        "policy": result.policy,
        "scheduler": result.scheduler,
        "queue": result.queue,
        "tasks_completed": len(every),
        "task_completion_p50_s": round(percentile(every, 50), 3),
        "task_completion_p95_s": round(percentile(every, 95), 3),
        "per_class_p95_s": {cls.label: round(percentile(result.completion[cls.value], 95), 3)
                            for cls in PriorityClass},
        "isolated_p95_s": round(percentile(result.isolated, 95), 3),
        "per_tenant_p95_s": {tenant: round(percentile(v, 95), 3) for tenant, v in sorted(result.tenant_completion.items())},
        "ttft_p50_s": round(percentile(result.ttft, 50), 4),
        "ttft_p95_s": round(percentile(result.ttft, 95), 4),
        "throughput_tasks_per_s": round(len(every) / result.makespan, 3) if result.makespan else 0.0,
        "generated_tokens": result.generated,
        "throughput_tokens_per_s": round(result.window_tokens / result.window_s, 1) if result.window_s else 0.0,
        "slowdown_p95": round(percentile(result.slowdown, 95), 3),
        "core_slo_attainment": round(sum(1 for v in core if v <= result.slo_s) / len(core), 4) if core else None,
        "jain_tenants": round(jain(tenants), 4),
        "jain_agents": round(jain(agents), 4),
        "warm_resumes": round(result.resumes["warm"] / resumes, 4) if resumes else None,
        "resumes": dict(result.resumes),
        "recomputed_tokens": result.recomputed_tokens,
        "preemptions": result.preemptions,
        "engine_busy_s": round(result.busy_s, 2),
        "restore_stall_s": None if result.stall_s is None else round(result.stall_s, 2),
        "hbm_idle_gb_s": None if result.idle_byte_s is None else round(result.idle_byte_s / 1e9, 1),
        "missed_deadline": result.missed_deadline,
        "refused_early": result.refused_early,
        "tool_wait_decisions": dict(result.decisions),
        "swapped_resumes": dict(result.swapped_resumes),
        "prefetch_returns": dict(result.prefetch_returns),
        "prefetches_started": result.prefetches_started,
        "prefetches_landed": result.prefetches_landed,
        "makespan_s": round(result.makespan, 2),
        "unfinished_tasks": result.unfinished,
    }


def run_policies(policies: list[str], workload: Workload, config: SwitchyardConfig,
                 dram: DramTierConfig | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Run ``workload`` under each policy; one summary row each."""
    rows = []
    for policy in policies:
        rows.append(summarize(PolicyRun(policy, workload, config, dram).run()))
        progress(policy)
    return rows


SWEEP_SCALES = (0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.25, 1.5)
"""Load scales :func:`capacity_scale` tries."""


def capacity_scale(workload: Workload, config: SwitchyardConfig, dram: DramTierConfig | None = None,
                   scales: tuple[float, ...] = SWEEP_SCALES) -> tuple[float, list[dict[str, Any]]]:
    """The load FCFS can hold: the scale of ``scales`` at which FCFS's throughput (tokens generated per
    second of the load window) peaks, the smallest such. Past it more agents give FCFS no more throughput,
    only longer queues (its KV is full: parked and running prefixes evict each other).

    Returns (that scale, the sweep: per scale FCFS's throughput, step TTFT P50/P95, CORE SLO attainment).
    """
    sweep = []
    for scale in scales:
        row = summarize(PolicyRun("fcfs", workload.scaled(scale), config, dram).run())
        sweep.append({"load_scale": scale, "throughput_tokens_per_s": row["throughput_tokens_per_s"],
                      "ttft_p50_s": row["ttft_p50_s"], "ttft_p95_s": row["ttft_p95_s"],
                      "core_slo_attainment": row["core_slo_attainment"]})
    peak = max(s["throughput_tokens_per_s"] for s in sweep)
    held = next(s["load_scale"] for s in sweep if s["throughput_tokens_per_s"] == peak)
    return held, sweep


def _figure(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``; "-" where it was not measured (None), not a 0 that reads as measured."""
    return "-" if value is None else format(value, spec)


def render(rows: list[dict[str, Any]], workload: Workload, config: SwitchyardConfig, *,
           at_double: list[dict[str, Any]] | None = None, held: float | None = None,
           sweep: list[dict[str, Any]] | None = None, clock: str = SIMULATED_CLOCK) -> str:
    """The printed table, with the issue's ratios (ours / FCFS, ours / the best anchor). ``clock``: how the
    run was driven (default :data:`SIMULATED_CLOCK`)."""
    w = workload
    lines = [
        "switchyard agent-program policies: the real scheduler (SchedulerCore) per policy, sim latency model, "
        + clock,
        f"{w.tenants} tenants: {w.tenants - 1} x {w.quiet_per_tenant} agents "
        f"(tools {', '.join(f'{k} ~{v:g} s' for k, v in TOOLS.items())}), 1 x {w.noisy} agents "
        f"({NOISY_TOOL[0]} ~{NOISY_TOOL[1]:g} s)"
        + (f", every tool x {w.tool_time_scale:g}" if w.tool_time_scale != 1 else "")
        + f" (load scale {w.load_scale:g}); classes "
        f"{'/'.join(f'{m:g}' for m in w.mix)}; {w.seconds:g} s of load, seed {w.seed}; "
        f"CORE SLO: TTFT <= {config.slo.ttft.threshold_s:g} s; fixed TTL {config.scheduler.tool_wait_ttl_s:g} s",
    ]
    if sweep:
        lines.append("fcfs capacity sweep (load scale: tok/s, TTFT P50 / P95 s): " + "; ".join(
            f"{s['load_scale']:g}: {s['throughput_tokens_per_s']:.0f}, {s['ttft_p50_s']:.2f} / {s['ttft_p95_s']:.2f}"
            for s in sweep) + f" -> fcfs throughput peaks at scale {held:g} (its capacity)")
    lines += [
        "",
        f"{'policy':<15}{'P50 s':>8}{'P95 s':>8}{'core':>7}{'normal':>8}{'batch':>7}{'tok/s':>8}{'CORE SLO':>9}"
        f"{'Jain ten':>9}{'Jain agt':>9}{'warm %':>8}{'recomp tok':>11}{'HBM idle GB*s':>14}{'missed':>7}{'refused':>8}"
        f"{'slowdn P95':>11}{'unfin':>6}",
    ]
    for r in rows:
        pc = r["per_class_p95_s"]
        slo = r["core_slo_attainment"]
        warm = r["warm_resumes"]
        lines.append(
            f"{r['policy']:<15}{r['task_completion_p50_s']:>8.1f}{r['task_completion_p95_s']:>8.1f}{pc['core']:>7.1f}"
            f"{pc['normal']:>8.1f}{pc['batch']:>7.1f}{r['throughput_tokens_per_s']:>8.0f}"
            f"{(f'{100 * slo:.1f}%' if slo is not None else '-'):>9}{r['jain_tenants']:>9.3f}{r['jain_agents']:>9.3f}"
            f"{(f'{100 * warm:.1f}' if warm is not None else '-'):>8}{_figure(r['recomputed_tokens'], 'd'):>11}"
            f"{_figure(r['hbm_idle_gb_s'], '.0f'):>14}{r['missed_deadline']:>7}{r['refused_early']:>8}{r['slowdown_p95']:>11.2f}{r['unfinished_tasks']:>6}")
    by = {r["policy"]: r for r in rows}
    ours = by.get("switchyard")
    if ours:
        lines.append("")
        decisions = ours["tool_wait_decisions"]
        lines.append("switchyard tool-wait decisions: " + ", ".join(f"{k} {v}" for k, v in decisions.items())
                     + f"; resumes {ours['resumes']}, of swapped agents {ours['swapped_resumes']}; "
                     f"planned restores started {ours['prefetches_started']}, "
                     f"landed {ours['prefetches_landed']}; tool returns against them "
                     + ", ".join(f"{k} {v}" for k, v in ours["prefetch_returns"].items()))
        fcfs = by.get("fcfs")
        if fcfs and fcfs["task_completion_p95_s"]:
            lines.append(f"task completion P95 switchyard / fcfs: {ours['task_completion_p95_s'] / fcfs['task_completion_p95_s']:.3f} "
                         f"(target <= 0.5; throughput {ours['throughput_tokens_per_s'] / max(fcfs['throughput_tokens_per_s'], 1e-9):.3f}x; "
                         f"floor: the tasks' isolated P95 {ours['isolated_p95_s']:.1f} s / fcfs's P95 = "
                         f"{ours['isolated_p95_s'] / fcfs['task_completion_p95_s']:.3f}, below which no order goes)")
        anchors = [r for r in rows if r["policy"] not in ("switchyard", "fcfs", "priority") and r["task_completion_p95_s"]]
        if anchors:
            best = min(anchors, key=lambda r: r["task_completion_p95_s"])
            lines.append(f"task completion P95 switchyard / best anchor ({best['policy']}): "
                         f"{ours['task_completion_p95_s'] / best['task_completion_p95_s']:.3f} (target <= 0.8)")
        ttl = by.get("continuum")
        if ttl and ttl["hbm_idle_gb_s"] and ours["hbm_idle_gb_s"] is not None:
            lines.append(f"HBM held idle switchyard / fixed TTL (continuum): {ours['hbm_idle_gb_s'] / ttl['hbm_idle_gb_s']:.3f} "
                         f"(target <= 0.5), warm resumes {100 * (ours['warm_resumes'] or 0):.1f} % (target >= 90 %)")
        if fcfs:
            lines.append(f"Jain's index across tenants: switchyard {ours['jain_tenants']:.3f}, fcfs {fcfs['jain_tenants']:.3f} "
                         f"(target >= 0.9)")
    if at_double and held is not None:
        for row in at_double:
            slo = row["core_slo_attainment"]
            lines.append(f"CORE SLO attainment of {row['policy']} at 2x the load fcfs holds (scale {2 * held:g}): "
                         f"{100 * (slo or 0):.1f} % (target >= 95 % for switchyard); P95 {row['task_completion_p95_s']:.1f} s, "
                         f"missed {row['missed_deadline']}, refused {row['refused_early']}")
    return "\n".join(lines)


__all__ = ["POLICIES", "POLICY_NAMES", "SIMULATED_CLOCK", "AgentSimEngine", "anchor_queue", "PolicyRun", "PolicySpec", "ProgramArrivalQueue",
           "SessionServiceQueue", "Workload", "build_scheduler", "capacity_scale", "jain", "render", "run_policies",
           "summarize"]
