"""The decision at tool start: keep an agent's KV in HBM, swap it to the DRAM tier, or drop it.

When the orchestrator starts a tool call it knows which agent waits, on which
tool, and that tool's expected duration (a quantile of its recent calls). The
dispatcher decides at once, from figures it already has
(:class:`switchyard.dispatcher.tiers.MemoryTiers`: ``transfer_seconds`` for a
one-way copy at ``[dram] transfer_gb_per_s``, ``recompute_seconds`` for the
engine's prefill of the same tokens), instead of holding every agent's KV for
one fixed time (Continuum's tool-call time-to-live, Li et al. 2025; NVIDIA
Dynamo likewise pauses agents at tool boundaries).

Cost model (every option priced in seconds, the cheapest wins; ties go to
keep, then swap)::

    keep  = wait x share x max(pressure, idle_price_floor)
    swap  = copy_cost_weight x 2 x transfer + max(0, 2 x transfer + margin - wait)
    drop  = recompute

- ``wait``: the tool's expected duration (seconds).
- ``share``: the KV's part of the HBM KV budget (``kv_bytes / budget_bytes``).
- ``pressure``: the part of the budget in use now (running and parked KV,
  0..1). Held idle memory costs the work it keeps out: at full pressure,
  holding a share ``s`` of the budget for ``w`` seconds keeps about ``s x w``
  engine-seconds of other work waiting; at low pressure it costs little, but
  never nothing (``idle_price_floor``): memory idle now is memory a burst
  cannot have.
- ``transfer``: one-way copy seconds. A swap copies out and back, on the copy
  engine beside compute: it is charged ``copy_cost_weight`` of its time
  (default 0.1: the link is shared with other swaps, not with the GPU's
  compute), plus the stall the next turn sees when the round trip and the
  ``margin`` do not fit in the wait.
- ``recompute``: the engine's prefill of the prefix, spent again at resume
  (on the GPU and on the agent's path).

A swap plans the KV's return ahead of the tool's expected return
(:attr:`ToolWaitDecision.restore_at_s` = ``wait - transfer - margin``, never
before the copy out has ended), so the next turn finds it warm: the scheduler
keeps each agent's plan (:class:`ToolWaitPlans`) and its decision at
``schedule(now)`` hands the restores that are due to the loop
(``SchedulerOutput.prefetch``), which loads the DRAM copy back into the
agent's parked step and hands it back (``SchedulerCore.prefetched``): the
agent is parked again, warm, and its next step takes the prefix over as from
any parked step (the prefetch of KVFlow, Pan et al. 2025, timed here by the
tool's measured duration instead of a workflow graph). A restore is started
only when the KV budget has room for it; one that cannot start waits for room
or for the turn.

Early and late returns:

- A tool that returns *early* (its next turn arrives before the copy is back,
  or before its restore was due) has its copy restored at once, at its
  admission (the step loop's restore before that step's prefill), and the turn
  waits for the transfer (what :func:`on_return` prices): a cold resume, the
  prefetch counted ``early``.
- A tool that returns *late* finds its KV restored and parked, held under the
  same rules as any parked step (the parking TTL from when it came back, at
  least until the tool's revisit time ``wait + grace``; evicted by value for
  room): if it is still parked at the turn, a warm resume. A prefetch whose KV
  is still unclaimed at the revisit time is counted ``late`` (it sat idle in
  HBM past the tool's expected return and its grace).
- Otherwise the KV landed before the turn, and the turn came by the revisit
  time: ``on_time``.

Every resume of an agent that had a tool-wait decision is counted per tool,
``warm`` (its prefix still in HBM) or ``cold`` (restored at admission or
recomputed) (:class:`ToolWaitPlans`; exported as
``switchyard_tool_resumes_total{tool,resume}``, with the decisions as
``switchyard_tool_wait_decisions_by_tool_total{tool,decision}`` and the
prefetches by the tool's return as ``switchyard_tool_wait_prefetches_total{tool,tool_return}``).

KEEP holds the KV ``wait + grace`` (the grace is as long again as the wait:
:func:`residual_wait_s`, the mean residual life of a heavy-tailed, Pareto-like
duration grows in proportion to its age); then the parking TTL's expiry moves
it out.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from switchyard.dispatcher.request import Request

__all__ = [
    "PREFETCH_TIMINGS",
    "RESUME_KINDS",
    "ToolWaitPlan",
    "ToolWaitPlans",
    "Decision",
    "ToolWaitCosts",
    "ToolWaitDecision",
    "ToolWaitInputs",
    "decide",
    "on_return",
    "residual_wait_s",
]


class Decision(str, enum.Enum):
    """Where an agent's KV goes for its tool wait (the ``decision`` label of the tool-wait metrics)."""

    KEEP = "keep"
    SWAP = "swap"
    DROP = "drop"


