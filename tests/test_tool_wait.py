"""The tool-start decision: keep, swap or drop, and the restore ahead of the return (scheduler.tool_wait)."""

from __future__ import annotations

import pytest

from switchyard.dispatcher.scheduler.tool_wait import (
    Decision,
    ToolWaitInputs,
    decide,
    on_return,
    residual_wait_s,
)

GB = 1_000_000_000


def inputs(**kw):
    base = dict(expected_wait_s=5.0, kv_bytes=1 * GB, budget_bytes=60 * GB, pressure=0.5, transfer_s=0.02,
                recompute_s=0.3)
    base.update(kw)
    return ToolWaitInputs(**base)


def test_short_wait_keeps_the_kv():
    # the round trip (40 ms + 50 ms margin) does not fit in a 60 ms wait: the turn would stall
    out = decide(inputs(expected_wait_s=0.06))
    assert out.decision is Decision.KEEP
    assert out.restore_at_s is None and out.warm_at_s is None


def test_long_wait_swaps_and_restores_ahead_of_the_return():
    out = decide(inputs(expected_wait_s=5.0), grace_s=1.0)
    assert out.decision is Decision.SWAP
    assert out.restore_at_s == pytest.approx(5.0 - 0.02 - 0.05)
    assert out.warm_at_s == pytest.approx(5.0 - 0.05)  # back the margin ahead of the expected return
    assert out.revisit_at_s == 6.0
    assert out.costs.swap < out.costs.keep < out.costs.drop


def test_without_a_dram_tier_a_long_wait_under_pressure_drops():
    out = decide(inputs(expected_wait_s=60.0, pressure=1.0, kv_bytes=20 * GB, can_swap=False))
    assert out.decision is Decision.DROP
    assert out.costs.swap == float("inf")


def test_cheap_recompute_drops_rather_than_swapping():
    out = decide(inputs(expected_wait_s=0.5, recompute_s=0.001, transfer_s=0.1))
    assert out.decision is Decision.DROP


def test_pressure_raises_the_price_of_keeping():
    low = decide(inputs(pressure=0.0)).costs.keep
    high = decide(inputs(pressure=1.0)).costs.keep
    assert high == pytest.approx(4 * low)  # the idle price floor (0.25) at no pressure


def test_restore_never_starts_before_the_copy_out_ends():
    full = dict(kv_bytes=30 * GB, pressure=1.0, transfer_s=0.12, recompute_s=5.0, margin_s=0.0)
    out = decide(inputs(expected_wait_s=0.3, **full))
    assert out.decision is Decision.SWAP
    assert out.restore_at_s == pytest.approx(0.18)
    out = decide(inputs(expected_wait_s=0.2, **full))  # shorter than the round trip: the turn stalls a little
    assert out.decision is Decision.SWAP
    assert out.restore_at_s == pytest.approx(0.12)
    assert out.warm_at_s == pytest.approx(0.24)  # one round trip after the start: past the expected return


def test_return_on_time_early_and_late():
    out = decide(inputs(expected_wait_s=5.0))
    assert on_return(out, 5.0, 0.02, 0.3).warm
    assert on_return(out, 30.0, 0.02, 0.3).warm
    early = on_return(out, 1.0, 0.02, 0.3)
    assert not early.warm and early.stall_s == pytest.approx(0.02)
    during = on_return(out, out.restore_at_s + 0.01, 0.02, 0.3)
    assert not during.warm and during.stall_s == pytest.approx(0.01)
    kept = decide(inputs(expected_wait_s=0.01))
    assert on_return(kept, 9.0, 0.02, 0.3).warm
    dropped = decide(inputs(expected_wait_s=60, pressure=1, kv_bytes=20 * GB, can_swap=False))
    assert on_return(dropped, 60, 0.02, 0.3).stall_s == 0.3


def test_a_late_tool_is_expected_to_run_as_long_again():
    assert residual_wait_s(elapsed_s=8.0, expected_wait_s=5.0) == 8.0
    assert residual_wait_s(elapsed_s=1.0, expected_wait_s=5.0) == 5.0


@pytest.mark.parametrize("field, value", [("expected_wait_s", -1), ("budget_bytes", 0), ("pressure", -0.1),
                                          ("kv_bytes", -5), ("idle_price_floor", 2)])
def test_bad_inputs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        inputs(**{field: value})


# ----------------------------------------------------------------- timed by the tool's measured returns

from switchyard.dispatcher.scheduler.tool_wait import (  # noqa: E402
    MIN_RETURNS,
    ToolWaitPlan,
    ToolWaitPlans,
    restore_landing_s,
)


