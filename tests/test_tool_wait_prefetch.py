"""A swapped agent's KV brought back ahead of its tool's expected return, on a fake clock (the scheduler's
``now``), with the sim engine's KV and a real Redis as the DRAM tier (tests/redis_fixtures.py): the restore
is due at expected return - transfer - margin, an early return restores at once (cold), a late return finds
the KV parked under the parking's rules and is counted late; the per-tool counts reach the metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import REGISTRY
from nvml_fixtures import FakeNvml
from registry_values import metric
from redis_fixtures import RedisDb, redis_db, redis_server  # noqa: F401

from switchyard.common.config import SwitchyardConfig
from switchyard.common.dram import DramClient
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.request import Request, RequestStatus
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.scheduler.capacity import KV_MEMORY
from switchyard.dispatcher.scheduler.tool_wait import Decision, ToolWaitDecision
from switchyard.dispatcher.tiers import KvStore, MemoryTiers
from switchyard_harness.testing.scheduling import accept, finish, publish, step

pytestmark = pytest.mark.no_gpu

TOOL = "search_docs"
WAIT_S = 86_400.0  # a day: holding the KV costs more than its round trip to DRAM, so the decision swaps
STARTED = 0.1  # the tool starts when the agent's step has parked


def build(db: RedisDb, **overrides: Any) -> tuple[Any, SimEngine]:
    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 1, **overrides})
    engine = SimEngine(config)
    store = KvStore(DramClient(db.dram_config), config.memory.dram.kv_ttl_s)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=FakeNvml())
    return make_scheduler(config, engine, monitor=monitor, tiers=tiers), engine


def step_request(rid: str, agent: str, arrival: float, prompt_tokens: int, resume: bool = False) -> Request:
    return Request(request_id=rid, prompt="How does the with statement work?", agent_id=agent,
                   task_type="react_loop", prompt_tokens=prompt_tokens, max_tokens=12, arrival=arrival,
                   resume=resume)


async def swapped(db: RedisDb, agent: str, **overrides: Any) -> tuple[Any, Request, int, ToolWaitDecision]:
    """A scheduler whose agent ``agent`` ran one step, parked, and had its tool wait decided SWAP at
    ``STARTED``; returns it, the parked step, its prefix tokens and the decision."""
    sched, engine = build(db, **overrides)
    think = step_request(f"{agent}-think", agent, 0.0, 600)
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    await step(sched, engine, prefill=[think])
    finish(sched, think, STARTED, RequestStatus.FINISHED_TOOL_CALLS)
    assert sched.parked == [think]
    prefix = think.num_computed_tokens
    decided = sched.tool_wait(agent, WAIT_S, now=STARTED, tool=TOOL)
    assert decided is not None and decided.decision is Decision.SWAP
    assert sched.parked == []  # out of HBM, copied to DRAM
    await sched.tiers._writes[sched.tiers.parked_key(agent)]
    return sched, think, prefix, decided


def counts(sched: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The scheduler's per-tool resumes and prefetch timings for ``TOOL``."""
    resumes = {kind: sched.counters.tool_resumes[(TOOL, kind)] for kind in ("warm", "restored", "cold")}
    returns = {kind: sched.counters.tool_prefetches[(TOOL, kind)] for kind in ("early", "on_time", "late")}
    return resumes, returns