DECISIONS: tuple[str, ...] = tuple(d.value for d in Decision)
"""Every decision's label value."""


@dataclass(frozen=True)
class ToolWaitInputs:
    """What the decision reads (seconds, bytes, fractions).

    Raises (at construction):
        ValueError: a negative time or size, a budget not > 0, or a fraction outside 0..1.
    """

    expected_wait_s: float
    kv_bytes: int
    budget_bytes: int
    pressure: float
    """Part of the HBM KV budget in use now, 0..1 (over 1 counts as 1)."""
    transfer_s: float
    """One-way HBM<->DRAM copy seconds of these bytes (``MemoryTiers.transfer_seconds``)."""
    recompute_s: float
    """Engine seconds to recompute the prefix (``MemoryTiers.recompute_seconds``)."""
    can_swap: bool = True
    """A DRAM tier is there, reachable, and the engine can export its KV."""
    margin_s: float = 0.05
    """Seconds the restore is planned to end ahead of the tool's expected return."""
    copy_cost_weight: float = 0.1
    idle_price_floor: float = 0.25

    def __post_init__(self) -> None:
        for name, value in (("expected_wait_s", self.expected_wait_s), ("transfer_s", self.transfer_s),
                            ("recompute_s", self.recompute_s), ("margin_s", self.margin_s),
                            ("copy_cost_weight", self.copy_cost_weight)):
            if value < 0:
                raise ValueError(f"{name}: expected >= 0, got {value!r}")
        if self.kv_bytes < 0:
            raise ValueError(f"kv_bytes: expected >= 0, got {self.kv_bytes!r}")
        if not self.budget_bytes > 0:
            raise ValueError(f"budget_bytes: expected > 0, got {self.budget_bytes!r}")
        if self.pressure < 0:
            raise ValueError(f"pressure: expected a fraction >= 0, got {self.pressure!r}")
        if not 0 <= self.idle_price_floor <= 1:
            raise ValueError(f"idle_price_floor: expected a fraction 0..1, got {self.idle_price_floor!r}")


@dataclass(frozen=True)
class ToolWaitCosts:
    """Each option's price, seconds (``swap`` is ``inf`` when a swap is not possible)."""

    keep: float
    swap: float
    drop: float


@dataclass(frozen=True)
class ToolWaitDecision:
    """The decision, when to bring swapped KV back, and when to look again.

    Times are seconds after the tool started.
    """

    decision: Decision
    restore_at_s: float | None
    """SWAP: when the restore starts (``wait - transfer - margin``, at least ``transfer``); else None."""
    revisit_at_s: float
    """When a tool still running is decided again (``wait + grace``)."""
    costs: ToolWaitCosts
    transfer_s: float = 0.0
    """One-way HBM<->DRAM copy seconds of the KV (``ToolWaitInputs.transfer_s``)."""

    @property
    def warm_at_s(self) -> float | None:
        """SWAP: when the planned restore has brought the KV back (``restore_at_s + transfer_s``); else None."""
        return None if self.restore_at_s is None else self.restore_at_s + self.transfer_s


def costs(inputs: ToolWaitInputs) -> ToolWaitCosts:
    """Each option's price (the module docstring's cost model)."""
    share = inputs.kv_bytes / inputs.budget_bytes
    pressure = min(1.0, max(inputs.pressure, inputs.idle_price_floor))
    keep = inputs.expected_wait_s * share * pressure
    round_trip = 2 * inputs.transfer_s
    if inputs.can_swap and inputs.kv_bytes > 0:
        swap = inputs.copy_cost_weight * round_trip + max(0.0, round_trip + inputs.margin_s - inputs.expected_wait_s)
    else:
        swap = float("inf")
    return ToolWaitCosts(keep=keep, swap=swap, drop=inputs.recompute_s)