def brute_force_landing(i):
    """restore_landing_s by enumeration: every candidate priced on every return, and never ahead."""
    hold = i.kv_bytes / i.budget_bytes * min(1.0, max(i.pressure, i.idle_price_floor))
    cold = i.cold_resume_weight * i.transfer_s
    best, best_cost = None, cold
    for x in i.returns_s:
        at = max(x, 2 * i.transfer_s)
        cost = sum(hold * max(0.0, r - at) + (cold if r < at else 0.0) for r in i.returns_s) / len(i.returns_s)
        if cost < best_cost - 1e-12:
            best, best_cost = at, cost
    return best


@pytest.mark.parametrize("weight", [0.5, 2.0, 20.0, 200.0])
@pytest.mark.parametrize("pressure", [0.1, 1.0])
def test_the_landing_is_the_cheapest_of_hold_against_cold_resumes(weight, pressure):
    returns = tuple(sorted(10.0 * (0.6 + 0.05 * k) for k in range(20)))  # 6 .. 15.5 s
    i = inputs(expected_wait_s=12.0, kv_bytes=2 * GB, pressure=pressure, returns_s=returns, cold_resume_weight=weight)
    assert restore_landing_s(i) == pytest.approx(brute_force_landing(i)) if brute_force_landing(i) else \
        restore_landing_s(i) is None


def test_a_dearer_cold_resume_lands_the_restore_earlier_and_a_free_one_not_at_all():
    returns = tuple(float(r) for r in range(5, 25))  # 5 .. 24 s
    landing = [restore_landing_s(inputs(returns_s=returns, cold_resume_weight=w, pressure=1.0)) for w in
               (0.0, 2.0, 2000.0)]
    assert landing[0] is None  # a cold resume costs nothing: nothing is held ahead of the turn
    assert landing[1] is not None and landing[2] is not None and landing[2] < landing[1]
    assert landing[2] == 5.0  # so dear that every turn is met: the first return


def test_measured_returns_price_keep_and_time_the_swap():
    short = tuple(0.3 + 0.01 * k for k in range(MIN_RETURNS))  # a fast tool: holding it is cheaper than a round trip
    kept = decide(inputs(expected_wait_s=0.4, pressure=1.0, transfer_s=0.1, returns_s=short, cold_resume_weight=20.0),
                  grace_s=0.4)
    assert kept.decision is Decision.KEEP
    long = tuple(float(r) for r in range(10, 10 + 2 * MIN_RETURNS))
    i = inputs(expected_wait_s=20.0, pressure=1.0, returns_s=long, cold_resume_weight=20.0)
    swapped = decide(i, grace_s=20.0)
    assert swapped.decision is Decision.SWAP
    assert swapped.warm_at_s == pytest.approx(restore_landing_s(i) - i.margin_s)
    assert swapped.revisit_at_s == long[-1]  # the returns' 95th percentile (nearest rank: 16th of 16)
    few = decide(inputs(expected_wait_s=20.0, returns_s=long[:MIN_RETURNS - 1]), grace_s=20.0)
    assert few.restore_at_s == pytest.approx(20.0 - 0.02 - 0.05)  # too few measured: the announced wait
    with pytest.raises(ValueError, match="returns_s"):
        inputs(returns_s=(2.0, 1.0))


def plan(agent, started, wait, restore_at=None, tool="t"):
    return ToolWaitPlan(agent, tool, Decision.SWAP, started, started + wait, started + 2 * wait, restore_at=restore_at)


def test_returns_are_learned_per_tool_against_the_announced_wait():
    plans = ToolWaitPlans()
    for k in range(MIN_RETURNS):  # announced 10 s, back after 8 s
        plans.add(plan(f"a{k}", 0.0, 10.0))
        plans.on_turn(f"a{k}", 8.0, warm=False)
    assert plans.return_times("t", 20.0) == (16.0,) * MIN_RETURNS  # scaled to the new announcement
    assert plans.return_times("t", 1.0) == ()  # announced at a tenth: another regime, not measured
    assert plans.return_times("other-tool", 10.0) == ()


def test_due_restores_come_from_a_heap_earliest_first_and_replaced_plans_drop_out():
    plans = ToolWaitPlans()
    for agent, at in (("late", 9.0), ("early", 3.0), ("mid", 5.0)):
        plans.add(plan(agent, 0.0, 10.0, restore_at=at))
    plans.add(plan("mid", 1.0, 10.0, restore_at=8.0))  # its agent's new plan replaces the one due at 5
    assert plans.next_restore_at == 3.0
    assert [p.agent_id for p in plans.due(6.0)] == ["early"]
    assert plans.next_restore_after(6.0) == 8.0
    assert [p.agent_id for p in plans.due(8.5)] == ["early", "mid"]  # "early" found no room yet: still due
    plans.started(plans.get("early"))
    assert [p.agent_id for p in plans.due(9.5)] == ["mid", "late"]
    assert plans.next_restore_after(9.5) == float("inf")