async def test_a_swapped_agent_is_restored_a_transfer_ahead_of_its_tools_expected_return(redis_db: RedisDb):
    sched, think, prefix, decided = await swapped(redis_db, "agent-on-time")
    assert decided.transfer_s == pytest.approx(sched.tiers.transfer_seconds(prefix * sched.kv.params.kv_bytes_per_token))
    expected_return = STARTED + WAIT_S
    restore_at = expected_return - decided.transfer_s - 0.05  # the default margin
    assert sched.tool_waits.next_restore_at == pytest.approx(restore_at)

    assert sched.on_idle(restore_at - 1.0) == []  # not due yet
    assert sched.schedule(restore_at - 1e-3).prefetch == []
    out = sched.schedule(restore_at + 1e-6)
    assert out.prefetch == [think]  # due: handed to the loop, once
    assert sched.schedule(restore_at + 2e-6).prefetch == [] and math.isinf(sched.tool_waits.next_restore_at)

    restored = await sched.tiers.prefetch(think)
    assert restored == min(prefix, think.num_tokens - 1) and restored > 0
    landed_at = restore_at + decided.transfer_s
    assert landed_at < expected_return
    assert sched.prefetched(think, restored, landed_at)
    assert sched.parked == [think] and think.status is RequestStatus.PARKED  # warm in HBM again

    publish(sched)
    warm_before = metric("switchyard_tool_resumes_total", tool=TOOL, resume="warm")
    on_time_before = metric("switchyard_tool_wait_prefetches_total", tool=TOOL, tool_return="on_time")
    back = step_request("agent-on-time-back", "agent-on-time", expected_return, 700, resume=True)
    sched.resume(back, now=expected_return)
    out = sched.schedule(now=expected_return)
    assert back in out.admitted and out.restore == []  # nothing to bring back: the prefix is there
    assert back.num_computed_tokens == restored
    assert counts(sched) == ({"warm": 1, "restored": 0, "cold": 0}, {"early": 0, "on_time": 1, "late": 0})
    publish(sched)
    assert metric("switchyard_tool_resumes_total", tool=TOOL, resume="warm") == warm_before + 1
    assert metric("switchyard_tool_wait_prefetches_total", tool=TOOL, tool_return="on_time") == on_time_before + 1
    await sched.tiers.aclose()


async def test_an_early_return_restores_at_once_and_counts_restored(redis_db: RedisDb):
    sched, think, prefix, decided = await swapped(redis_db, "agent-early")
    early = STARTED + WAIT_S / 2  # the tool came back well before its restore was due
    back = step_request("agent-early-back", "agent-early", early, 700, resume=True)
    sched.resume(back, now=early)
    out = sched.schedule(now=early)
    assert back in out.admitted and out.restore == [back]  # restored now, at its admission
    assert out.prefetch == [] and math.isinf(sched.tool_waits.next_restore_at)  # the plan ended with the turn
    assert await sched.tiers.restore(back) == prefix
    assert counts(sched) == ({"warm": 0, "restored": 1, "cold": 0}, {"early": 1, "on_time": 0, "late": 0})
    await sched.tiers.aclose()


async def test_a_return_while_the_restore_is_in_flight_leaves_the_copy_for_the_turn(redis_db: RedisDb):
    sched, think, prefix, decided = await swapped(redis_db, "agent-racing")
    restore_at = STARTED + WAIT_S - decided.transfer_s - 0.05
    assert sched.on_idle(restore_at) == [think]  # the idle loop's decision hands it over too
    back = step_request("agent-racing-back", "agent-racing", restore_at, 700, resume=True)
    sched.resume(back, now=restore_at)  # the turn arrives before the restore has landed
    restored = await sched.tiers.prefetch(think)
    assert restored > 0
    assert not sched.prefetched(think, restored, restore_at + decided.transfer_s)  # not parked again
    assert sched.parked == []
    out = sched.schedule(now=restore_at + decided.transfer_s)
    assert out.restore == [back]
    assert await sched.tiers.restore(back) == prefix  # the DRAM copy was left for the turn
    assert counts(sched) == ({"warm": 0, "restored": 1, "cold": 0}, {"early": 1, "on_time": 0, "late": 0})
    await sched.tiers.aclose()


