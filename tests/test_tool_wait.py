"""The tool-start decision: keep, swap or drop, and the restore ahead of the return (scheduler.tool_wait)."""

from __future__ import annotations

import dataclasses

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
    """A decision's inputs; the cost weights these tests were written for (not the config's defaults, which the
    scheduler passes: ``scheduler.tool_wait_idle_price_floor``, ``scheduler.tool_wait_cold_resume_weight``)."""
    base = dict(expected_wait_s=5.0, kv_bytes=1 * GB, budget_bytes=60 * GB, pressure=0.5, transfer_s=0.02,
                recompute_s=0.3, idle_price_floor=0.25, cold_resume_weight=1.0)
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
    # held to the returns' P95 (0.37 s), not the announced wait and as long again (0.8 s) the docstrings said
    assert kept.revisit_at_s == pytest.approx(short[-1]) and kept.restore_at_s is None
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
        plans.on_turn(f"a{k}", 8.0, resume="cold")
    assert plans.return_times("t", 20.0) == ((16.0,), (1.0,))  # scaled to the new announcement: all the mass at 16 s
    # announced at a tenth, with none announced alike: the tool's own durations, in seconds
    assert plans.return_times("t", 1.0) == ((8.0,), (1.0,))
    assert plans.return_times("other-tool", 10.0).times == ()


def test_calls_announced_on_a_cold_estimate_time_the_next_calls_by_their_seconds():
    """A load's first calls are announced on the orchestrator's cold estimate (1 s) and take 15 s; the next
    call is announced at their P75 (18 s), so none of the returns was announced alike. They still say how long
    the tool takes: the new call is timed by their durations in seconds (it had been timed by the announced wait
    alone: restored at 18 s, held to 36 s), and the calls of that first wave still running after 14 s count as
    running (at 14x their 1 s announcement they had been taken as abandoned, and the returns measured were the
    first wave's quick half)."""
    plans = ToolWaitPlans()
    for k in range(2 * MIN_RETURNS):
        plans.add(ToolWaitPlan(f"a{k}", "batch_job", Decision.SWAP, 0.0, 1.0, 2.0))
    for k in range(MIN_RETURNS):  # the quick half is back after 10-13.5 s
        plans.on_turn(f"a{k}", 10.0 + 0.5 * k, resume="cold")
    returned_only = plans.return_times("batch_job", 18.0)
    assert returned_only.times == tuple(10.0 + 0.5 * k for k in range(MIN_RETURNS))
    with_running = plans.return_times("batch_job", 18.0, now=14.0)
    assert sum(w for t, w in zip(*with_running) if t > 14.0) == pytest.approx(0.5)  # half of the wave still runs
    i = inputs(expected_wait_s=18.0, pressure=1.0, returns_s=with_running.times, return_weights=with_running.weights)
    assert decide(i, grace_s=18.0).revisit_at_s >= 28.0  # the running half: back after as long again (14 s)
    # a call running ten times the longer of the two announcements is abandoned all the same
    assert plans.return_times("batch_job", 18.0, now=200.0) == returned_only


def test_due_restores_come_from_a_heap_earliest_first_and_replaced_plans_drop_out():
    plans = ToolWaitPlans()
    for agent, at in (("late", 9.0), ("early", 3.0), ("mid", 5.0)):
        plans.add(plan(agent, 0.0, 10.0, restore_at=at))
    plans.add(plan("mid", 1.0, 10.0, restore_at=8.0))  # its agent's new plan replaces the one due at 5
    assert plans.next_restore_at == 3.0
    assert [p.program_key for p in plans.due(6.0)] == ["early"]
    assert plans.next_restore_after(6.0) == 8.0
    assert [p.program_key for p in plans.due(8.5)] == ["early", "mid"]  # "early" found no room yet: still due
    plans.started(plans.get("early"))
    assert [p.program_key for p in plans.due(9.5)] == ["mid", "late"]
    assert plans.next_restore_after(9.5) == float("inf")


# ----------------------------------------------------------------- calls still running (right-censored)

from switchyard.dispatcher.scheduler.tool_wait import ABANDONED_RATIO, kaplan_meier  # noqa: E402


