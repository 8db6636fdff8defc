"""``switchyard bench agents`` end to end on a small load (simulated clock, embedded redis-server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard_harness.bench import agents_bench

pytestmark = pytest.mark.no_gpu

# 30 agents on a 40 GB device: a 20 GB KV budget against a working set of about 30 GB, so eviction must act
SMALL = ["--agents", "30", "--seconds", "4", "--hbm-gb", "40", "--answer-tokens", "32-64", "--json"]


def test_agents_bench_evicts_to_dram_and_restores_without_failing_a_task(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "agents.json"
    assert agents_bench.main([*SMALL, "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report and out.with_suffix(".png").stat().st_size > 0
    assert report["oom"] == 0 and sum(report["tasks_failed"].values()) == 0
    assert sum(report["tasks_completed"].values()) > 0
    assert report["tiers"]["hbm"]["evictions"] > 0, "the budget was meant to force eviction"
    assert report["tiers"]["hbm"]["demotions"] > 0 and report["tiers"]["dram"]["promotions"] > 0
    assert report["tool_resumes"]["restored_share"] >= 0.9
    assert report["restored_tokens"] > 0 and report["recomputed_tokens"] == 0
    assert 0 <= report["fragmentation_ratio"]["mean"] <= report["fragmentation_ratio"]["max"] <= 1


def test_without_a_dram_tier_evicted_prefixes_are_recomputed(capsys: pytest.CaptureFixture[str]) -> None:
    assert agents_bench.main([*SMALL, "--dram", "off"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["oom"] == 0 and sum(report["tasks_failed"].values()) == 0
    assert report["restored_tokens"] == 0 and report["recomputed_tokens"] > 0
    assert report["tool_resumes"]["restored"] == 0


def test_agents_bench_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        agents_bench.main(["--think", "0.5-0.1"])
    with pytest.raises(SystemExit):
        agents_bench.main(["--dram", "nowhere"])
    assert agents_bench.main(["--agents", "0"]) == 2


def _accounted(report: dict) -> None:
    for name, started in report["tasks_started"].items():
        ended = (report["tasks_completed"][name] + report["tasks_failed"][name] + report["tasks_unfinished"][name])
        assert started == ended, f"{name}: {started} started, {ended} accounted for"
    assert sum(report["tasks_started"].values()) > 0


def test_every_started_task_is_accounted_for_and_tasks_under_way_drain(capsys: pytest.CaptureFixture[str]) -> None:
    assert agents_bench.main([*SMALL, "--dram", "off"]) == 0
    drained = json.loads(capsys.readouterr().out)
    _accounted(drained)
    assert sum(drained["tasks_unfinished"].values()) == 0  # the window closed mid-task for many: they drained
    assert drained["makespan_s"] > 4
    assert agents_bench.main([*SMALL, "--dram", "off", "--drain-limit", "1"]) == 0  # cut at the window
    cut = json.loads(capsys.readouterr().out)
    _accounted(cut)
    assert sum(cut["tasks_unfinished"].values()) > 0


def test_a_dram_tier_that_keeps_nothing_reports_its_resumes_recomputed_not_restored(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Redis whose maxmemory (1 byte) refuses every KV write: steps sent to DRAM miss there and are
    recomputed. Before, each counted as "restored from DRAM" and the report printed 100 % restored."""
    import redis

    from redis_fixtures import start_redis

    server = start_redis()
    try:
        redis.Redis(host=server.host, port=server.port).config_set("maxmemory", "1")
        assert agents_bench.main([*SMALL, "--dram", server.address]) == 0
    finally:
        server.stop()
    report = json.loads(capsys.readouterr().out)
    _accounted(report)
    assert report["tiers"]["dram"]["hits"] == 0 and report["tiers"]["hbm"]["misses"] > 0
    assert report["tool_resumes"]["restored"] == 0 and report["restored_tokens"] == 0
    assert report["tool_resumes"]["recomputed"] > 0 and report["tool_resumes"]["restored_share"] == 0
    assert report["restored_token_share"] == 0