async def test_a_late_return_finds_the_kv_under_the_parking_rules_and_counts_late(redis_db: RedisDb):
    ttl = 30.0
    sched, think, prefix, decided = await swapped(redis_db, "agent-late", **{"scheduler.tool_wait_ttl_s": ttl})
    restore_at = STARTED + WAIT_S - decided.transfer_s - 0.05
    assert sched.schedule(restore_at).prefetch == [think]
    landed_at = restore_at + decided.transfer_s
    assert sched.prefetched(think, await sched.tiers.prefetch(think), landed_at)
    revisit = STARTED + decided.revisit_at_s  # the tool counts as late from here (wait + grace)
    assert revisit > STARTED + WAIT_S

    sched.on_idle(revisit - 1.0)
    assert sched.parked == [think]  # held at least until the revisit time
    assert counts(sched)[1] == {"early": 0, "on_time": 0, "late": 0}
    sched.on_idle(revisit + 1.0)
    assert counts(sched)[1] == {"early": 0, "on_time": 0, "late": 1}  # idle in HBM past the revisit time
    assert sched.parked == []  # then the parking's TTL moved it out, as any parked step's

    publish(sched)
    late_before = metric("switchyard_tool_wait_prefetches_total", tool=TOOL, tool_return="late")
    back = step_request("agent-late-back", "agent-late", revisit + 2.0, 700, resume=True)
    sched.resume(back, now=revisit + 2.0)
    out = sched.schedule(now=revisit + 2.0)
    assert out.restore == [back]  # its copy went back to DRAM at expiry
    assert counts(sched) == ({"warm": 0, "restored": 1, "cold": 0}, {"early": 0, "on_time": 0, "late": 1})  # counted once
    publish(sched)
    assert metric("switchyard_tool_wait_prefetches_total", tool=TOOL, tool_return="late") == late_before
    await sched.tiers.aclose()


def test_the_per_tool_label_sets_start_at_zero():
    from switchyard.dispatcher.metrics import TOOL_LABELS

    assert TOOL_LABELS == ("search_docs", "calculator", "other")
    for tool in TOOL_LABELS:
        for decision in ("keep", "swap", "drop"):
            assert REGISTRY.get_sample_value("switchyard_tool_wait_decisions_by_tool_total",
                                             {"tool": tool, "decision": decision}) is not None
        for resume in ("warm", "restored", "cold"):
            assert REGISTRY.get_sample_value("switchyard_tool_resumes_total", {"tool": tool, "resume": resume}) is not None
        for timing in ("early", "on_time", "late"):
            assert REGISTRY.get_sample_value("switchyard_tool_wait_prefetches_total",
                                             {"tool": tool, "tool_return": timing}) is not None


def test_a_restore_waiting_for_room_does_not_hide_the_next_restores_due_time():
    """The loop's wait (``until_prefetch``) ends when the next planned restore falls due, also while an
    earlier one, due already, waits for room in the KV budget (before, that one's past due time made the
    loop wait its whole timeout: the next restore started up to a slice or an idle tick late)."""
    from switchyard.dispatcher.scheduler.tool_wait import ToolWaitPlan

    config = SwitchyardConfig()
    engine = SimEngine(config)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=FakeNvml())
    sched = make_scheduler(config, engine, monitor=monitor, tiers=tiers)
    assert sched.until_prefetch(0.1, 6.0) == 0.1  # no plan: the whole timeout
    waiting = ToolWaitPlan("agent-waiting", TOOL, Decision.SWAP, 0.0, 6.0, 12.0, restore_at=5.0)
    nxt = ToolWaitPlan("agent-next", TOOL, Decision.SWAP, 0.0, 6.1, 12.0, restore_at=6.04)
    sched.tool_waits.add(waiting)
    assert sched.until_prefetch(0.1, 6.0) == 0.1  # due already and not started: it does not make the loop spin
    sched.tool_waits.add(nxt)
    assert sched.tool_waits.next_restore_at == 5.0
    assert sched.until_prefetch(0.1, 6.0) == pytest.approx(0.04)  # woken when the next one falls due
    assert sched.until_prefetch(0.01, 6.0) == 0.01
    assert sched.until_prefetch(0.1, 6.04) == 0.1  # both due: the decision hands them over as room allows


