"""The scheduling benchmark runs end to end on a small, deterministic load (simulated clock)."""

from __future__ import annotations

import json

import pytest

from switchyard_harness.bench import sched_bench

pytestmark = pytest.mark.no_gpu

SMALL = ["--seconds", "3", "--calibration", "30", "--output-tokens", "8-24", "--prompt-tokens", "50-200"]


def test_sched_bench_prints_both_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert sched_bench.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "priority" in out and "fifo" in out and "core P95 TTFT" in out


def test_sched_bench_json_favours_core_and_completes_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert sched_bench.main([*SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = {run["policy"]: run for run in report["policies"]}
    assert report["header"]["tasks"] == sum(report["header"]["by_class"].values()) > 0
    # the simulated clock makes this deterministic: no wall-clock timing involved
    assert runs["priority"]["core"]["ttft_p95_s"] < runs["fifo"]["core"]["ttft_p95_s"]
    for run in runs.values():
        assert run["batch"]["completed"] == run["batch"]["tasks"], "batch work starved"
    assert runs["fifo"]["preemptions"] == 0


def test_sched_bench_swaps_preempted_kv_through_redis_instead_of_recomputing(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert sched_bench.main([*SMALL, "--overload", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = {run["policy"]: run for run in report["policies"]}
    assert report["header"]["dram"].startswith("embedded redis-server")
    assert runs["priority"]["preemptions"] > 0 and runs["priority"]["restored_tokens"] > 0
    assert runs["priority"]["recomputed_tokens"] == 0
    assert sched_bench.main([*SMALL, "--overload", "3", "--json", "--dram", "off"]) == 0
    runs = {run["policy"]: run for run in json.loads(capsys.readouterr().out)["policies"]}
    assert runs["priority"]["preemptions"] > 0 and runs["priority"]["recomputed_tokens"] > 0
    assert runs["priority"]["restored_tokens"] == 0


def test_sched_bench_rejects_a_bad_mix() -> None:
    with pytest.raises(SystemExit):
        sched_bench.main(["--mix", "20/80"])


def test_sched_and_agents_refuse_a_load_that_never_ends_or_a_capacity_run_of_no_task(capsys) -> None:
    """--seconds inf (or nan) simulated forever with no output; --calibration 0 divided by zero. Both are
    refused as argparse refuses a bad flag, naming it, exit 2."""
    from switchyard_harness.bench import agents_bench

    for main, argv, words in (
        (sched_bench.main, ["--seconds", "inf", "--dram", "off"], "argument --seconds: expected a finite number > 0, "
                                                                  "got 'inf'"),
        (sched_bench.main, ["--overload", "nan", "--dram", "off"], "argument --overload: expected a finite number"),
        (sched_bench.main, ["--calibration", "0", "--dram", "off"], "argument --calibration: expected a whole "
                                                                    "number >= 1, got '0'"),
        (agents_bench.main, ["--seconds", "inf", "--dram", "off"], "argument --seconds: expected a finite number"),
        (agents_bench.main, ["--hbm-gb", "nan", "--dram", "off"], "argument --hbm-gb: expected a finite number"),
    ):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2 and words in capsys.readouterr().err, argv
