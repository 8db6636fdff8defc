"""Scheduling policies for agent programs, compared on one workload: ``switchyard bench agents --policies``.

A program-level model of one GPU's step loop on a simulated clock, the same
for every policy, so that only the policy differs:

- the engine: the sim's latency model (``sim`` section: a batched prefill of
  the uncomputed tokens, then decode steps of the running batch), and a KV
  budget in HBM (``capacity_ratio`` x device memory - weights, at
  ``kv_bytes_per_token``); a step is admitted when its KV (context + its
  output) fits, else it waits in its policy's order (no preemption);
- the DRAM tier: a copy each way takes ``transfer_seconds`` (``[dram]
  transfer_gb_per_s`` and ``transfer_latency_ms``, as
  :meth:`switchyard.dispatcher.tiers.MemoryTiers.transfer_seconds`);
- the workload (the field's locust mix, with tenants): 10 tenants; 9 run
  ``--tenant-agents`` react agents each with tools of measured durations
  (search ~0.3 s, code ~1.5 s, browse ~4 s: lognormal, sigma 0.4), the tenth
  runs ``--noisy-agents`` agents whose tools are long jobs (~15 s); each
  task's class is drawn from ``--mix``; a task opens with ``--prompt-tokens``,
  makes ``--tool-calls`` calls (``--call-tokens`` each, ``--result-tokens``
  back), then answers (``--answer-tokens``); core tasks have a time limit of
  ``--core-deadline`` seconds, normal ones ``--normal-deadline``.

The policies (waiting order; what happens to an agent's KV during a tool call):

- ``fcfs``: per-request arrival order (vLLM's default); the KV stays as a
  prefix cache, evicted least recently used when room is needed (vLLM's
  automatic prefix caching).
- ``priority``: per-request priority classes with aging (Switchyard's
  ``priority`` policy today: :class:`switchyard.dispatcher.scheduler.priority.PriorityScheduler`'s
  virtual arrival); KV parked for a fixed ``tool_wait_ttl_s``, evicted for room.
- ``llmd-las``: priority classes, and inside a class least attained service
  per agent session first (llm-d inference scheduler, per-session fairness
  plugin); KV as a prefix cache.
- ``autellix-plas``: program-level least attained service, cumulative, no
  classes (Autellix, Luo et al. 2025); KV as a prefix cache.
- ``continuum``: program-level FCFS (by task start) with the agent's KV pinned
  for a fixed time-to-live during each tool call (Continuum, Li et al. 2025),
  ``tool_wait_ttl_s``.
- ``switchyard``: priority classes; inside a class, a request whose slack is
  below ``--slack-urgent`` goes first, least slack first
  (:mod:`switchyard.dispatcher.scheduler.slack`); the rest by the tenant's
  weighted attained service, then the session's (:mod:`switchyard.dispatcher.scheduler.fairness`);
  a request that cannot make its task's deadline is refused early; at tool
  start the KV is kept, swapped or dropped by
  :func:`switchyard.dispatcher.scheduler.tool_wait.decide`, with the tool's
  expected wait the 10th percentile of its recent calls (so the restore lands
  before nine returns in ten).

Reported per policy: task completion P50/P95 (all and per class), throughput
(tasks and generated tokens per second), CORE SLO attainment (steps whose TTFT
is within ``slo.ttft.threshold_s``), Jain's fairness index of normalized
progress (isolated task time / task completion time) across tenants and
across agents, warm resumes (tool returns that find their KV in HBM),
recomputed prefix tokens, HBM held idle during tool waits (GB x s), deadline
misses (served late) and early refusals.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines.sim import decode_seconds, prefill_seconds
from switchyard.dispatcher.scheduler import slack as slack_rule
from switchyard.dispatcher.scheduler.fairness import FairnessLedger
from switchyard.dispatcher.scheduler.tool_wait import Decision, ToolWaitInputs, decide

POLICY_NAMES = ("fcfs", "priority", "llmd-las", "autellix-plas", "continuum", "switchyard")
"""Every policy ``--policies`` accepts, in the order the table prints them."""

TOOLS: dict[str, float] = {"search": 0.3, "code": 1.5, "browse": 4.0}
"""The quiet tenants' tools: median duration, seconds."""
NOISY_TOOL = ("batch_job", 15.0)
"""The noisy tenant's one tool and its median duration, seconds."""
TOOL_SIGMA = 0.4
"""Log-space spread of every tool's duration (lognormal)."""
NOISY_TENANT = "tenant-9"


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