def test_kaplan_meier_hands_a_running_calls_probability_to_the_returns_beyond_it():
    """Returns at 1, 2, 3 and one call running for 1.5: the product-limit estimate is S(1) = 3/4, S(2) =
    3/4 x 1/2, S(3) = 0 (Kaplan and Meier 1958), so the masses are 1/4, 3/8, 3/8."""
    times, weights = kaplan_meier([1.0, 2.0, 3.0], [1.5])
    assert times == (1.0, 2.0, 3.0)
    assert weights == pytest.approx((0.25, 0.375, 0.375))
    assert kaplan_meier([1.0, 2.0, 3.0], []) == ((1.0, 2.0, 3.0), pytest.approx((1 / 3,) * 3))
    assert kaplan_meier([], [5.0]) == ((), ())


def test_a_call_running_past_every_measured_return_returns_after_as_long_again():
    """Beyond every measured return the estimate has nothing to hand its probability to: the call is taken
    to return after as long again as it has run (residual_wait_s, the announced wait 1 at least)."""
    times, weights = kaplan_meier([0.5, 0.6], [0.7, 3.0])
    assert times == (0.5, 0.6, 1.7, 6.0)
    assert weights == pytest.approx((0.25,) * 4)


def test_the_calls_still_running_move_a_tools_distribution_past_its_quick_first_returns():
    """A load's first returns are its quickest calls: 8 of 40 calls announced at 10 s came back after 4-6 s
    while 32 have run 7 s and still run. The returns alone put the tool's P95 at 6 s (every turn after that
    would find its restore gone); with the running calls the distribution's mass lies past 7 s."""
    plans = ToolWaitPlans()
    for k in range(40):
        plans.add(ToolWaitPlan(f"a{k}", "batch_job", Decision.SWAP, 0.0, 10.0, 20.0))
    for k in range(MIN_RETURNS):
        plans.on_turn(f"a{k}", 4.0 + 2.0 * k / MIN_RETURNS, resume="cold")
    returned_only = plans.return_times("batch_job", 10.0)
    assert max(returned_only.times) < 6.0 and sum(returned_only.weights) == pytest.approx(1.0)
    with_running = plans.return_times("batch_job", 10.0, now=7.0)
    past = sum(w for t, w in zip(*with_running) if t > 7.0)
    assert past == pytest.approx(32 / 40)
    i = inputs(expected_wait_s=10.0, pressure=1.0, returns_s=with_running.times, return_weights=with_running.weights)
    assert decide(i, grace_s=10.0).revisit_at_s > 7.0  # the revisit is not before the running calls' time


def test_a_call_running_many_times_its_announced_wait_counts_as_abandoned_and_a_refused_turn_ends_its_plan():
    plans = ToolWaitPlans()
    for k in range(MIN_RETURNS + 2):
        plans.add(ToolWaitPlan(f"a{k}", "t", Decision.SWAP, 0.0, 1.0, 2.0))
    for k in range(MIN_RETURNS):
        plans.on_turn(f"a{k}", 1.0, resume="cold")
    assert plans.return_times("t", 1.0, now=ABANDONED_RATIO + 1).times == (1.0,)  # both running ones: abandoned
    assert plans.return_times("t", 1.0, now=2.0).times == (1.0, 4.0)  # running for 2 s: back after 4 s
    assert plans.abandon(f"a{MIN_RETURNS}") is not None and plans.abandon(f"a{MIN_RETURNS + 1}") is not None
    assert plans.return_times("t", 1.0, now=2.0).times == (1.0,)  # a refused turn is no running call
    assert plans.get(f"a{MIN_RETURNS}") is None and sum(plans.resumes.values()) == MIN_RETURNS  # nor a resume


def test_return_weights_must_be_one_probability_per_return():
    with pytest.raises(ValueError, match="return_weights"):
        inputs(returns_s=(1.0, 2.0), return_weights=(1.0,))
    with pytest.raises(ValueError, match="return_weights"):
        inputs(returns_s=(1.0, 2.0), return_weights=(0.5, 0.6))


