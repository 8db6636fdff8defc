"""``switchyard bench agents --policies``: every policy on the dispatcher's real scheduler (simulated clock)."""

from __future__ import annotations

import json
import math

import pytest
from redis_fixtures import redis_db, redis_server  # noqa: F401

from switchyard.common.config import SwitchyardConfig
from switchyard.common.priority import PriorityClass
from switchyard.common.tenant import agent_key
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import FairScheduler, FcfsQueue, FifoScheduler, PriorityAgingQueue, PriorityScheduler
from switchyard.dispatcher.scheduler.fair import FairQueue
from switchyard.dispatcher.scheduler.fairness import FairnessLedger
from switchyard.dispatcher.scheduler.request_queue import RequestQueue
from switchyard.dispatcher.tiers import MemoryTiers
from switchyard_harness.bench import agents_bench
from switchyard_harness.bench.program_policies import (
    LOST,
    POLICY_NAMES,
    UNDECIDED,
    AgentSimEngine,
    PolicyRun,
    ProgramArrivalQueue,
    SessionServiceQueue,
    Workload,
    build_scheduler,
    capacity_scale,
    jain,
    summarize,
)

pytestmark = pytest.mark.no_gpu

SMALL = Workload(tenant_agents=2, noisy_agents=10, seconds=8, load_scale=1.0, drain_limit=20)

SHIPPED = {
    "fcfs": (FifoScheduler, FcfsQueue),
    "priority": (PriorityScheduler, PriorityAgingQueue),
    "llmd-las": (PriorityScheduler, SessionServiceQueue),
    "autellix-plas": (FifoScheduler, SessionServiceQueue),
    "continuum": (FifoScheduler, ProgramArrivalQueue),
    "switchyard": (FairScheduler, FairQueue),
}


def _scheduler(policy: str):
    config = SwitchyardConfig()
    engine = AgentSimEngine(config.sim)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv)
    return build_scheduler(policy, config, engine, tiers, lambda req: 0.0)


def test_jain_index():
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0.0001, 0.0001, 0.0001]) == pytest.approx(0.25, abs=0.01)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)  # one has all: 1/n (a zero was left out: 1.0)
    assert jain([0, 0]) == 0.0 and jain([]) == 0.0


def test_a_tenant_and_an_agent_that_completed_no_task_count_zero_in_jains_index():
    """Jain's index is over every tenant (agent) of the workload; one whose every task was refused, or left
    unfinished, has made no progress. It was left out: a policy that starved a tenant read as fairer."""
    run = PolicyRun("fcfs", SMALL, SwitchyardConfig())
    for agent in run.agents:
        agent.isolated_s = 5.0
        run._end_task(agent, agent.task_started + 10.0, refused=agent.tenant == "tenant-9")  # progress 0.5
    row = summarize(run.result)
    tenants = {a.tenant for a in run.agents}
    assert row["jain_tenants"] == pytest.approx((len(tenants) - 1) / len(tenants), abs=1e-4)  # rounded to 4
    starved = sum(1 for a in run.agents if a.tenant == "tenant-9")
    assert starved and row["jain_agents"] == pytest.approx((len(run.agents) - starved) / len(run.agents), abs=1e-4)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_is_built_on_the_services_scheduler(policy):
    sched, ledger = _scheduler(policy)
    core, queue = SHIPPED[policy]
    assert type(sched) is core and type(sched.queue) is queue
    assert isinstance(sched.queue, RequestQueue)
    if policy == "switchyard":  # the fair policy charges its own ledger; the bench charges none beside it
        assert ledger is None and isinstance(sched.ledger, FairnessLedger)
    if policy == "autellix-plas":
        assert math.isinf(ledger.sessions.half_life_s)