def decide(inputs: ToolWaitInputs, grace_s: float = 0.0) -> ToolWaitDecision:
    """Keep, swap or drop the agent's KV for a tool wait of ``inputs.expected_wait_s``.

    Args:
        inputs: the figures (see :class:`ToolWaitInputs`).
        grace_s: seconds past the expected return before a still-running tool is revisited (>= 0).

    Returns:
        the cheapest option (ties: keep, then swap), and for a swap when its restore starts.

    Raises:
        ValueError: ``grace_s`` < 0.
    """
    if grace_s < 0:
        raise ValueError(f"grace_s: expected >= 0, got {grace_s!r}")
    priced = costs(inputs)
    decision = min((priced.keep, 0, Decision.KEEP), (priced.swap, 1, Decision.SWAP),
                   (priced.drop, 2, Decision.DROP))[2]
    restore_at = None
    if decision is Decision.SWAP:
        restore_at = max(inputs.transfer_s, inputs.expected_wait_s - inputs.transfer_s - inputs.margin_s)
    return ToolWaitDecision(decision, restore_at, inputs.expected_wait_s + grace_s, priced, inputs.transfer_s)


def residual_wait_s(elapsed_s: float, expected_wait_s: float) -> float:
    """A late tool's expected remaining wait: as long again as it has run (at least its expected wait).

    The mean residual life of a Pareto-like (heavy-tailed) duration grows in proportion to its age.
    """
    return max(elapsed_s, expected_wait_s, 0.0)


@dataclass(frozen=True)
class Return:
    """What a returning agent's turn finds: warm, or the copy still to bring back (seconds of wait)."""

    warm: bool
    stall_s: float
    """Seconds the turn waits for its KV (0 when warm; recompute seconds when dropped)."""


def on_return(decision: ToolWaitDecision, elapsed_s: float, transfer_s: float, recompute_s: float) -> Return:
    """The agent is back ``elapsed_s`` after the tool started: how its KV is found.

    KEEP: warm. SWAP: warm when the restore (started at ``restore_at_s``) has ended; an early return
    starts the restore at once (after the copy out) and waits for it. DROP: the prefix is recomputed.
    """
    if decision.decision is Decision.KEEP:
        return Return(True, 0.0)
    if decision.decision is Decision.DROP:
        return Return(False, recompute_s)
    assert decision.restore_at_s is not None
    if elapsed_s >= decision.restore_at_s + transfer_s:
        return Return(True, 0.0)
    started = min(max(elapsed_s, transfer_s), decision.restore_at_s)  # an early return starts it now
    return Return(False, max(0.0, started + transfer_s - elapsed_s))


RESUME_KINDS: tuple[str, ...] = ("warm", "cold")
"""How an agent back from a tool found its prefix: still in HBM, or not (the ``resume`` label)."""

PREFETCH_TIMINGS: tuple[str, ...] = ("early", "on_time", "late")
"""How a swapped agent's tool returned against its planned restore (the ``tool_return`` label): early
(before the KV was back), on_time, late (the KV back and idle in HBM past the revisit time); see the
module docstring."""

MAX_PLANS = 10_000
"""Most agents whose tool-wait plan is remembered (oldest dropped first: an agent that never came back)."""

_PLANNED, _RESTORING, _LANDED, _MISSED = "planned", "restoring", "landed", "missed"


@dataclass
class ToolWaitPlan:
    """One agent's tool wait as decided at tool start (monotonic seconds).

    ``state`` (SWAP only): ``planned`` (the restore is not due or found no room yet), ``restoring`` (handed
    to the loop), ``landed`` (parked again, warm), ``missed`` (the copy could not be loaded: the turn
    restores or recomputes it at admission).
    """

    agent_id: str
    tool: str
    """The tool's metric label (the caller bounds it)."""
    decision: Decision
    started_at: float
    expected_return_at: float
    revisit_at: float
    """When the tool counts as late (``started_at + revisit_at_s``: wait + grace)."""
    restore_at: float | None = None
    """SWAP: when the restore is due (``started_at + restore_at_s``)."""
    transfer_s: float = 0.0
    req: Request | None = None
    """SWAP: the agent's parked step, released; the copy is loaded back into it."""
    key: str = ""
    tokens: int = 0
    kv_bytes: int = 0
    state: str = _PLANNED
    claimed: bool = False
    """The agent's next turn arrived while the restore was in flight (the copy is left for that turn)."""
    counted_late: bool = False