def test_rag_prefill_answers_take_their_static_part_from_the_prefix_cache(capsys: pytest.CaptureFixture[str]) -> None:
    """--rag-prefill runs the same rag_answer arrivals without and with the early prefill: with it, each
    answer's static part was prefilled ahead (the prefix cache holds its blocks), so the answers prefill
    about the passages only; without it, nothing is shared."""
    assert agents_bench.main(["--rag-prefill", "--seconds", "3", "--rag-rate", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tasks, tokens = report["tasks"], report["answer_prefill_tokens"]
    assert tasks > 0
    static = report["static_tokens_p50"]
    assert tokens["without"] >= tasks * (static + 1)  # every answer prefilled its whole prompt
    assert tokens["without"] - tokens["early"] >= tasks * (static - 16)  # all but at most one block each
    assert set(report["ttft_p50_s"]) == {"without", "early"} and report["target_gain_s"] > 0


@pytest.mark.parametrize("mode", [["--agents", "5", "--dram", "off"], ["--policies", "fcfs", "--dram", "off"],
                                  ["--rag-prefill"]])
def test_a_device_too_small_for_the_weights_is_a_usage_error_naming_hbm_gb(
        capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    """--hbm-gb 1 leaves the modelled 7B's 13 GiB of weights no room: exit 2 with the scheduler's own reason,
    naming the flag, before anything runs (before: a ValueError traceback from inside the run)."""
    assert agents_bench.main(["--hbm-gb", "1", "--seconds", "2", *mode]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("switchyard bench agents: --hbm-gb 1: memory_policy.toml [hbm] capacity_ratio")
    assert "leaves no room beside" in captured.err and captured.out == ""


def test_the_command_line_says_so_without_a_traceback() -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "switchyard.cli", "bench", "agents", "--hbm-gb", "1", "--agents", "5",
                          "--seconds", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--hbm-gb 1: " in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("command", ["agents", "sched"])
def test_the_class_mix_is_percent_summing_to_100(capsys: pytest.CaptureFixture[str], command: str) -> None:
    from switchyard_harness.bench import sched_bench

    main = agents_bench.main if command == "agents" else sched_bench.main
    for mix, says in (("50/50/50", "which sums to 150"), ("10/10/10", "which sums to 30"),
                      ("-10/60/50", "summing to 100"), ("20/80", "summing to 100")):
        with pytest.raises(SystemExit) as exit_:
            main([f"--mix={mix}"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --mix: expected CORE/NORMAL/BATCH percentages summing to 100" in err and says in err
    parser = agents_bench.build_parser() if command == "agents" else sched_bench.build_parser()
    assert parser.parse_args(["--mix", "33.3/33.3/33.4"]).mix == (33.3, 33.3, 33.4)
    assert "summing to 100" in parser.format_help()


def test_a_clean_policies_run_logs_no_dram_outage(capsys: pytest.CaptureFixture[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The run a user reported: each policy run's tiers closed their Redis client while a background delete
    (MemoryTiers.discard) awaited its reply, and the run ended in "DRAM tier unavailable: ... failed KV delete:
    ConnectionError: Connection closed by server" against a Redis that was up all along (MemoryTiers.aclose now
    waits for its deletes)."""
    import logging

    with caplog.at_level(logging.WARNING):
        assert agents_bench.main(["--policies", "fcfs", "--seconds", "2", "--seed", "11", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["policy"] == "fcfs"
    dram = [r.getMessage() for r in caplog.records if r.name.startswith("switchyard.common.dram")]
    assert dram == [], dram


def test_a_class_that_ran_no_task_shows_no_figure_not_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert agents_bench.main(["--agents", "10", "--seconds", "3", "--dram", "off", "--mix", "100/0/0", "--json"]) == 0
    per_class = json.loads(capsys.readouterr().out)["per_class_p95_s"]
    assert per_class["normal"] == {"ttft": None, "task_completion": None} and per_class["core"]["ttft"] > 0


@pytest.mark.parametrize("argv, says", [
    (["--rag-prefill", "--stack"], "--stack: applies to --policies only, not to this run (--rag-prefill)"),
    (["--stack", "--agents", "3"], "--stack: applies to --policies only, not to this run (the agents load"),
    (["--policies", "fcfs", "--agents", "5"], "--agents: applies to the agents load"),
    (["--policies", "fcfs", "--think", "0.1-0.2"], "--think: applies to the agents load"),
    (["--rag-prefill", "--dram", "off"], "--dram: applies to the agents load (neither --policies nor --rag-prefill) "
                                         "or --policies only, not to this run (--rag-prefill)"),
    (["--rag-rate", "3"], "--rag-rate: applies to --rag-prefill only"),
    (["--policies", "fcfs", "--retrieval-s", "0.5"], "--retrieval-s: applies to --rag-prefill only"),
    (["--rag-prefill", "--policies", "fcfs"], "--rag-prefill and --policies: expected one of them"),
    (["--policies", "fcfs", "--stack-engine", "openai"], "--stack-engine openai: applies with --stack only"),
])
def test_an_option_the_run_does_not_read_is_refused_naming_it(
        capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    """Each run reads its own options; one given to another run did nothing and the run went on, silently:
    --rag-prefill --stack printed the simulated clock's figures, --stack without --policies ran the agents load,
    --stack-engine openai without --stack the simulated clock. Exit 2 naming the option, before anything runs."""
    assert agents_bench.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("switchyard bench agents: ") and says in captured.err, captured.err
    assert captured.out == ""


@pytest.mark.parametrize("flag", ["--seconds", "--rag-rate", "--retrieval-s", "--load-scale", "--tool-time-scale",
                                  "--hbm-gb", "--drain-limit"])
def test_an_infinite_number_is_refused(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """--rag-prefill --rag-rate inf drew every arrival at time 0 and never reached the load window's end: the run
    hung, growing without bound. Every number > 0 is finite too."""
    with pytest.raises(SystemExit) as exit_:
        agents_bench.main([flag, "inf"])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected a finite number > 0, got 'inf'" in capsys.readouterr().err


@pytest.mark.parametrize("command, flag, value, says", [
    ("sched", "--prompt-tokens", "-1", "expected LOW-HIGH with 1 <= LOW <= HIGH, got '-1'"),  # "invalid _pair value"
    ("agents", "--tool-calls", "a-b", "expected LOW-HIGH with 1 <= LOW <= HIGH, got 'a-b'"),
    ("agents", "--think", "1-inf", "expected LOW-HIGH seconds with 0 <= LOW <= HIGH, finite, got '1-inf'"),  # hung
])
def test_a_range_that_is_no_range_is_refused_naming_the_option(
        capsys: pytest.CaptureFixture[str], command: str, flag: str, value: str, says: str) -> None:
    from switchyard_harness.bench import sched_bench

    with pytest.raises(SystemExit) as exit_:
        (agents_bench.main if command == "agents" else sched_bench.main)([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err