@dataclass(eq=False)
class Step:
    """One model call of an agent."""

    agent: "Agent"
    arrival: float
    context: int
    out_tokens: int
    tool_call: bool
    warm_tokens: int = 0
    ready_at: float = 0.0
    """Not admissible before this (its KV is still coming back)."""
    generated: int = 0
    reserved: int = 0
    key: tuple[float, ...] = ()
    admitted_at: float = 0.0


@dataclass(eq=False)
class Agent:
    """One agent and its current task."""

    name: str
    tenant: str
    rng: random.Random
    noisy: bool
    cls: int = 1
    context: int = 0
    calls_left: int = 0
    task_started: float = 0.0
    task_gpu_s: float = 0.0
    task_tool_s: float = 0.0
    deadline: float = math.inf
    kv_where: str = "none"
    """none, hbm, out (being copied out), dram, restoring."""
    kv_tokens: int = 0
    prefix_tokens: int = 0
    """Tokens its last parked KV covered (what a lost KV costs to recompute)."""
    kv_bytes: int = 0
    kv_gen: int = 0
    """Bumps on every change of where the KV is, so stale timed events are ignored."""
    restore_end: float = 0.0
    parked_since: float = 0.0
    pinned_until: float = 0.0
    tool: str = ""
    tool_started: float = 0.0
    tasks_done: int = 0
    progress: list[float] = field(default_factory=list)