@dataclass
class ToolWaitPlans:
    """The tool-wait plans by agent, and the per-tool counts of their outcomes.

    Counts (each only grows; keys ``(tool, label)``): ``decisions`` by decision, ``resumes`` by
    :data:`RESUME_KINDS`, ``prefetches`` by :data:`PREFETCH_TIMINGS`. The scheduler owns one and its
    clock; nothing here reads a clock.
    """

    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    resumes: Counter[tuple[str, str]] = field(default_factory=Counter)
    prefetches: Counter[tuple[str, str]] = field(default_factory=Counter)
    _plans: OrderedDict[str, ToolWaitPlan] = field(default_factory=OrderedDict)
    _in_flight: dict[int, ToolWaitPlan] = field(default_factory=dict)  # id(plan.req) -> its plan

    def add(self, plan: ToolWaitPlan) -> None:
        """``plan`` replaces any earlier plan of its agent; counted under its tool and decision."""
        self._plans.pop(plan.agent_id, None)
        self._plans[plan.agent_id] = plan
        self.decisions[(plan.tool, plan.decision.value)] += 1
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)

    def get(self, agent_id: str) -> ToolWaitPlan | None:
        return self._plans.get(agent_id)

    @property
    def next_restore_at(self) -> float:
        """The earliest due time of a restore not yet started (monotonic seconds; inf: none)."""
        return self.next_restore_after(float("-inf"))

    def next_restore_after(self, now: float) -> float:
        """The earliest due time after ``now`` of a restore not yet started (monotonic seconds; inf: none).
        Restores due by ``now`` that have not started (no room in the KV budget yet) are left out: they
        start at a decision that finds room, and must not hide a later one's due time."""
        return min((p.restore_at for p in self._plans.values()
                    if p.state == _PLANNED and p.restore_at is not None and p.restore_at > now),
                   default=float("inf"))

    def due(self, now: float) -> list[ToolWaitPlan]:
        """Plans whose restore is due at ``now`` and not started, earliest first; and a landed restore still
        unclaimed past its revisit time is counted, its tool ``late`` (once)."""
        due = []
        for plan in self._plans.values():
            if plan.state == _PLANNED and plan.restore_at is not None and plan.restore_at <= now:
                due.append(plan)
            elif plan.state == _LANDED and not plan.counted_late and now > plan.revisit_at:
                plan.counted_late = True
                self.prefetches[(plan.tool, "late")] += 1
        return sorted(due, key=lambda p: p.restore_at or 0.0)

    def started(self, plan: ToolWaitPlan) -> None:
        """``plan``'s restore was handed to the loop."""
        plan.state = _RESTORING
        self._in_flight[id(plan.req)] = plan

    def in_flight(self, req: Request) -> ToolWaitPlan | None:
        """The plan whose restore into ``req`` is in flight (None: none)."""
        return self._in_flight.get(id(req))

    def finished(self, plan: ToolWaitPlan, landed: bool) -> None:
        """``plan``'s restore ended: ``landed`` (parked again, warm) or not (a miss; the turn restores)."""
        self._in_flight.pop(id(plan.req), None)
        plan.state = _LANDED if landed else _MISSED

    def on_turn(self, agent_id: str, now: float, warm: bool) -> ToolWaitPlan | None:
        """The agent's next turn arrived at ``now``, its prefix ``warm`` in HBM or not: its plan ends, the
        resume and (SWAP) the prefetch's timing are counted. Returns the plan (None when it had none)."""
        plan = self._plans.pop(agent_id, None)
        if plan is None:
            return None
        self.resumes[(plan.tool, "warm" if warm else "cold")] += 1
        if plan.restore_at is not None:  # a swap whose copy went to DRAM: its restore was planned
            if plan.state == _LANDED:
                if not plan.counted_late:
                    self.prefetches[(plan.tool, "on_time" if now <= plan.revisit_at else "late")] += 1
            else:  # the turn came before the copy was back (or it could not be loaded): restored at admission
                self.prefetches[(plan.tool, "early")] += 1
                if plan.state == _RESTORING:
                    plan.claimed = True
        return plan

    def __len__(self) -> int:
        return len(self._plans)
