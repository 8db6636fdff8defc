"""``switchyard bench agents --policies P --stack``: the policies on a real dispatcher, driven over gRPC."""

from __future__ import annotations

import json

import pytest

from switchyard.common.config import SwitchyardConfig
from switchyard_harness.bench import agents_bench
from switchyard_harness.bench.program_policies import Workload, render
from switchyard_harness.bench.program_stack import STACK_CLOCK, StackPolicyRun
from switchyard_harness.testing.step_plan import StepPlan

pytestmark = pytest.mark.no_gpu

QUICK = ["--load-scale", "0.05", "--tool-time-scale", "0.05", "--seconds", "1", "--tool-calls", "1-2",
         "--prompt-tokens", "200-600", "--answer-tokens", "16-48", "--dram", "off"]
"""10 tenants of 1 agent (the noisy one 5), tools at 1/20 of their stated durations, 1 s of load."""


def test_cli_runs_an_anchor_and_switchyard_on_a_real_dispatcher_and_counts_every_step(capsys):
    assert agents_bench.main(["--policies", "llmd-las,switchyard", "--stack", "--json", *QUICK]) == 0
    report = json.loads(capsys.readouterr().out)
    anchor, ours = report["rows"]
    # the anchor's order ran inside the dispatcher's scheduler; the shipped fair policy ran as configured
    assert (anchor["scheduler"], anchor["queue"]) == ("PriorityScheduler", "SessionServiceQueue")
    assert (ours["scheduler"], ours["queue"]) == ("FairScheduler", "FairQueue")
    for row in (anchor, ours):
        assert row["tasks_completed"] > 0 and row["unfinished_tasks"] == 0, row
        assert row["generated_tokens"] > 0 and row["throughput_tokens_per_s"] > 0, row
        assert row["core_slo_attainment"] is not None and 0 < row["ttft_p50_s"] < 5, row
        assert row["jain_tenants"] > 0 and row["hbm_idle_gb_s"] > 0, row  # parked agents held KV in their tools
    # every tool start was announced under switchyard (and answered by the dispatcher), none under the anchor;
    # every tool return's step was counted as warm, restored or recomputed
    assert sum(anchor["tool_wait_decisions"].values()) == 0
    assert sum(ours["tool_wait_decisions"].values()) == sum(ours["resumes"].values()) > 0
    workload = Workload(load_scale=0.05, seconds=1, tool_time_scale=0.05)
    table = render(report["rows"], workload, SwitchyardConfig(), clock=STACK_CLOCK)
    assert "a real dispatcher over gRPC on the real clock" in table
    assert "best anchor (llmd-las)" in table
    assert "every tool x 0.05" in table


def test_a_bad_tool_scale_or_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="tool_time_scale"):
        Workload(tool_time_scale=0)
    with pytest.raises(ValueError, match="policy"):
        StackPolicyRun("lottery", Workload(), SwitchyardConfig())
    with pytest.raises(ValueError, match="engine: expected one of sim, openai"):
        StackPolicyRun("fcfs", Workload(), SwitchyardConfig(), engine="torch")


def test_the_openai_engine_in_front_of_sim_openai_serves_the_same_workload(capsys):
    """sim-openai replies as each step's plan line states: tool calls through the openai engine end the
    steps that plan one, so the tasks run their tools and end; the upstream's KV is not seen (no resumes)."""
    assert agents_bench.main(["--policies", "switchyard", "--stack", "--stack-engine", "openai", "--json",
                              *QUICK]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["tasks_completed"] > 0 and row["unfinished_tasks"] == 0 and row["refused_early"] == 0, row
    assert sum(row["tool_wait_decisions"].values()) > 0, "no step ended in a tool call"
    # not measured, shown as no figure (it read HBM idle 0 and 0 tokens recomputed, as if measured)
    assert row["warm_resumes"] is None and row["hbm_idle_gb_s"] is None and row["recomputed_tokens"] is None, row
    assert row["throughput_tokens_per_s"] > 0 and row["generated_tokens"] > 0, row


def test_a_plan_line_round_trips_and_anything_else_is_no_plan():
    plan = StepPlan(12, "tool_calls", 123.5)
    assert StepPlan.parse(plan.prompt("t0-a0 task 0.000: w w")) == plan
    assert StepPlan.parse(plan.line() + "\nmore") is None  # only the last line counts
    assert StepPlan.parse("#plan twelve stop 1") is None and StepPlan.parse("") is None
    reply = plan.reply("call-1")
    assert len(reply.tokens) == 12 and reply.finish_reason == "tool_calls" and reply.tool_calls[0].call_id == "call-1"
