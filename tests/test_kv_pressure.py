"""Memory pressure on the sim's KV budget: parked state gives way to runnable work, core work preempts at
once, and a victim's KV leaves in the background (or is dropped when moving it would delay core work).

The scheduler is stepped by hand on a simulated clock (``now``); the DRAM tier is a real Redis
(tests/redis_fixtures.py). Sizes are the sim's: 512 KiB of KV per token, a budget of ~103,000 tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nvml_fixtures import FakeNvml
from registry_values import metric
from redis_fixtures import RedisDb, redis_db, redis_server  # noqa: F401

from switchyard.common.priority import PriorityClass
from switchyard.api import agent_pb2
from switchyard.common.config import SwitchyardConfig
from switchyard.common.dram import DramClient
from switchyard.dispatcher.engines.sim import SimEngine, mixed_step_seconds
from switchyard.dispatcher.request import Request, RequestStatus
from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
from switchyard.dispatcher.scheduler.capacity import KvBudget
from switchyard.dispatcher.tiers import KvStore, MemoryTiers
from switchyard.dispatcher.engines.driver import EngineDriver
from switchyard_harness.testing.scheduling import accept, publish

pytestmark = pytest.mark.no_gpu

CORE, NORMAL, BATCH = agent_pb2.CORE, agent_pb2.NORMAL, agent_pb2.BATCH


def build(db: RedisDb | None, **overrides: Any) -> Any:
    config = SwitchyardConfig().with_overrides(**{"scheduler.score_sample_interval_ms": 1, **overrides})
    engine = SimEngine(config)
    store = KvStore(DramClient(db.dram_config), config.memory.dram.kv_ttl_s) if db is not None else None
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv, store)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=FakeNvml())
    return make_scheduler(config, engine, monitor=monitor, tiers=tiers)


def request(rid: str, priority: int, *, prompt_tokens: int, max_tokens: int, arrival: float = 0.0,
            **fields: Any) -> Request:
    return Request(request_id=rid, prompt="How does the with statement work?", priority=PriorityClass.from_proto(priority),
                   prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival=arrival, **fields)


def park_core_agents(sched: Any, n: int, tokens: int) -> list[Request]:
    """``n`` core react agents waiting on a tool, each holding ``tokens`` of KV, reused often (valued above
    ``[hbm] evict_first_below``)."""
    agents = []
    for i in range(n):
        req = request(f"agent-{i}", CORE, prompt_tokens=tokens, max_tokens=64, task_type="react_loop",
                      agent_id=f"core-agent-{i}")
        req.num_computed_tokens = tokens
        req.kv_hits = 5
        sched.parking.park(req, now=0.0)
        agents.append(req)
    value = sched._parked_value(sched.parking.entries[0], 0.0)
    assert value > sched.memory.hbm.evict_first_below  # the state admission used to leave alone
    return agents


def fill_with_batch(sched: Any, n: int, prompt_tokens: int, max_tokens: int, computed: int) -> list[Request]:
    """``n`` running BATCH requests, each with ``computed`` tokens of KV."""
    batch = [request(f"b{i}", BATCH, prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival=0.001 * i)
             for i in range(n)]
    accept(sched, batch, now=0.0)
    t = 0.0
    while sched.waiting and t < 1.0:
        sched.schedule(now=t)
        t += 0.01
    assert sched.running == batch
    for req in batch:
        req.num_computed_tokens = computed
    return batch


# --------------------------------------------------------------------------- parked state gives way


@pytest.mark.parametrize("dram", [True, False])
async def test_parked_core_agents_give_way_to_waiting_normal_work(redis_db: RedisDb, dram: bool) -> None:
    """Parked core agents hold all but ~3,000 tokens of the budget; 20 normal chats arrive."""
    sched = build(redis_db if dram else None, **{"scheduler.tool_wait_ttl_s": 3600.0})
    budget: KvBudget = sched.capacity
    per_token = budget.info.kv_bytes_per_token
    park_core_agents(sched, 20, tokens=5000)
    assert budget.free_bytes < 4000 * per_token
    chats = [request(f"chat-{i}", NORMAL, prompt_tokens=800, max_tokens=200, arrival=1.0) for i in range(20)]
    accept(sched, chats, now=1.0)
    publish(sched)
    evicted = metric("switchyard_parked_evicted_total")

    t, first_token_wait = 1.0, {}
    while len(first_token_wait) < len(chats) and t < 1.0 + sched.memory.scan.hbm_scan_interval_s:
        out = sched.schedule(now=t)
        for req in out.admitted:
            first_token_wait[req.request_id] = t - req.arrival
            req.num_computed_tokens = req.prompt_tokens  # its prefill
        t += 0.01  # a step boundary every 10 ms of simulated time
    assert len(first_token_wait) == len(chats), "runnable work waited behind parked state"
    # The first chats started at once; the rest waited for nothing but admission by compute score and
    # wave (a few decisions); only what the chats needed left HBM.
    longest = max(first_token_wait.values())
    assert min(first_token_wait.values()) == 0.0 and longest <= 0.05, first_token_wait
    publish(sched)
    gone = metric("switchyard_parked_evicted_total") - evicted
    assert 1 <= gone <= 4 and len(sched.parked) == 20 - gone
    if dram:
        publish(sched)
        assert metric("switchyard_tier_demotions_total", tier="hbm") >= gone  # swapped, not dropped
    await sched.tiers.aclose()


# --------------------------------------------------------------------------- core work under a full KV budget


async def test_core_preempts_mid_step_and_the_victims_kv_leaves_in_the_background(redis_db: RedisDb) -> None:
    """26 BATCH requests of 3,449 + 512 tokens fill the budget; a core chat must preempt to fit."""
    sched = build(redis_db)
    budget: KvBudget = sched.capacity
    per_token = budget.info.kv_bytes_per_token
    batch = fill_with_batch(sched, 26, 3449, 512, computed=3449 + 100)
    core = request("core", CORE, prompt_tokens=40, max_tokens=64, arrival=1.0)
    sched.add_request(core, now=1.0)
    assert budget.refusal(core) is not None  # no room: it must preempt

    assert sched.admit_core(now=1.0).admitted == [core]  # at once, mid-step
    [victim] = [req for req in batch if req.status is RequestStatus.PREEMPTING]
    assert victim is batch[-1]  # the latest-arrived batch request
    live = (3449 + 100) * per_token
    assert budget.leaving_bytes == live  # in use until the step in flight ends
    assert budget.free_bytes >= 0  # core's reservation fits beside it: the victim's unwritten output blocks

    out = sched.schedule(now=1.01)  # the step ended
    assert out.preempted == [victim] and victim.swap_key  # swapped: it delays no waiting core work
    assert sched.tiers.take_owed_seconds() == 0.0  # the copy runs in the background, in front of no step
    assert budget.leaving_bytes == 0 and victim.status is RequestStatus.WAITING
    await sched.tiers.aclose()


@pytest.mark.parametrize("background", [True, False])
async def test_a_victims_swap_counts_the_delay_its_copy_puts_on_the_core_request(
        redis_db: RedisDb, background: bool) -> None:
    """At a step boundary core preempts at once. On the sim the copy runs in the background: the victim is
    swapped (74 ms there and back, against 92 ms of prefill). An engine that copies at export puts the
    copy (37 ms) in front of core's prefill: 111 ms > 92 ms, so the victim is dropped and recomputed."""
    sched = build(redis_db, **{"scheduler.core_preemption": "step"})
    sched.tiers.models_transfers = background
    batch = fill_with_batch(sched, 26, 3449, 512, computed=3449 + 10)
    core = request("core", CORE, prompt_tokens=40, max_tokens=64, arrival=1.0)
    accept(sched, [core], now=1.0)
    out = sched.schedule(now=1.0)
    assert out.admitted == [core] and out.preempted == [batch[-1]]  # at once: no wait before preempting
    assert bool(batch[-1].swap_key) is background
    tiers, nbytes = sched.tiers, (3449 + 10) * sched.capacity.info.kv_bytes_per_token
    assert 2 * tiers.transfer_seconds(nbytes) < tiers.recompute_seconds(3459) < 3 * tiers.transfer_seconds(nbytes)
    assert sched.capacity.free_bytes >= 0
    await sched.tiers.aclose()


