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
    drop  = recompute x max(1, cold_resume_weight)

- ``wait``: the tool's expected duration (seconds).
- ``share``: the KV's part of the HBM KV budget (``kv_bytes / budget_bytes``).
- ``pressure``: the part of the budget in use now (running and parked KV,
  0..1). Held idle memory costs the work it keeps out: at full pressure,
  holding a share ``s`` of the budget for ``w`` seconds keeps about ``s x w``
  engine-seconds of other work waiting; at low pressure it costs little, but
  never nothing (``idle_price_floor``, ``scheduler.tool_wait_idle_price_floor``):
  memory idle now is memory a burst cannot have, and the pressure at the
  decision says little of the pressure while a long tool's KV is held later.
- ``transfer``: one-way copy seconds. A swap copies out and back, on the copy
  engine beside compute: it is charged ``copy_cost_weight`` of its time
  (default 0.1: the link is shared with other swaps, not with the GPU's
  compute), plus the stall the next turn sees when the round trip and the
  ``margin`` do not fit in the wait.
- ``recompute``: the engine's prefill of the prefix, spent again at resume
  (on the GPU and on the agent's path), weighed as a cold resume's stall is
  (``cold_resume_weight``, below).

Once the tool has :data:`MIN_RETURNS` measured returns
(:meth:`ToolWaitPlans.return_times`: the dispatcher's own record, per tool,
of how long each call took from its announcement to its agent's next turn,
as a ratio to the announced wait, scaled to this call's; the calls still
running count too, as returns not seen yet: the Kaplan-Meier estimate, below),
``wait`` in keep is their mean, and swap's stall term is the price of the best restore
timing over them (:func:`restore_landing_s`): the KV held idle from its
landing to the turn (``share x pressure`` a second) against the turns that
come back before it and wait for their restore at admission
(``cold_resume_weight x transfer`` each: that restore runs in front of a
step, so the batch waits too). The critical landing time is a newsvendor's:
where the return-time hazard meets the hold price over the cold price. A
short tool is so kept; a long one lands late, or not ahead at all, as the
weight says (``scheduler.tool_wait_cold_resume_weight``).

A swap plans the KV's return ahead of the tool's expected return
(:attr:`ToolWaitDecision.restore_at_s` = ``landing - transfer - margin``, the
landing :func:`restore_landing_s`'s, or ``wait`` while fewer than
:data:`MIN_RETURNS` are measured, unless a call of the same tool has already run
past this one's revisit time, when none is timed by an announcement evidently short
(:attr:`ToolWaitInputs.outlasted_s`); never before the copy out has ended), so the
next turn finds it warm: the scheduler
keeps each agent's plan (:class:`ToolWaitPlans`) and its decision at
``schedule(now)`` hands the restores that are due to the loop
(``SchedulerOutput.prefetch``), which loads the DRAM copy back into the
agent's parked step and hands it back (``SchedulerCore.prefetched``): the
agent is parked again, warm, and its next step takes the prefix over as from
any parked step (the prefetch of KVFlow, Pan et al. 2025, timed here by the
tool's measured duration instead of a workflow graph). A restore is started
only when the KV budget has room for it (due restores take the free room
before the decision's admissions, unless waiting work of a higher class than
the agent's is there; the bytes of a restore in flight are held in the budget
until it lands); one that cannot start waits for room or for the turn.

The decision is the announcement's: a step that ended in a tool call parks
undecided, and the announcement follows it (the orchestrator reads the tool
call from the step's last chunk, then sends ToolWait: milliseconds later, and
the step loop decides in between). For ``scheduler.tool_wait_announce_hold_s``
after parking (once this dispatcher has had an announcement at all), that
undecided KV is not evicted to make room for waiting work: evicted, it would
go to DRAM by the parking's rules with no restore planned ahead, and the
announcement would find nothing to decide.

A landed restore, and a kept KV, is not evicted to make room for waiting work
until its revisit time (``SchedulerCore._make_room``): its turn is expected by
then and will need that prefix; evicting it would spend the round trip for a
cold resume. The bound is the revisit time (the measured returns' P95,
:data:`REVISIT_QUANTILE`, or ``wait + grace``); then the KV leaves HBM under
the parking's expiry. The emergency HBM scan still evicts it.

Early and late returns:

- A tool that returns *early* (its next turn arrives before the copy is back,
  or before its restore was due) has its copy restored at once, at its
  admission (the step loop's restore before that step's prefill), and the turn
  waits for the transfer (what :func:`on_return` prices): a cold resume, the
  prefetch counted ``early``.
- A tool that returns *late* finds its KV restored and parked until the
  tool's revisit time (the returns' P95, or ``wait + grace``): if it is still
  parked at the turn, a warm resume; past it the KV leaves HBM (to DRAM
  where cheaper) and the turn restores it at admission. A prefetch whose KV
  is still unclaimed at the revisit time is counted ``late`` (it sat idle in
  HBM past the tool's expected return and its grace).
- Otherwise the KV landed before the turn, and the turn came by the revisit
  time: ``on_time``.

Every resume of an agent that had a tool-wait decision is counted per tool,
by :data:`RESUME_KINDS`: ``warm`` (its prefix still in HBM), ``restored``
(its copy in the DRAM tier, brought back at admission) or ``cold`` (no state
known here: recomputed) (:class:`ToolWaitPlans`; exported as
``switchyard_tool_resumes_total{tool,resume}``, with the decisions as
``switchyard_tool_wait_decisions_by_tool_total{tool,decision}`` and the
prefetches by the tool's return as ``switchyard_tool_wait_prefetches_total{tool,tool_return}``).

The calls of a tool still running are evidence as well: a distribution learned
from the returns alone is biased short whenever the calls that returned are
the quick ones of their start (every start of a load, every slowdown of the
tool: the first returns measured are the first to come back). The
distribution is the Kaplan-Meier estimate (Kaplan and Meier 1958), computed
as Efron's redistribution to the right (1967): each running call, right-
censored at its elapsed time, hands its probability to the measured returns
beyond it; one running longer than every measured return is taken to return
after as long again as it has run, at least the announced wait
(:func:`residual_wait_s`), and a call running :data:`ABANDONED_RATIO` times
its announced wait is taken as abandoned (its agent gone) and left out.

KEEP holds the KV until the revisit time: ``wait + grace`` while fewer than
:data:`MIN_RETURNS` returns are measured (the grace is as long again as the wait:
:func:`residual_wait_s`, the mean residual life of a heavy-tailed, Pareto-like
duration grows in proportion to its age), else the measured returns' P95
(:data:`REVISIT_QUANTILE`, at least a round trip); then the parking TTL's expiry
moves it out.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from switchyard.common.metrics import TOOL_NAMES, bounded
from switchyard.dispatcher.request import Request

__all__ = [
    "PREFETCH_TIMINGS",
    "RESUME_KINDS",
    "Returns",
    "ToolWaitPlan",
    "ToolWaitPlans",
    "Decision",
    "ToolWaitCosts",
    "ToolWaitDecision",
    "ToolWaitInputs",
    "decide",
    "on_return",
    "residual_wait_s",
    "restore_landing_s",
]


class Decision(str, enum.Enum):
    """Where an agent's KV goes for its tool wait (the ``decision`` label of the tool-wait metrics)."""

    KEEP = "keep"
    SWAP = "swap"
    DROP = "drop"


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
    idle_price_floor: float
    """The least pressure held idle memory is priced at (``scheduler.tool_wait_idle_price_floor``: the config's
    default is the one default)."""
    cold_resume_weight: float
    """Engine-seconds one second of a cold resume's restore stall costs (``scheduler.tool_wait_cold_resume_weight``:
    the config's default is the one default)."""
    can_swap: bool = True
    """A DRAM tier is there, reachable, and the engine can export its KV."""
    margin_s: float = 0.05
    """Seconds the restore is planned to end ahead of the tool's expected return."""
    copy_cost_weight: float = 0.1
    returns_s: tuple[float, ...] = ()
    """The tool's measured return times for this wait, seconds after its start, ascending (the learned
    distribution: :meth:`ToolWaitPlans.return_times`); empty: too few measured, the restore is timed by
    ``expected_wait_s`` alone."""
    return_weights: tuple[float, ...] = ()
    """The probability of each of ``returns_s`` (the same length, summing to 1: the Kaplan-Meier masses of
    :meth:`ToolWaitPlans.return_times`); empty: each equally likely."""
    outlasted_s: float = 0.0
    """How long the longest-running call of the same tool has run, seconds (0: none runs; an abandoned one,
    :meth:`ToolWaitPlans.longest_running_s`, does not count). With fewer than
    :data:`MIN_RETURNS` returns measured, one running past this call's revisit time (``expected_wait_s + grace``)
    says the announced wait is short: no restore is timed by it (:func:`decide`)."""

    def __post_init__(self) -> None:
        for name, value in (("expected_wait_s", self.expected_wait_s), ("transfer_s", self.transfer_s),
                            ("recompute_s", self.recompute_s), ("margin_s", self.margin_s),
                            ("copy_cost_weight", self.copy_cost_weight),
                            ("cold_resume_weight", self.cold_resume_weight), ("outlasted_s", self.outlasted_s)):
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
        if any(b < a for a, b in zip(self.returns_s, self.returns_s[1:])) or any(r < 0 for r in self.returns_s):
            raise ValueError("returns_s: expected ascending seconds >= 0")
        if self.return_weights and (len(self.return_weights) != len(self.returns_s)
                                    or any(w < 0 for w in self.return_weights)
                                    or not math.isclose(sum(self.return_weights), 1.0, rel_tol=1e-6)):
            raise ValueError("return_weights: expected one probability >= 0 per return in returns_s, summing to 1")

    @property
    def weights(self) -> tuple[float, ...]:
        """Each return's probability (``return_weights``, or equal)."""
        n = len(self.returns_s)
        return self.return_weights or (1.0 / n,) * n


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
    """SWAP: when the restore starts, at least ``transfer`` (the copy out has ended): ``wait - transfer -
    margin`` while fewer than :data:`MIN_RETURNS` returns are measured, else ``landing - transfer - margin``
    (:func:`restore_landing_s`'s landing). None for KEEP and DROP, and for a SWAP whose cheapest plan is no
    restore ahead of the turn (the turn restores at admission)."""
    revisit_at_s: float
    """When a tool still running counts as late, and a kept or landed KV stops being protected from eviction
    for waiting work: ``wait + grace`` while fewer than :data:`MIN_RETURNS` returns are measured, else their
    :data:`REVISIT_QUANTILE` quantile (at least a round trip, and at least a planned restore's landing)."""
    costs: ToolWaitCosts
    transfer_s: float = 0.0
    """One-way HBM<->DRAM copy seconds of the KV (``ToolWaitInputs.transfer_s``)."""

    @property
    def warm_at_s(self) -> float | None:
        """SWAP: when the planned restore has brought the KV back (``restore_at_s + transfer_s``); else None."""
        return None if self.restore_at_s is None else self.restore_at_s + self.transfer_s


def costs(inputs: ToolWaitInputs) -> ToolWaitCosts:
    """Each option's price (the module docstring's cost model; with the tool's measured returns, keep is
    priced over their mean and swap's stall term is the cheapest restore timing's, :func:`restore_landing_s`)."""
    share = inputs.kv_bytes / inputs.budget_bytes
    pressure = min(1.0, max(inputs.pressure, inputs.idle_price_floor))
    measured = len(inputs.returns_s) >= MIN_RETURNS
    wait = (sum(r * w for r, w in zip(inputs.returns_s, inputs.weights)) if measured
            else inputs.expected_wait_s)
    keep = wait * share * pressure
    round_trip = 2 * inputs.transfer_s
    if inputs.can_swap and inputs.kv_bytes > 0:
        stall = (_landing(inputs)[1] if measured
                 else max(0.0, round_trip + inputs.margin_s - inputs.expected_wait_s))
        swap = inputs.copy_cost_weight * round_trip + stall
    else:
        swap = float("inf")
    return ToolWaitCosts(keep=keep, swap=swap, drop=inputs.recompute_s * max(1.0, inputs.cold_resume_weight))


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
    measured = len(inputs.returns_s) >= MIN_RETURNS
    revisit = (max(_quantile(inputs.returns_s, inputs.weights, REVISIT_QUANTILE), 2 * inputs.transfer_s) if measured
               else inputs.expected_wait_s + grace_s)
    if decision is Decision.SWAP:
        if measured:
            landing = restore_landing_s(inputs)
            if landing is not None:
                restore_at = max(inputs.transfer_s, landing - inputs.transfer_s - inputs.margin_s)
                revisit = max(revisit, restore_at + inputs.transfer_s)
        elif inputs.outlasted_s <= revisit:  # else a call of this tool already ran past this one's revisit time
            restore_at = max(inputs.transfer_s, inputs.expected_wait_s - inputs.transfer_s - inputs.margin_s)
    return ToolWaitDecision(decision, restore_at, revisit, priced, inputs.transfer_s)


MIN_RETURNS = 8
"""Measured returns of a tool before its restores are timed by their distribution (:func:`restore_landing_s`)."""

REVISIT_QUANTILE = 0.95
"""With a measured distribution, a tool counts as late past this quantile of its return times (the revisit
time): a kept or restored KV is protected from eviction for waiting work until then, and leaves HBM after."""


def _quantile(ordered: tuple[float, ...], weights: tuple[float, ...], q: float) -> float:
    """Nearest-rank ``q`` quantile of the ascending ``ordered`` (not empty), each value of probability
    ``weights``: the first whose cumulative probability reaches ``q``."""
    total = 0.0
    for value, weight in zip(ordered, weights):
        total += weight
        if total >= q - 1e-9:
            return value
    return ordered[-1]


def restore_landing_s(inputs: ToolWaitInputs) -> float | None:
    """When a swapped agent's KV should be back in HBM (seconds after the tool started), from the tool's
    measured return times; None: not ahead of the turn at all (the turn restores at admission).

    Each candidate landing time ``x`` (a measured return time; the earliest possible is two transfers,
    out and back) is priced in engine-seconds, as :func:`costs` prices keeping::

        hold(x) = share x max(pressure, idle_price_floor) x E[(return - x)+]
        cold(x) = cold_resume_weight x transfer x P(return < x)

    (expectation and probability over the returns' weights, :attr:`ToolWaitInputs.weights`)

    the KV held idle from its landing to the turn, against the turns that come back before it and wait
    for their restore at admission (a newsvendor trade-off: the critical landing time is where the
    return-time hazard meets hold price / cold price). Not restoring ahead costs ``cold(inf)`` =
    ``cold_resume_weight x transfer``. The cheapest wins (among equals the earliest landing; restoring
    ahead only when it is strictly cheaper than not).
    """
    return _landing(inputs)[0]


def _landing(inputs: ToolWaitInputs) -> tuple[float | None, float]:
    """(:func:`restore_landing_s`'s landing time, its price in engine-seconds)."""
    returns, weights = inputs.returns_s, inputs.weights
    share = inputs.kv_bytes / inputs.budget_bytes
    hold = share * min(1.0, max(inputs.pressure, inputs.idle_price_floor))
    cold = inputs.cold_resume_weight * inputs.transfer_s
    earliest = 2 * inputs.transfer_s
    best, best_cost = None, cold  # never ahead: every turn restores at admission
    tail = sum(r * w for r, w in zip(returns, weights))  # E[return; return >= x]
    right = 1.0  # P(return >= x)
    for k, x in enumerate(returns):  # x = returns[k]; returns[:k] come back before it (cold)
        if k:
            tail -= returns[k - 1] * weights[k - 1]
            right -= weights[k - 1]
        at = max(x, earliest)
        cost = hold * max(0.0, tail - right * at) + cold * max(0.0, 1.0 - right)
        if cost < best_cost:
            best, best_cost = at, cost
    return best, best_cost


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


RESUME_KINDS: tuple[str, ...] = ("warm", "restored", "cold")
"""How an agent back from a tool found its prefix, the ``resume`` label of ``switchyard_tool_resumes_total`` and
``switchyard_resumes_total`` (its one bounded set: the latter adds ``preempted``, :data:`.base.SEQUENCE_RESUME_KINDS`):
``warm`` (still in HBM: kept, or restored ahead of the turn), ``restored`` (its copy in the DRAM tier, brought back
at admission), ``cold`` (no state known here: recomputed, or a copy another replica parked, found at admission)."""

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

    program_key: str
    """The waiting task's key (``Request.program_key``: its tenant's, agent's and own id)."""
    tool: str
    """The tool's name as announced: the key its measured returns are kept under."""
    decision: Decision
    started_at: float
    expected_return_at: float
    revisit_at: float
    """When the tool counts as late (``started_at + revisit_at_s``: :attr:`ToolWaitDecision.revisit_at_s`)."""
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

    @property
    def label(self) -> str:
        """The ``tool`` label of the per-tool counts: the name when it is one of the orchestrator's
        registered tools (:data:`~switchyard.common.metrics.TOOL_NAMES`), else ``other`` (a bounded set,
        whatever a caller announces)."""
        return bounded(self.tool, TOOL_NAMES)


RETURNS_KEPT = 128
"""Measured returns kept per tool (newest): the distribution restores are timed by."""

MAX_TOOLS = 256
"""Most tools whose returns are measured (the least recently returned dropped first): a caller may announce
any name, and the measured returns of tools it stopped using are not kept for ever."""

SIMILAR_ANNOUNCEMENT = 2.0
"""A measured return informs a new call's timing when their announced waits are within this factor."""

ABANDONED_RATIO = 10.0
"""A call still running this many times its announced wait counts as abandoned (its agent gone, its task
cancelled mid-tool): it is no longer evidence of the tool's return times."""

MAX_CENSORED = 1024
"""Most running calls of one tool that inform a new call's timing (the longest running: they carry what the
returns do not show), so that a decision's cost stays bounded however many agents wait on one tool."""


def _abandoned(plan: ToolWaitPlan, now: float, expected_wait_s: float) -> bool:
    """``plan``'s call, still open at ``now``, has run :data:`ABANDONED_RATIO` times the longer of its own
    announced wait and ``expected_wait_s`` (a new call's): no longer evidence of how long the tool takes."""
    return now - plan.started_at >= ABANDONED_RATIO * max(plan.expected_return_at - plan.started_at, expected_wait_s)


class Returns(NamedTuple):
    """A tool's return-time distribution for one call: ``times`` (seconds after its start, ascending) and
    the probability of each (``weights``, summing to 1); both empty while too few are measured."""

    times: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()


def kaplan_meier(returned: list[float], running: list[float]) -> Returns:
    """The return-time distribution from the calls that ``returned`` (their return times) and the calls still
    ``running`` (their elapsed times, right-censored): Kaplan and Meier's product-limit estimate (1958), as
    Efron's redistribution to the right (1967) computes it. Each running call's probability goes, in equal
    shares, to the calls (returned or running) beyond it; one with no return measured beyond it is taken
    to return after as long again as it has run (:func:`residual_wait_s`, against an announced wait of
    1: ``returned`` and ``running`` are ratios to the announced wait). Ties: a return before a running call.

    Returns:
        the distinct return times, ascending, and their probabilities; empty when ``returned`` is.
    """
    if not returned:
        return Returns()
    last = max(returned)
    events = [(r, 0) for r in returned]
    for c in running:
        if c <= last:
            events.append((c, 1))  # censored: its probability goes to what lies beyond it
        else:  # beyond every measured return: as long again as it has run (at least the announced wait)
            events.append((c + residual_wait_s(c, 1.0), 0))
    events.sort()
    mass: dict[float, float] = {}
    carried, left = 0.0, len(events)  # probability handed right, per call still ahead
    for t, censored in events:
        share = 1.0 + carried
        left -= 1
        if censored:
            carried += share / left if left else 0.0  # a censored call ahead of a return always has one
        else:
            mass[t] = mass.get(t, 0.0) + share
    total = sum(mass.values())
    times = tuple(sorted(mass))
    return Returns(times, tuple(mass[t] / total for t in times))


@dataclass
class ToolWaitPlans:
    """The tool-wait plans by agent, the per-tool counts of their outcomes, and each tool's measured returns.

    Counts (each only grows; keys ``(tool label, outcome)``, the label :attr:`ToolWaitPlan.label`, a bounded
    set): ``decisions`` by decision, ``resumes`` by :data:`RESUME_KINDS`, ``prefetches`` by
    :data:`PREFETCH_TIMINGS`. The scheduler owns one and its clock; nothing here reads a clock.

    Returns: each plan that ends with its agent's turn (:meth:`on_turn`) adds, under its tool's own name
    (not its label: two tools outside the registered ones are measured apart), how long the tool took
    against what was announced (``(turn - start) / expected wait``, a ratio, so that an estimate that moves
    still gives one distribution); the last :data:`RETURNS_KEPT` per tool, for the :data:`MAX_TOOLS` tools
    that returned last. :meth:`return_times` scales them by a new call's announced wait.

    Due restores are kept in a heap by due time (and landed ones by revisit time), so a decision's
    :meth:`due` costs O(log plans) per plan that falls due, not a scan of every plan.
    """

    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    resumes: Counter[tuple[str, str]] = field(default_factory=Counter)
    prefetches: Counter[tuple[str, str]] = field(default_factory=Counter)
    _plans: OrderedDict[str, ToolWaitPlan] = field(default_factory=OrderedDict)
    _in_flight: dict[int, ToolWaitPlan] = field(default_factory=dict)  # id(plan.req) -> its plan
    _restores: list[tuple[float, int, ToolWaitPlan]] = field(default_factory=list)  # heap: (restore_at, n, plan)
    _overdue: list[ToolWaitPlan] = field(default_factory=list)  # due, not started (no room yet): by restore_at
    _landed: list[tuple[float, int, ToolWaitPlan]] = field(default_factory=list)  # heap: (revisit_at, n, plan)
    _returns: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)  # tool name -> (announced s, ratio)
    _open: dict[str, dict[str, ToolWaitPlan]] = field(default_factory=dict)  # tool name -> agent -> its running call
    _order: itertools.count = field(default_factory=itertools.count)

    def add(self, plan: ToolWaitPlan) -> None:
        """``plan`` replaces any earlier plan of its agent; counted under its tool and decision."""
        self._close(self._plans.pop(plan.program_key, None))
        self._plans[plan.program_key] = plan
        self._open.setdefault(plan.tool, {})[plan.program_key] = plan
        self.decisions[(plan.label, plan.decision.value)] += 1
        while len(self._plans) > MAX_PLANS:
            self._close(self._plans.popitem(last=False)[1])
        if plan.state == _PLANNED and plan.restore_at is not None:
            heapq.heappush(self._restores, (plan.restore_at, next(self._order), plan))

    def get(self, program_key: str) -> ToolWaitPlan | None:
        return self._plans.get(program_key)

    def _close(self, plan: ToolWaitPlan | None) -> None:
        """``plan``'s call no longer runs (its turn came, or the plan was replaced or dropped)."""
        if plan is None:
            return
        running = self._open.get(plan.tool)
        if running is not None and running.get(plan.program_key) is plan:
            del running[plan.program_key]
            if not running:
                del self._open[plan.tool]

    def _pending(self, plan: ToolWaitPlan) -> bool:
        """``plan``'s restore is still to start: it is its agent's plan and planned."""
        return plan.state == _PLANNED and plan.restore_at is not None and self._plans.get(plan.program_key) is plan

    def _fall_due(self, now: float) -> None:
        """Move the plans due by ``now`` from the heap to the overdue list (stale heap entries dropped)."""
        heap = self._restores
        moved = False
        while heap and (heap[0][0] <= now or not self._pending(heap[0][2])):
            _, _, plan = heapq.heappop(heap)
            if self._pending(plan):
                self._overdue.append(plan)
                moved = True
        if moved:
            self._overdue.sort(key=lambda p: p.restore_at or 0.0)

    @property
    def next_restore_at(self) -> float:
        """The earliest due time of a restore not yet started (monotonic seconds; inf: none)."""
        self._overdue = [p for p in self._overdue if self._pending(p)]
        if self._overdue:
            return self._overdue[0].restore_at or 0.0
        return self.next_restore_after(float("-inf"))

    def next_restore_after(self, now: float) -> float:
        """The earliest due time after ``now`` of a restore not yet started (monotonic seconds; inf: none).
        Restores due by ``now`` that have not started (no room in the KV budget yet) are left out: they
        start at a decision that finds room, and must not hide a later one's due time."""
        self._fall_due(now)
        return self._restores[0][0] if self._restores else float("inf")

    def due(self, now: float) -> list[ToolWaitPlan]:
        """Plans whose restore is due at ``now`` and not started, earliest first; and a landed restore still
        unclaimed past its revisit time is counted, its tool ``late`` (once)."""
        self._fall_due(now)
        self._overdue = [p for p in self._overdue if self._pending(p)]
        landed = self._landed
        while landed and landed[0][0] < now:
            _, _, plan = heapq.heappop(landed)
            if plan.state == _LANDED and not plan.counted_late and self._plans.get(plan.program_key) is plan:
                plan.counted_late = True
                self.prefetches[(plan.label, "late")] += 1
        return list(self._overdue)

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
        if landed:
            heapq.heappush(self._landed, (plan.revisit_at, next(self._order), plan))

    def abandon(self, program_key: str) -> ToolWaitPlan | None:
        """The agent's task ended without its turn (its next step refused): its plan ends, counted nowhere
        and measured nowhere (a refused turn says nothing of the tool's return time), and its call stops
        counting as running. A restore in flight for it does not land (:meth:`SchedulerCore.prefetched`
        finds the plan gone). Returns the plan (None when it had none)."""
        plan = self._plans.pop(program_key, None)
        self._close(plan)
        return plan

    def on_turn(self, program_key: str, now: float, resume: str) -> ToolWaitPlan | None:
        """The agent's next turn arrived at ``now``, finding its prefix as ``resume`` says (one of
        :data:`RESUME_KINDS`): its plan ends, the resume and (SWAP) the prefetch's timing are counted, and the
        tool's return is measured. Returns the plan (None when it had none)."""
        plan = self._plans.pop(program_key, None)
        if plan is None:
            return None
        self._close(plan)
        self.resumes[(plan.label, resume)] += 1
        expected = plan.expected_return_at - plan.started_at
        if expected > 0 and now >= plan.started_at:
            kept = self._returns.pop(plan.tool, None)
            if kept is None:
                kept = deque(maxlen=RETURNS_KEPT)
            self._returns[plan.tool] = kept  # the most recently returned last
            while len(self._returns) > MAX_TOOLS:
                del self._returns[next(iter(self._returns))]
            kept.append((expected, (now - plan.started_at) / expected))
        if plan.restore_at is not None:  # a swap whose copy went to DRAM: its restore was planned
            if plan.state == _LANDED:
                if not plan.counted_late:
                    self.prefetches[(plan.label, "on_time" if now <= plan.revisit_at else "late")] += 1
            else:  # the turn came before the copy was back (or it could not be loaded): restored at admission
                self.prefetches[(plan.label, "early")] += 1
                if plan.state == _RESTORING:
                    plan.claimed = True
        return plan

    def protected_until(self, program_key: str, req: Request) -> float | None:
        """When the protection of ``program_key``'s restored KV (its parked step ``req``, landed by a planned
        restore) from eviction for waiting work ends: its plan's revisit time (monotonic seconds); None when
        that step is not a landed restore of the agent's current plan."""
        plan = self._plans.get(program_key)
        if plan is None:
            return None
        if plan.decision is Decision.KEEP or (plan.state == _LANDED and plan.req is req):
            return plan.revisit_at
        return None

    def return_times(self, tool: str, expected_wait_s: float, now: float | None = None) -> Returns:
        """``tool``'s return-time distribution scaled to a call announced at ``expected_wait_s`` (seconds
        after its start), from the calls announced within a factor of :data:`SIMILAR_ANNOUNCEMENT` of it
        (each return's ratio to its own announcement, times this one's): the measured returns and, given
        ``now``, the calls still running (the Kaplan-Meier estimate, :func:`kaplan_meier`: those running longer
        than the returns measured so far are what a distribution of the returns alone leaves out; at most
        :data:`MAX_CENSORED`, the longest running, each under :data:`ABANDONED_RATIO` times its announced
        wait).

        While fewer than :data:`MIN_RETURNS` were announced alike, every measured return counts by its duration
        in seconds, and every call still running by its elapsed seconds (abandoned past
        :data:`ABANDONED_RATIO` times the longer of its announcement and this one): a tool's first calls are
        announced on the orchestrator's cold estimate, and the next ones on a quantile of those first returns,
        so none of them was announced alike, yet their durations are the tool's (a 15 s batch job's first wave,
        announced at 1 s, timed every call of its second wave by the announcement alone; and its calls still
        running at 10x the 1 s counted as abandoned, so that the returns measured were its quick half). Empty
        while fewer than :data:`MIN_RETURNS` returns are measured in all."""
        kept = self._returns.get(tool)
        if kept is None or expected_wait_s <= 0:
            return Returns()
        low, high = expected_wait_s / SIMILAR_ANNOUNCEMENT, expected_wait_s * SIMILAR_ANNOUNCEMENT
        returned = [ratio for announced, ratio in kept if low <= announced <= high]
        similar = len(returned) >= MIN_RETURNS
        if not similar:  # too few announced alike: the tool's own durations, in seconds, scaled to this call
            if len(kept) < MIN_RETURNS:
                return Returns()
            returned = [announced * ratio / expected_wait_s for announced, ratio in kept]
        running: list[float] = []
        if now is not None:
            for plan in self._open.get(tool, {}).values():
                announced = plan.expected_return_at - plan.started_at
                elapsed = now - plan.started_at
                if similar:
                    if low <= announced <= high and 0 < (ratio := elapsed / announced) < ABANDONED_RATIO:
                        running.append(ratio)
                elif 0 < elapsed and not _abandoned(plan, now, expected_wait_s):
                    running.append(elapsed / expected_wait_s)
            if len(running) > MAX_CENSORED:
                running = heapq.nlargest(MAX_CENSORED, running)
        times, weights = kaplan_meier(returned, running)
        return Returns(tuple(t * expected_wait_s for t in times), weights)

    def longest_running_s(self, tool: str, now: float, expected_wait_s: float) -> float:
        """How long the longest-running open call of ``tool`` has run at ``now``, seconds (0: none runs), for a
        new call announced at ``expected_wait_s``; a call abandoned by :data:`ABANDONED_RATIO` times the longer
        of its announcement and this one (as :meth:`return_times` counts running calls without returns announced
        alike) is left out: an agent gone without its turn or its task's end keeps its plan open until
        :data:`MAX_PLANS` later ones, and would otherwise outlast every announcement of its tool."""
        return max((now - plan.started_at for plan in self._open.get(tool, {}).values()
                    if not _abandoned(plan, now, expected_wait_s)), default=0.0)

    def __len__(self) -> int:
        return len(self._plans)