async def test_a_restore_holds_its_bytes_in_flight_and_its_kv_is_kept_from_waiting_work_until_the_revisit(
        redis_db: RedisDb):
    """A restore in flight holds its bytes in the KV budget (admission cannot give them away); once landed,
    the agent's KV is not evicted to make room for waiting work until its tool's revisit time, and is after."""
    sched, think, prefix, decided = await swapped(redis_db, "agent-kept")
    restore_at = STARTED + WAIT_S - decided.transfer_s - 0.05
    free = sched.capacity.free_bytes
    assert sched.schedule(restore_at).prefetch == [think]
    nbytes = sched.tool_waits.get("agent-kept").kv_bytes
    assert nbytes > 0 and sched.capacity.free_bytes == free - nbytes  # held while the copy is in flight
    landed_at = restore_at + decided.transfer_s
    assert sched.prefetched(think, await sched.tiers.prefetch(think), landed_at)
    assert sched.parked == [think] and sched.capacity.free_bytes == free - sched.parked_kv_bytes

    per_token = sched.kv.params.kv_bytes_per_token
    big = Request(request_id="big", prompt="x", prompt_tokens=sched.capacity.free_bytes // per_token + 1,
                  max_tokens=1, arrival=landed_at)
    assert sched.capacity.refusal(big) is not None
    sched._now = landed_at
    assert sched._make_room(big) == KV_MEMORY  # protected: the waiting request waits, the restored KV stays
    assert sched.parked == [think]
    sched._now = STARTED + decided.revisit_at_s + 1.0  # past the revisit time: no longer protected
    assert sched._make_room(big) is None
    assert sched.parked == []
    await sched.tiers.aclose()


async def parked_step(sched: Any, engine: SimEngine, agent: str, at: float) -> Request:
    """``agent``'s step run and parked at ``at``, its tool not yet announced."""
    think = step_request(f"{agent}-think", agent, at, 600)
    accept(sched, [think], now=at)
    sched.schedule(now=at)
    await step(sched, engine, prefill=[think])
    finish(sched, think, at, RequestStatus.FINISHED_TOOL_CALLS)
    assert think in sched.parked
    return think


def room_taker(sched: Any, at: float) -> Request:
    """A waiting request that fits only once every parked agent's KV has left HBM."""
    per_token = sched.kv.params.kv_bytes_per_token
    big = Request(request_id=f"big-{at}", prompt="x", prompt_tokens=sched.capacity.free_bytes // per_token + 1,
                  max_tokens=1, arrival=at)
    assert sched.capacity.refusal(big) is not None
    return big


async def test_an_undecided_parked_step_is_held_for_its_announcement_once_announcements_come(redis_db: RedisDb):
    """The step loop decides between a step's end and its tool's announcement: the parked KV is not evicted
    for waiting work for ``tool_wait_announce_hold_s``, so the announcement finds it and decides; before any
    announcement came (a client that never announces) and after the hold, waiting work takes the room."""
    hold = SwitchyardConfig().scheduler.tool_wait_announce_hold_s
    assert hold > 0
    sched, engine = build(redis_db)
    await parked_step(sched, engine, "never-announced", 0.0)
    sched._now = 0.01
    assert sched._make_room(room_taker(sched, 0.01)) is None  # no announcement yet on this dispatcher: no hold
    assert sched.parked == []

    assert sched.tool_wait("someone-else", 1.0, now=0.02, tool=TOOL) is None  # nothing parked: nothing decided
    think = await parked_step(sched, engine, "agent-a", 1.0)
    sched._now = 1.0 + hold / 2
    assert sched._make_room(room_taker(sched, sched._now)) == KV_MEMORY  # held: its announcement is on its way
    assert sched.parked == [think]
    decided = sched.tool_wait("agent-a", WAIT_S, now=1.0 + hold / 2, tool=TOOL)
    assert decided is not None and decided.decision is Decision.SWAP and sched.parked == []  # decided, room freed

    late = await parked_step(sched, engine, "agent-b", 2.0)
    sched._now = 2.0 + hold * 1.5
    assert sched._make_room(room_taker(sched, sched._now)) is None  # the hold ran out: the eviction's rules again
    assert late not in sched.parked
    assert sched.tool_wait("agent-b", WAIT_S, now=sched._now, tool=TOOL) is None
    await sched.tiers.aclose()