# --------------------------------------------------------------------------- chunked prefill


async def test_a_long_prompt_is_prefilled_over_steps_under_the_token_budget() -> None:
    engine = SimEngine(SwitchyardConfig().with_overrides(**{"sim.prefix_caching": False}))
    running = request("running", BATCH, prompt_tokens=10, max_tokens=100)
    await EngineDriver(engine).prefill([running])
    long = request("long", BATCH, prompt_tokens=1200, max_tokens=5)
    steps = 0
    while not long.output_tokens:
        before = len(running.output_tokens)
        await EngineDriver(engine).step([long], [running], 512)
        steps += 1
        assert len(running.output_tokens) == before + 1  # the running request decodes every step
        assert long.num_computed_tokens == (min(1200, 512 * steps) if not long.output_tokens else 1200)
    assert steps == 3 and long.recomputed_tokens == 0
    assert mixed_step_seconds(engine.params, 512, 2) < mixed_step_seconds(engine.params, 1200, 2)


def handed_over(sched: Any, step: Request) -> Request | None:
    """The parked step whose warm prefix ``step`` is taking over (None: none), as the parking records it."""
    handover = sched.parking.handover(step)
    return handover.parked if handover is not None else None


def _parked_agent_back() -> tuple[Any, Request, Request]:
    """A scheduler with one agent's step parked warm, holding 60 % of the KV budget, and that agent's next step
    (resuming, not yet added)."""
    sched = build(None, **{"scheduler.tool_wait_ttl_s": 3600.0})
    room = sched.capacity.budget_bytes // sched.capacity.info.kv_bytes_per_token
    parked = request("agent-step-1", BATCH, prompt_tokens=room * 6 // 10, max_tokens=64, task_type="react_loop",
                     agent_id="a1")
    parked.num_computed_tokens = parked.prompt_tokens
    sched.parking.park(parked, now=0.0)
    resumed = request("agent-step-2", BATCH, prompt_tokens=parked.prompt_tokens + 100, max_tokens=64,
                      task_type="react_loop", agent_id="a1", resume=True, arrival=1.0)
    return sched, parked, resumed