@pytest.mark.parametrize("weight", [0.5, 2.0, 200.0])
def test_the_landing_prices_each_return_by_its_probability(weight):
    returns = tuple(float(r) for r in range(5, 15))
    probs = tuple(k + 1.0 for k in range(10))
    probs = tuple(p / sum(probs) for p in probs)  # later returns likelier
    i = inputs(expected_wait_s=10.0, kv_bytes=2 * GB, pressure=1.0, returns_s=returns, return_weights=probs,
               cold_resume_weight=weight)
    hold = i.kv_bytes / i.budget_bytes
    cold = weight * i.transfer_s
    best, best_cost = None, cold
    for x in returns:
        cost = sum(p * (hold * max(0.0, r - x) + (cold if r < x else 0.0)) for r, p in zip(returns, probs))
        if cost < best_cost - 1e-12:
            best, best_cost = x, cost
    assert restore_landing_s(i) == (pytest.approx(best) if best is not None else None)


def test_a_call_of_the_tool_running_past_the_revisit_time_cancels_a_restore_timed_by_the_announcement():
    """With nothing measured a restore is timed by the announced wait. The first wave of a 15 s batch job is
    announced on the orchestrator's 1 s cold estimate: its restores landed after 1 s and left HBM at the 2 s
    revisit, 51 of 60 before their turn (bench agents --policies switchyard --load-scale 0.6 --seed 11). Once a
    call of the tool has run past a new call's revisit time without a return, the announcement is evidently
    short and no restore is timed by it (the turn restores at admission)."""
    fresh = decide(inputs(expected_wait_s=1.0, outlasted_s=1.5), grace_s=1.0)
    assert fresh.decision is Decision.SWAP and fresh.restore_at_s == pytest.approx(1.0 - 0.02 - 0.05)
    outlasted = decide(inputs(expected_wait_s=1.0, outlasted_s=2.5), grace_s=1.0)
    assert outlasted.decision is Decision.SWAP and outlasted.restore_at_s is None
    assert outlasted.revisit_at_s == fresh.revisit_at_s == 2.0
    long = tuple(float(r) for r in range(10, 10 + 2 * MIN_RETURNS))  # measured: the returns time it, not this
    i = inputs(expected_wait_s=20.0, pressure=1.0, returns_s=long, cold_resume_weight=20.0)
    assert decide(dataclasses.replace(i, outlasted_s=100.0), grace_s=20.0) == decide(i, grace_s=20.0)
    plans = ToolWaitPlans()
    assert plans.longest_running_s("batch_job", 5.0, 1.0) == 0.0
    plans.add(ToolWaitPlan("a", "batch_job", Decision.SWAP, 1.0, 2.0, 3.0))
    plans.add(ToolWaitPlan("b", "batch_job", Decision.SWAP, 2.0, 3.0, 4.0))
    assert plans.longest_running_s("batch_job", 5.0, 1.0) == 4.0 and plans.longest_running_s("code", 5.0, 1.0) == 0.0
    plans.on_turn("a", 5.0, resume="cold")
    assert plans.longest_running_s("batch_job", 5.0, 1.0) == 3.0


def test_an_abandoned_call_outlasts_no_announcement():
    """A call whose agent never came back (its orchestrator gone before the task's end reached the dispatcher)
    keeps its plan open until MAX_PLANS later ones. Counted as outlasting, it cancelled every restore its tool's
    announcements timed while fewer than MIN_RETURNS returns were measured, for as long as the plan stayed;
    past ABANDONED_RATIO times the longer of its announcement and the new one, it is abandoned, as the running
    calls of :meth:`ToolWaitPlans.return_times` are."""
    plans = ToolWaitPlans()
    plans.add(ToolWaitPlan("gone", "batch_job", Decision.SWAP, 0.0, 1.0, 2.0))  # announced 1 s
    assert plans.longest_running_s("batch_job", 5.0, 1.0) == 5.0  # still evidence: outlasts a 1 s announcement
    assert plans.longest_running_s("batch_job", 600.0, 1.0) == 0.0  # abandoned long since
    assert plans.longest_running_s("batch_job", 15.0, 2.0) == 15.0  # within 10x the new call's 2 s
    fresh = decide(inputs(expected_wait_s=1.0, outlasted_s=plans.longest_running_s("batch_job", 600.0, 1.0)),
                   grace_s=1.0)
    assert fresh.decision is Decision.SWAP and fresh.restore_at_s is not None
