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
before the copy out has ended), so the next turn would find it warm. The
dispatcher does not restore ahead yet: the tiers load a DRAM copy into a
running request only, so the copy comes back when the agent's next step is
admitted (the step loop's restore before that step's prefill), and that step
waits one transfer for it (what :func:`on_return` prices for an early return). A tool that
returns early finds it in DRAM (or still leaving): the restore runs at once
and the turn waits for the rest of the copy (:func:`on_return`). A tool that
is late is revisited at ``wait + grace`` (:attr:`ToolWaitDecision.revisit_at_s`):
the decision is taken again with the tool's residual wait, taken to be as long
again as it has already run (:func:`residual_wait_s`: the mean residual life
of a heavy-tailed, Pareto-like duration grows in proportion to its age).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
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