@dataclass
class PolicyResult:
    """What one policy's run measured."""

    policy: str
    completion: dict[int, list[float]] = field(default_factory=lambda: {0: [], 1: [], 2: []})
    core_ttft: list[float] = field(default_factory=list)
    tenant_progress: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    agent_progress: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    resumes: dict[str, int] = field(default_factory=lambda: {"warm": 0, "restored": 0, "recomputed": 0})
    recomputed_tokens: int = 0
    idle_byte_s: float = 0.0
    generated: int = 0
    missed_deadline: int = 0
    refused_early: int = 0
    decisions: dict[str, int] = field(default_factory=lambda: {d.value: 0 for d in Decision})
    makespan: float = 0.0
    unfinished: int = 0
    slo_s: float = 1.0
    """The TTFT objective's threshold (``slo.ttft.threshold_s``)."""


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def jain(values: list[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one has all (Jain et al. 1984)."""
    values = [v for v in values if v > 0]
    if not values:
        return 0.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


class ToolStats:
    """Recent durations per tool (the orchestrator's measured figures): a quantile of the last 200."""

    def __init__(self) -> None:
        self._recent: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=200))

    def add(self, tool: str, seconds: float) -> None:
        self._recent[tool].append(seconds)

    def quantile(self, tool: str, q: float, default: float) -> float:
        recent = sorted(self._recent[tool])
        if len(recent) < 5:
            return default
        return recent[min(len(recent) - 1, int(q * len(recent)))]


class ProgramSim:
    """One policy's run of the workload (see the module docstring)."""

    def __init__(self, policy: str, workload: Workload, config: SwitchyardConfig, *, slack_urgent_s: float = 5.0,
                 fairness_half_life_s: float = 30.0) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"policy: expected one of {list(POLICY_NAMES)}, got {policy!r}")
        self.policy = policy
        self.w = workload
        self.config = config
        sim = config.sim
        self.sim = sim
        self.bpt = sim.kv_bytes_per_token
        self.budget = int(config.memory.hbm.capacity_ratio * sim.hbm_gb * 1e9 - sim.params_billion * 1e9
                          * sim.bytes_per_param)
        if self.budget <= 0:
            raise ValueError("the modelled GPU has no KV budget: raise sim.hbm_gb or memory.hbm.capacity_ratio")
        dram = config.memory.dram
        self.transfer = lambda nbytes: nbytes / (dram.transfer_gb_per_s * 1e9) + dram.transfer_latency_ms / 1000
        self.ttl_s = config.scheduler.tool_wait_ttl_s
        boost = config.scheduler.priority_boost
        values = (boost.core, boost.normal, boost.batch)
        low, high = min(values), max(values)
        aging = config.scheduler.aging_max_wait_ms / 1000
        self.head_start = tuple(aging * (v - low) / (high - low) if high > low else 0.0 for v in values)
        self.slo_s = config.slo.ttft.threshold_s
        self.slack_urgent_s = slack_urgent_s
        half_life = math.inf if policy == "autellix-plas" else fairness_half_life_s
        self.ledger = FairnessLedger(half_life)
        self.tools = ToolStats()
        self.step_ema = 0.5
        self.result = PolicyResult(policy, slo_s=self.slo_s)
        self.t = 0.0
        self.used = 0
        """HBM bytes held: running reservations and parked KV."""
        self.parked_hbm = 0
        self.events: list[tuple[float, int, str, Agent, int]] = []
        self._seq = 0
        self.waiting: list[Step] = []
        self.running: list[Step] = []
        self.lru: dict[Agent, float] = {}
        """Agents whose KV sits in HBM while they wait on a tool -> when parked (eviction order)."""
        self.agents = self._agents()

    # ------------------------------------------------------------------ workload

    def _agents(self) -> list[Agent]:
        master = random.Random(self.w.seed)
        agents = []
        quiet = max(1, round(self.w.tenant_agents * self.w.load_scale))
        noisy = max(1, round(self.w.noisy_agents * self.w.load_scale))
        for tenant in range(self.w.tenants):
            is_noisy = tenant == self.w.tenants - 1
            for i in range(noisy if is_noisy else quiet):
                agents.append(Agent(f"t{tenant}-a{i}", f"tenant-{tenant}", random.Random(master.random()), is_noisy))
        for agent in agents:
            self._new_task(agent, agent.rng.uniform(0, 2.0))
        return agents

    def _new_task(self, agent: Agent, at: float) -> None:
        rng = agent.rng
        agent.cls = rng.choices([0, 1, 2], weights=self.w.mix)[0]
        agent.context = rng.randint(*self.w.prompt_tokens)
        agent.calls_left = rng.randint(*self.w.tool_calls)
        agent.task_started = at
        agent.task_gpu_s = agent.task_tool_s = 0.0
        limit = {0: self.w.core_deadline_s, 1: self.w.normal_deadline_s}.get(agent.cls, math.inf)
        agent.deadline = at + limit
        self._drop_kv(agent)
        self._at(at, "arrive", agent)

    def _at(self, when: float, kind: str, agent: Agent, gen: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, kind, agent, gen))

    # ------------------------------------------------------------------ memory

    def _advance(self, to: float) -> None:
        if to > self.t:
            self.result.idle_byte_s += self.parked_hbm * (to - self.t)
            self.t = to

    def _hold(self, agent: Agent, where: str) -> None:
        """Agent's parked KV now at ``where``; keeps the HBM counters right."""
        was_hbm = agent.kv_where in ("hbm", "out", "restoring")
        now_hbm = where in ("hbm", "out", "restoring")
        if was_hbm and not now_hbm:
            self.used -= agent.kv_bytes
            self.parked_hbm -= agent.kv_bytes
        elif now_hbm and not was_hbm:
            self.used += agent.kv_bytes
            self.parked_hbm += agent.kv_bytes
        agent.kv_where = where
        agent.kv_gen += 1
        if where == "hbm":  # evictable while it is not running (its agent on a tool, or its step waiting)
            self.lru[agent] = self.t
        else:
            self.lru.pop(agent, None)

    def _drop_kv(self, agent: Agent) -> None:
        if agent.kv_where != "none":
            self._hold(agent, "none")
        agent.kv_tokens = agent.kv_bytes = 0

    def _evict_for(self, need: int, exclude: Agent | None = None) -> bool:
        """Free parked KV (least recently parked first, never ``exclude``'s) until ``need`` bytes fit."""
        while self.used + need > self.budget:
            candidates = [a for a in self.lru if a.pinned_until <= self.t and a is not exclude]
            if not candidates:
                return False
            victim = min(candidates, key=lambda a: self.lru[a])
            if self.policy == "switchyard":  # out to DRAM (the copy frees HBM once done; counted free at once)
                self._hold(victim, "dram")
            else:
                self._drop_kv(victim)
        return True

    # ------------------------------------------------------------------ ordering

    def _expected_remaining(self, agent: Agent) -> float:
        tools = NOISY_TOOL[1] if agent.noisy else sum(TOOLS.values()) / len(TOOLS)
        return agent.calls_left * (tools + self.step_ema)

    def _key(self, step: Step) -> tuple[float, ...]:
        a, now = step.agent, self.t
        if self.policy == "fcfs":
            return (step.arrival,)
        if self.policy == "priority":
            return (step.arrival - self.head_start[a.cls],)
        if self.policy == "llmd-las":
            return (a.cls, self.ledger.sessions.service(a.name, now), step.arrival)
        if self.policy == "autellix-plas":
            return (self.ledger.sessions.service(a.name, now), step.arrival)
        if self.policy == "continuum":
            return (a.task_started, step.arrival)
        slack = slack_rule.slack_s(a.deadline - now if math.isfinite(a.deadline) else None,
                                   self._expected_remaining(a), self.step_ema)
        urgent = slack < self.slack_urgent_s  # at risk: by latest start time (now + slack), least slack first
        tenant, session, arrival = self.ledger.order_key(a.name, a.tenant, step.arrival, now)
        return (a.cls, 0 if urgent else 1, now + slack if urgent else 0.0, tenant, session, arrival)

    # ------------------------------------------------------------------ events

    def _arrive(self, agent: Agent) -> None:
        step = Step(agent, self.t, agent.context, 0, agent.calls_left > 0)
        rng = agent.rng
        step.out_tokens = rng.randint(*(self.w.call_tokens if step.tool_call else self.w.answer_tokens))
        if agent.tool:  # back from a tool
            elapsed = self.t - agent.tool_started
            self.tools.add(agent.tool, elapsed)
            agent.task_tool_s += elapsed
            agent.tool = ""
            where = agent.kv_where
            if where in ("hbm", "out"):  # a copy out under way is abandoned: the bytes are still in HBM
                self.result.resumes["warm"] += 1
                step.warm_tokens = agent.kv_tokens
                if where == "out":
                    agent.kv_where = "hbm"
                    agent.kv_gen += 1
            elif where in ("dram", "restoring"):  # early: the turn waits for the copy back
                self.result.resumes["restored"] += 1
                if where == "dram":
                    self._hold(agent, "restoring")
                    agent.restore_end = self.t + self.transfer(agent.kv_bytes)
                    self._at(agent.restore_end, "restored", agent, agent.kv_gen)
                step.ready_at = agent.restore_end
                step.warm_tokens = agent.kv_tokens
            else:
                self.result.resumes["recomputed"] += 1
                self.result.recomputed_tokens += agent.prefix_tokens
            agent.pinned_until = 0.0  # Continuum's pin ends with the tool call
        if self.policy == "switchyard" and math.isfinite(agent.deadline):
            slack = slack_rule.slack_s(agent.deadline - self.t, self._expected_remaining(agent), self.step_ema)
            if slack_rule.cannot_make_it(slack):
                self.result.refused_early += 1
                self._end_task(agent, refused=True)
                return
        step.key = self._key(step)
        bisect.insort(self.waiting, step, key=lambda s: s.key)

    def _park(self, step: Step) -> None:
        agent = step.agent
        agent.context += step.out_tokens
        agent.kv_tokens = agent.prefix_tokens = agent.context
        agent.kv_bytes = agent.context * self.bpt
        agent.context += agent.rng.randint(*self.w.result_tokens)
        agent.calls_left -= 1
        tool, median = NOISY_TOOL if agent.noisy else agent.rng.choice(list(TOOLS.items()))
        duration = median * math.exp(agent.rng.gauss(0, TOOL_SIGMA))
        agent.tool, agent.tool_started = tool, self.t
        agent.pinned_until = 0.0
        self.used -= step.reserved  # the step's reservation becomes the parked KV's hold
        agent.kv_where = "none"
        self._hold(agent, "hbm")
        if self.policy in ("priority", "continuum"):
            if self.policy == "continuum":
                agent.pinned_until = self.t + self.ttl_s
            self._at(self.t + self.ttl_s, "expire", agent, agent.kv_gen)
        elif self.policy == "switchyard":
            self._tool_wait(agent, tool, median)
        self._at(self.t + duration, "arrive", agent)

    def _tool_wait(self, agent: Agent, tool: str, median: float) -> None:
        expected = self.tools.quantile(tool, 0.1, median * math.exp(-1.28 * TOOL_SIGMA))
        transfer = self.transfer(agent.kv_bytes)
        out = decide(ToolWaitInputs(
            expected_wait_s=expected, kv_bytes=agent.kv_bytes, budget_bytes=self.budget,
            pressure=min(1.0, self.used / self.budget), transfer_s=transfer,
            recompute_s=prefill_seconds(self.sim, agent.kv_tokens)))
        self.result.decisions[out.decision.value] += 1
        if out.decision is Decision.SWAP:
            self._hold(agent, "out")
            self._at(self.t + transfer, "copied", agent, agent.kv_gen)
            assert out.restore_at_s is not None
            self._at(self.t + out.restore_at_s, "restore", agent)
        elif out.decision is Decision.DROP:
            self._drop_kv(agent)

    def _event(self, kind: str, agent: Agent, gen: int) -> None:
        if kind == "arrive":
            self._arrive(agent)
        elif kind == "expire" and agent.kv_gen == gen and agent.kv_where == "hbm" and agent.tool:
            self._drop_kv(agent)
        elif kind == "copied" and agent.kv_gen == gen and agent.kv_where == "out":
            self._hold(agent, "dram")
        elif kind == "restore" and agent.kv_where == "dram" and agent.tool:
            if self._evict_for(agent.kv_bytes, agent):
                self._hold(agent, "restoring")
                agent.restore_end = self.t + self.transfer(agent.kv_bytes)
                self._at(agent.restore_end, "restored", agent, agent.kv_gen)
        elif kind == "restored" and agent.kv_gen == gen and agent.kv_where == "restoring":
            self._hold(agent, "hbm")

    def _end_task(self, agent: Agent, refused: bool = False) -> None:
        if not refused:
            took = self.t - agent.task_started
            self.result.completion[agent.cls].append(took)
            isolated = agent.task_gpu_s + agent.task_tool_s
            progress = min(1.0, isolated / took) if took > 0 else 1.0
            self.result.tenant_progress[agent.tenant].append(progress)
            self.result.agent_progress[agent.name].append(progress)
            if self.t > agent.deadline:
                self.result.missed_deadline += 1
        agent.tasks_done += 1
        self._drop_kv(agent)
        gap = agent.rng.uniform(*self.w.gap_s)
        if self.t + gap < self.w.seconds:
            self._new_task(agent, self.t + gap)

    # ------------------------------------------------------------------ the loop

    def _admit(self) -> list[Step]:
        admitted = []
        for step in list(self.waiting):
            if step.ready_at > self.t:
                continue
            need = (step.context + step.out_tokens) * self.bpt
            if step.warm_tokens and step.agent.kv_where in ("hbm", "restoring"):
                need -= step.agent.kv_bytes  # its parked KV is already held
            if self.used + need > self.budget and not self._evict_for(need, step.agent):
                break  # strict order: the head waits for room
            if step.warm_tokens and step.agent.kv_where in ("hbm", "restoring"):
                self.used -= step.agent.kv_bytes
                self.parked_hbm -= step.agent.kv_bytes
                step.agent.kv_where = "none"
                step.agent.kv_gen += 1
                self.lru.pop(step.agent, None)
            elif step.warm_tokens:  # its copy was lost in the meantime
                step.warm_tokens = 0
            step.reserved = (step.context + step.out_tokens) * self.bpt
            self.used += step.reserved
            self.waiting.remove(step)
            step.admitted_at = self.t
            admitted.append(step)
            if len(admitted) >= self.config.scheduler.max_admitted_per_decision:
                break
        return admitted

    def _account(self, step: Step, tokens: int) -> None:
        self.ledger.charge(step.agent.name, step.agent.tenant, tokens, self.t)

    def run(self) -> PolicyResult:
        limit = self.w.seconds * self.w.drain_limit
        while self.t < limit:
            while self.events and self.events[0][0] <= self.t:
                _, _, kind, agent, gen = heapq.heappop(self.events)
                self._event(kind, agent, gen)
            admitted = self._admit()
            if not admitted and not self.running:
                pending = [s.ready_at for s in self.waiting if s.ready_at > self.t]
                nxt = min(([self.events[0][0]] if self.events else []) + pending, default=math.inf)
                if not math.isfinite(nxt):
                    break
                self._advance(max(nxt, self.t))
                continue
            if admitted:
                tokens = sum(s.context - s.warm_tokens for s in admitted)
                cost = prefill_seconds(self.sim, tokens)
                self._advance(self.t + cost)
                for step in admitted:
                    self._account(step, step.context - step.warm_tokens)
                    step.generated = 1
                    if step.agent.cls == 0:
                        self.result.core_ttft.append(self.t - step.arrival)
                self.running.extend(admitted)
            boundary = self.events[0][0] if self.events else math.inf
            for _ in range(50):
                live = [s for s in self.running if s.generated < s.out_tokens]
                if not live:
                    break
                self._advance(self.t + decode_seconds(self.sim, len(live)))
                for step in live:
                    step.generated += 1
                    self._account(step, 1)
                if any(s.generated >= s.out_tokens for s in live) or self.t >= boundary:
                    break
            for step in [s for s in self.running if s.generated >= s.out_tokens]:
                self.running.remove(step)
                self.result.generated += step.out_tokens
                took = self.t - step.admitted_at
                self.step_ema = 0.9 * self.step_ema + 0.1 * took
                step.agent.task_gpu_s += took
                if step.tool_call:
                    self._park(step)
                else:
                    self.used -= step.reserved
                    self._end_task(step.agent)
        self.result.makespan = self.t
        self.result.unfinished = len(self.waiting) + len(self.running)
        return self.result


