"""``switchyard bench agents --policies``: the policy comparison on a small tenant workload (simulated clock)."""

from __future__ import annotations

import json

import pytest

from switchyard_harness.bench import agents_bench
from switchyard_harness.bench.program_policies import POLICY_NAMES, ProgramSim, Workload, jain, summarize
from switchyard.common.config import SwitchyardConfig

pytestmark = pytest.mark.no_gpu

SMALL = Workload(tenant_agents=2, noisy_agents=10, seconds=8, load_scale=1.0)


def test_jain_index():
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0.0001, 0.0001, 0.0001]) == pytest.approx(0.25, abs=0.01)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_completes_the_workload(policy):
    row = summarize(ProgramSim(policy, SMALL, SwitchyardConfig()).run())
    assert row["tasks_completed"] > 0 and row["unfinished_steps"] == 0
    assert sum(row["resumes"].values()) > 0
    assert 0 < row["jain_tenants"] <= 1


def test_switchyard_decides_each_tool_wait_and_holds_less_idle_hbm_than_a_fixed_ttl():
    ours = summarize(ProgramSim("switchyard", SMALL, SwitchyardConfig()).run())
    ttl = summarize(ProgramSim("continuum", SMALL, SwitchyardConfig()).run())
    assert sum(ours["tool_wait_decisions"].values()) >= sum(ours["resumes"].values())  # one per tool call
    assert ours["tool_wait_decisions"]["swap"] > 0, "the noisy tenant's long tools should be swapped"
    assert ours["hbm_idle_gb_s"] < ttl["hbm_idle_gb_s"]
    assert ours["missed_deadline"] == 0


def test_fcfs_keeps_no_memory_of_sessions():
    sim = ProgramSim("fcfs", SMALL, SwitchyardConfig())
    sim.run()
    assert all(v == 0 for v in summarize(sim.result)["tool_wait_decisions"].values())


def test_cli_prints_json_rows(capsys):
    assert agents_bench.main(["--policies", "fcfs,switchyard", "--tenant-agents", "2", "--noisy-agents", "10",
                              "--load-scale", "1", "--seconds", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in report["rows"]] == ["fcfs", "switchyard"]


def test_cli_rejects_an_unknown_policy(capsys):
    assert agents_bench.main(["--policies", "fcfs,lottery"]) == 2
    assert "--policies" in capsys.readouterr().err


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="policy"):
        ProgramSim("lottery", SMALL, SwitchyardConfig())