def test_a_warm_prefix_being_handed_over_to_its_agents_next_step_still_counts_in_the_kv_budget() -> None:
    """A resuming step takes its agent's parked KV over when it is flushed and releases it when it starts. In
    between the parked KV was counted nowhere (it had left the parking, and the new step was not running), so
    a 50,000-token chat admitted beside it overcommitted HBM by the parked prefix."""
    sched, parked, resumed = _parked_agent_back()
    budget = sched.capacity
    per = budget.info.kv_bytes_per_token
    chat = request("chat", NORMAL, prompt_tokens=budget.budget_bytes // per // 2, max_tokens=1_000, arrival=1.0)
    sched.add_request(resumed, 1.0)
    sched.add_request(chat, 1.0)
    out = sched.schedule(1.0)
    held = sched.kv.kv_bytes(parked) + sum(r.kv_reserved_bytes for r in sched.running)
    assert held <= budget.budget_bytes, f"over the budget by {(held - budget.budget_bytes) // per} tokens"
    # the chat, first in the order, fits only without the prefix: it left HBM for the chat, and the agent's
    # step recomputes it when its turn comes (the sim engine has no DRAM tier here), not after the chat's deadline
    assert [r.request_id for r in out.admitted] == ["chat"]
    assert handed_over(sched, resumed) is None and resumed.num_computed_tokens == 0
    assert resumed.recomputed_tokens == parked.prompt_tokens and sched.parking.kv_bytes == 0


def test_a_step_taking_over_its_agents_warm_prefix_is_not_refused_for_the_prefix_it_takes_over() -> None:
    """The prefix a resuming step takes over counts against every other request, and becomes the step's own
    when it starts: a step whose prefix is most of the budget still starts, warm."""
    sched, parked, resumed = _parked_agent_back()
    sched.add_request(resumed, 1.0)
    out = sched.schedule(1.0)
    assert out.admitted == [resumed] and resumed.num_computed_tokens == parked.prompt_tokens
    assert sched.parking.kv_bytes == 0 and resumed.recomputed_tokens == 0


def test_a_warm_prefix_is_not_moved_out_for_a_head_that_would_not_fit_anyway() -> None:
    """The last resort moved every handed-over prefix behind a blocked head out of HBM even when that could not
    let the head start (running work held the room): each decision threw warm prefixes away for nothing."""
    sched = build(None, **{"scheduler.tool_wait_ttl_s": 3600.0})
    per = sched.capacity.info.kv_bytes_per_token
    room = sched.capacity.budget_bytes // per
    running = request("running", NORMAL, prompt_tokens=room // 2, max_tokens=64)
    sched.add_request(running, 0.0)
    assert sched.schedule(0.0).admitted == [running]
    small = request("agent-step-1b", BATCH, prompt_tokens=room // 10, max_tokens=64, task_type="react_loop",
                    agent_id="a1")
    small.num_computed_tokens = small.prompt_tokens
    sched.parking.park(small, now=0.5)
    head = request("head", NORMAL, prompt_tokens=room * 6 // 10, max_tokens=64, arrival=1.0)
    back = request("agent-step-2b", BATCH, prompt_tokens=small.prompt_tokens + 100, max_tokens=64,
                   task_type="react_loop", agent_id="a1", resume=True, arrival=1.0)
    sched.add_request(head, 1.0)
    sched.add_request(back, 1.0)
    assert sched.schedule(1.0).admitted == []  # the head waits for the running request
    assert handed_over(sched, back) is small and back.recomputed_tokens == 0  # its prefix stays warm


TURN = 0.51


def _kept_agent_back_behind(head_priority: int, hold_s: float = 1.0) -> tuple[Any, Request, Request, Request]:
    """Running work holds 3/10 of the KV budget; an agent's step (3/10) parked and its tool wait was decided KEEP
    (a 10 ms tool, held to 20 ms); at 0.51 its next step arrives behind a head that fits only without the kept
    prefix. Returns the scheduler, the parked step, the agent's next step and the head (both added at 0.51)."""
    sched = build(None, **{"scheduler.tool_wait_ttl_s": 3600.0, "scheduler.tool_wait_turn_hold_s": hold_s})
    room = sched.capacity.budget_bytes // sched.capacity.info.kv_bytes_per_token
    running = request("running", NORMAL, prompt_tokens=room * 3 // 10, max_tokens=64)
    sched.add_request(running, 0.0)
    assert sched.schedule(0.0).admitted == [running]
    kept = request("agent-step-1", BATCH, prompt_tokens=room * 3 // 10, max_tokens=64, task_type="react_loop",
                   agent_id="a1")
    kept.num_computed_tokens = kept.prompt_tokens
    sched.parking.park(kept, now=0.5)
    decided = sched.tool_wait(kept.program_key, 0.01, now=0.5, tool="search_docs")
    assert decided is not None and decided.decision.value == "keep"
    head = request("head", head_priority, prompt_tokens=room * 6 // 10, max_tokens=64, arrival=TURN)
    back = request("agent-step-2", BATCH, prompt_tokens=kept.prompt_tokens + 100, max_tokens=64,
                   task_type="react_loop", agent_id="a1", resume=True, arrival=TURN)
    sched.add_request(head, TURN)
    sched.add_request(back, TURN)
    return sched, kept, back, head


def test_a_prefix_kept_for_its_turn_waits_with_its_step_while_running_work_can_free_the_room() -> None:
    """A prefix its tool-wait decision kept in HBM (or restored ahead) stays with its arrived step for
    ``tool_wait_turn_hold_s`` while the head of another class than core waits for running work to end: moving it
    made the warm resume the plan had held HBM for a cold one (61 of 565 resumes of `bench agents --policies
    switchyard --load-scale 0.6 --seed 11`, warm at their turn and restored at admission). Past the hold it is
    moved as before, so that a step waiting long behind the head does not hold the room the head waits for."""
    sched, kept, back, head = _kept_agent_back_behind(NORMAL)
    assert sched.schedule(TURN).admitted == []  # the head waits for the running request
    assert handed_over(sched, back) is kept and back.recomputed_tokens == 0  # its prefix stays warm
    assert sched.schedule(TURN + 0.5).admitted == [] and handed_over(sched, back) is kept
    out = sched.schedule(TURN + 1.5)  # past the hold
    assert head in out.admitted and handed_over(sched, back) is None
    assert back.recomputed_tokens == kept.prompt_tokens  # no DRAM tier here: recomputed at its admission


def test_a_kept_prefix_still_leaves_for_core_work_at_once() -> None:
    sched, kept, back, head = _kept_agent_back_behind(CORE)
    out = sched.schedule(TURN)
    assert head in out.admitted and handed_over(sched, back) is None  # core's TTFT does not wait for a decode


def test_a_kept_prefix_is_moved_when_no_hold_is_configured() -> None:
    sched, kept, back, head = _kept_agent_back_behind(NORMAL, hold_s=0.0)
    out = sched.schedule(TURN)
    assert head in out.admitted and handed_over(sched, back) is None


def test_the_idle_price_floor_is_the_configured_one() -> None:
    """``scheduler.tool_wait_idle_price_floor`` prices HBM held idle at low pressure: an agent's KV alone in an
    empty budget is priced to keep at the floor, 4x as much at a floor of 1 as at 0.25."""
    keep = {}
    for floor in (0.25, 1.0):
        sched = build(None, **{"scheduler.tool_wait_idle_price_floor": floor})
        step = request("agent-step-1", BATCH, prompt_tokens=2_000, max_tokens=64, task_type="react_loop",
                       agent_id="a1")
        step.num_computed_tokens = step.prompt_tokens
        sched.parking.park(step, now=0.0)
        decided = sched.tool_wait(step.program_key, 1.0, now=0.0, tool="search_docs")
        assert decided is not None
        keep[floor] = decided.costs.keep
    assert keep[1.0] == pytest.approx(4 * keep[0.25])