def summarize(result: PolicyResult) -> dict[str, Any]:
    """One policy's row."""
    every = [v for values in result.completion.values() for v in values]
    resumes = sum(result.resumes.values())
    core = result.core_ttft
    tenants = [sum(v) / len(v) for v in result.tenant_progress.values() if v]
    agents = [sum(v) / len(v) for v in result.agent_progress.values() if v]
    return {
        "policy": result.policy,
        "tasks_completed": len(every),
        "task_completion_p50_s": round(percentile(every, 50), 3),
        "task_completion_p95_s": round(percentile(every, 95), 3),
        "per_class_p95_s": {name: round(percentile(result.completion[rank], 95), 3)
                            for rank, name in enumerate(("core", "normal", "batch"))},
        "throughput_tasks_per_s": round(len(every) / result.makespan, 3) if result.makespan else 0.0,
        "throughput_tokens_per_s": round(result.generated / result.makespan, 1) if result.makespan else 0.0,
        "core_slo_attainment": round(sum(1 for v in core if v <= result.slo_s) / len(core), 4) if core else None,
        "jain_tenants": round(jain(tenants), 4),
        "jain_agents": round(jain(agents), 4),
        "warm_resumes": round(result.resumes["warm"] / resumes, 4) if resumes else None,
        "resumes": dict(result.resumes),
        "recomputed_tokens": result.recomputed_tokens,
        "hbm_idle_gb_s": round(result.idle_byte_s / 1e9, 1),
        "missed_deadline": result.missed_deadline,
        "refused_early": result.refused_early,
        "tool_wait_decisions": dict(result.decisions),
        "makespan_s": round(result.makespan, 2),
        "unfinished_steps": result.unfinished,
    }