def test_the_switchyard_order_is_the_fair_schedulers_key():
    sched, _ = _scheduler("switchyard")
    sched.ledger.charge("busy", "noisy", 10_000, 0.0)  # the noisy tenant has received service already
    first = Request(request_id="noisy-1", agent_id="busy", tenant_id="noisy", priority=PriorityClass.NORMAL,
                    prompt_tokens=100, arrival=0.0)
    second = Request(request_id="quiet-1", agent_id="calm", tenant_id="quiet", priority=PriorityClass.NORMAL,
                     prompt_tokens=100, arrival=0.5)
    for req in (first, second):
        sched.add_request(req, 1.0)
    sched.flush(agents_bench.FlushReason.STEP, 1.0)
    assert [r.request_id for r in sched.queue] == ["quiet-1", "noisy-1"]
    assert [r.request_id for r in sched.queue] == [r.request_id for r in sorted(
        (first, second), key=lambda r: sched.fair_key(r, 1.0))]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_completes_the_workload(policy):
    run = PolicyRun(policy, SMALL, SwitchyardConfig())
    row = summarize(run.run())
    core, queue = SHIPPED[policy]
    assert (row["scheduler"], row["queue"]) == (core.__name__, queue.__name__)
    assert row["tasks_completed"] > 0 and row["unfinished_tasks"] == 0
    assert sum(row["resumes"].values()) > 0
    assert 0 < row["jain_tenants"] <= 1
    assert row["isolated_p95_s"] > 0 and row["slowdown_p95"] >= 1.0


def test_switchyard_decides_each_tool_wait_in_the_scheduler_and_charges_its_ledger():
    run = PolicyRun("switchyard", SMALL, SwitchyardConfig())
    result = run.run()
    assert isinstance(run.sched, FairScheduler)
    assert sum(result.decisions.values()) > 0
    decided = {k: v for k, v in result.decisions.items() if k not in (UNDECIDED, LOST)}
    assert decided == result.scheduler_decisions  # each counted by SchedulerCore.tool_wait itself
    assert result.decisions[UNDECIDED] == result.decisions[LOST] == 0  # announced as the step parks, answered
    assert run.sched.ledger.tenants.service("tenant-9", result.makespan) > 0


def test_anchor_ledgers_are_charged_from_the_engine_steps():
    run = PolicyRun("llmd-las", SMALL, SwitchyardConfig())
    result = run.run()
    assert run.ledger is not None and run.ledger is run.sched.queue.ledger
    assert run.ledger.sessions.service(agent_key("tenant-9", "t9-a0"), result.makespan) > 0
    assert sum(result.scheduler_decisions.values()) == 0  # the anchors announce no tool waits


def test_capacity_is_where_fcfs_throughput_peaks():
    held, sweep = capacity_scale(Workload(tenant_agents=2, noisy_agents=10, seconds=6), SwitchyardConfig(),
                                 scales=(0.5, 1.0, 2.0))
    assert [s["load_scale"] for s in sweep] == [0.5, 1.0, 2.0]
    assert held == max(sweep, key=lambda s: (s["throughput_tokens_per_s"], -s["load_scale"]))["load_scale"]


def test_cli_prints_json_rows_with_a_real_dram_tier(capsys):
    assert agents_bench.main(["--policies", "fcfs,switchyard", "--tenant-agents", "2", "--noisy-agents", "10",
                              "--load-scale", "1", "--seconds", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in report["rows"]] == ["fcfs", "switchyard"]
    ours = report["rows"][1]
    assert ours["scheduler"] == "FairScheduler" and ours["queue"] == "FairQueue"
    assert ours["tool_wait_decisions"]["swap"] > 0, "the noisy tenant's long tools are swapped to the DRAM tier"
    assert ours["resumes"]["restored"] > 0


def test_cli_rejects_an_unknown_policy(capsys):
    assert agents_bench.main(["--policies", "fcfs,lottery"]) == 2
    assert "--policies" in capsys.readouterr().err


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="policy"):
        PolicyRun("lottery", SMALL, SwitchyardConfig())
    with pytest.raises(ValueError, match="policy"):
        _scheduler("lottery")


def test_swapped_agents_are_restored_ahead_of_their_tools_return_and_resume_warm(redis_db):
    """The bench's loop carries out the scheduler's planned restores (out.prefetch, on_idle's) as the step
    loop does: a swapped agent's KV comes back from the real DRAM tier in the background and its next turn
    finds it in HBM."""
    run = PolicyRun("switchyard", SMALL, SwitchyardConfig(), redis_db.dram_config)
    result = run.run()
    assert result.decisions["swap"] > 0
    assert result.prefetches_started > 0 and result.prefetches_landed > 0
    assert run.prefetches is not None and run.prefetches.in_flight == 0
    assert result.swapped_resumes["warm"] > 0, "no swapped agent found its KV restored ahead of its turn"
    assert result.prefetch_returns["on_time"] > 0
    assert result.swapped_resumes["warm"] <= sum(n for (_, resume), n in run.sched.counters.tool_resumes.items()
                                                 if resume == "warm")