async def test_no_hold_when_it_is_configured_off(redis_db: RedisDb):
    sched, engine = build(redis_db, **{"scheduler.tool_wait_announce_hold_s": 0})
    assert sched.tool_wait("someone-else", 1.0, now=0.0, tool=TOOL) is None
    await parked_step(sched, engine, "agent-a", 0.0)
    sched._now = 0.001
    assert sched._make_room(room_taker(sched, 0.001)) is None and sched.parked == []
    await sched.tiers.aclose()


def test_tools_outside_the_registered_ones_are_measured_apart_and_counted_as_other():
    """Two tools a caller names that the orchestrator does not register share the ``other`` label of the
    counts, but each restore is timed by its own tool's returns (before, both were measured under
    ``other``: a fast tool's restores were timed by a slow one's returns when their announcements were
    alike)."""
    from switchyard.dispatcher.scheduler import tool_wait
    from switchyard.dispatcher.scheduler.tool_wait import MIN_RETURNS, ToolWaitPlan, ToolWaitPlans

    plans = ToolWaitPlans()
    announced = 2.0
    for i in range(MIN_RETURNS):
        for tool, took in (("fetch_page", 1.0), ("run_query", 3.6)):
            agent = f"{tool}-{i}"
            start = 10.0 * i
            plans.add(ToolWaitPlan(agent, tool, Decision.KEEP, start, start + announced, start + 2 * announced))
            plans.on_turn(agent, start + took, resume="warm")
    for tool, took in (("fetch_page", 1.0), ("run_query", 3.6)):
        times, weights = plans.return_times(tool, announced)
        assert times and all(t == pytest.approx(took) for t in times) and sum(weights) == pytest.approx(1.0)
    assert plans.return_times("other", announced).times == ()  # the label measures nothing of its own
    assert plans.decisions[("other", "keep")] == plans.resumes[("other", "warm")] == 2 * MIN_RETURNS
    assert not any(label in ("fetch_page", "run_query") for label, _ in plans.resumes)

    # the tools measured are bounded: the least recently returned leave first
    for i in range(tool_wait.MAX_TOOLS):
        plans.add(ToolWaitPlan(f"a{i}", f"tool-{i}", Decision.KEEP, 0.0, announced, 2 * announced))
        plans.on_turn(f"a{i}", 1.0, resume="warm")
    assert len(plans._returns) == tool_wait.MAX_TOOLS
    assert "fetch_page" not in plans._returns and f"tool-{tool_wait.MAX_TOOLS - 1}" in plans._returns


async def test_an_agent_whose_next_step_cannot_make_its_deadline_leaves_nothing_parked_or_planned(redis_db: RedisDb):
    """The fair policy refuses, by name, a step that cannot make its task's deadline: the task ends there.
    Its agent's parked KV leaves HBM at once (before, it sat there until the parking's TTL, held for a
    turn that would not come) and its tool-wait plan ends (before, the call stayed "running" for ever and
    skewed its tool's measured returns)."""
    from switchyard.dispatcher.scheduler.slack import CannotMeetDeadline

    sched, engine = build(redis_db, **{"scheduler.policy": "fair"})
    await parked_step(sched, engine, "agent-a", 0.0)
    assert sched.tool_wait("agent-a", 0.05, now=0.01, tool=TOOL).decision is Decision.KEEP
    assert sched.parking.kv_bytes > 0 and sched.tool_waits.get("agent-a") is not None
    late = step_request("agent-a-answer", "agent-a", 0.06, 700, resume=True)
    late.task_time_left_s, late.expected_remaining_work_s = 0.5, 5.0
    with pytest.raises(CannotMeetDeadline):
        sched.resume(late, 0.06)
    assert sched.parked == [] and sched.parking.kv_bytes == 0
    assert sched.tool_waits.get("agent-a") is None
    assert sched.tool_waits.return_times(TOOL, 1.0, now=100.0).times == ()
    await sched.tiers.aclose()
