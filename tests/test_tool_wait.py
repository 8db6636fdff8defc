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