def run_policies(policies: list[str], workload: Workload, config: SwitchyardConfig,
                 progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Run ``workload`` under each policy; one summary row each."""
    rows = []
    for policy in policies:
        rows.append(summarize(ProgramSim(policy, workload, config).run()))
        progress(policy)
    return rows


def hold_scale(workload: Workload, config: SwitchyardConfig, scales: tuple[float, ...] = (0.2, 0.3, 0.45, 0.6, 0.8, 1.0),
               objective: float = 0.95) -> float:
    """The largest load scale (of ``scales``) at which ``fcfs`` holds CORE SLO attainment >= ``objective``
    (the first scale when none does)."""
    held = scales[0]
    for scale in scales:
        row = summarize(ProgramSim("fcfs", Workload(**{**workload.__dict__, "load_scale": scale}), config).run())
        if (row["core_slo_attainment"] or 0.0) >= objective:
            held = scale
    return held


def render(rows: list[dict[str, Any]], workload: Workload, config: SwitchyardConfig, *,
           at_double: dict[str, Any] | None = None, held: float | None = None) -> str:
    """The printed table, with the issue's ratios (ours / FCFS, ours / the best anchor)."""
    w = workload
    lines = [
        "switchyard agent-program policies: program-level step-loop model, sim latency model, simulated clock",
        f"{w.tenants} tenants: {w.tenants - 1} x {max(1, round(w.tenant_agents * w.load_scale))} agents "
        f"(tools {', '.join(f'{k} ~{v:g} s' for k, v in TOOLS.items())}), 1 x "
        f"{max(1, round(w.noisy_agents * w.load_scale))} agents ({NOISY_TOOL[0]} ~{NOISY_TOOL[1]:g} s); classes "
        f"{'/'.join(f'{m:g}' for m in w.mix)}; {w.seconds:g} s of load, seed {w.seed}; "
        f"CORE SLO: TTFT <= {config.slo.ttft.threshold_s:g} s; fixed TTL {config.scheduler.tool_wait_ttl_s:g} s",
        "",
        f"{'policy':<15}{'P50 s':>8}{'P95 s':>8}{'core':>7}{'normal':>8}{'batch':>7}{'tok/s':>8}{'CORE SLO':>9}"
        f"{'Jain ten':>9}{'Jain agt':>9}{'warm %':>8}{'recomp tok':>11}{'HBM idle GB*s':>14}{'missed':>7}{'refused':>8}",
    ]
    for r in rows:
        pc = r["per_class_p95_s"]
        slo = r["core_slo_attainment"]
        warm = r["warm_resumes"]
        lines.append(
            f"{r['policy']:<15}{r['task_completion_p50_s']:>8.1f}{r['task_completion_p95_s']:>8.1f}{pc['core']:>7.1f}"
            f"{pc['normal']:>8.1f}{pc['batch']:>7.1f}{r['throughput_tokens_per_s']:>8.0f}"
            f"{(f'{100 * slo:.1f}%' if slo is not None else '-'):>9}{r['jain_tenants']:>9.3f}{r['jain_agents']:>9.3f}"
            f"{(f'{100 * warm:.1f}' if warm is not None else '-'):>8}{r['recomputed_tokens']:>11}"
            f"{r['hbm_idle_gb_s']:>14.0f}{r['missed_deadline']:>7}{r['refused_early']:>8}")
    by = {r["policy"]: r for r in rows}
    ours = by.get("switchyard")
    if ours:
        lines.append("")
        decisions = ours["tool_wait_decisions"]
        lines.append("switchyard tool-wait decisions: " + ", ".join(f"{k} {v}" for k, v in decisions.items()))
        fcfs = by.get("fcfs")
        if fcfs and fcfs["task_completion_p95_s"]:
            lines.append(f"task completion P95 switchyard / fcfs: {ours['task_completion_p95_s'] / fcfs['task_completion_p95_s']:.3f} "
                         f"(target <= 0.5; throughput {ours['throughput_tokens_per_s'] / max(fcfs['throughput_tokens_per_s'], 1e-9):.3f}x)")
        anchors = [r for r in rows if r["policy"] not in ("switchyard", "fcfs", "priority") and r["task_completion_p95_s"]]
        if anchors:
            best = min(anchors, key=lambda r: r["task_completion_p95_s"])
            lines.append(f"task completion P95 switchyard / best anchor ({best['policy']}): "
                         f"{ours['task_completion_p95_s'] / best['task_completion_p95_s']:.3f} (target <= 0.8)")
        ttl = by.get("continuum")
        if ttl and ttl["hbm_idle_gb_s"]:
            lines.append(f"HBM held idle switchyard / fixed TTL (continuum): {ours['hbm_idle_gb_s'] / ttl['hbm_idle_gb_s']:.3f} "
                         f"(target <= 0.5), warm resumes {100 * (ours['warm_resumes'] or 0):.1f} % (target >= 90 %)")
        if fcfs:
            lines.append(f"Jain's index across tenants: switchyard {ours['jain_tenants']:.3f}, fcfs {fcfs['jain_tenants']:.3f} "
                         f"(target >= 0.9)")
    if at_double is not None and held is not None:
        slo = at_double["core_slo_attainment"]
        lines.append(f"CORE SLO attainment of switchyard at 2x the load fcfs holds (fcfs holds >= 95 % up to scale "
                     f"{held:g}; run at {2 * held:g}): {100 * (slo or 0):.1f} % (target >= 95 %)")
    return "\n".join(lines)
