"""`switchyard bench compare` smoke runs: every scenario completes against a real stack.

Tiny load (a few chat calls per scenario, client in a thread); no performance assertions.
Every scenario runs in-process (quick to start); A and B also as separate processes, the default.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from switchyard_harness.bench import compare
from switchyard_harness.bench.ghz_schema import SWITCHYARD_REPORT_SCHEMA

pytest.importorskip("switchyard.dispatcher.service", reason="the dispatcher service is not in this tree yet")

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[2]
QUICK_ORCHESTRATOR = ["--set", "orchestrator.cpu_executor=loop"]
"""The scenarios' orchestrators do their CPU work on their event loop: a spawn pool costs seconds per stack
(per scenario), and what these tests check is the comparison, not the orchestrator's executor."""


def test_compare_smoke_produces_every_scenario(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "results"
    argv = [
        "-D", "ghz/data/chat.json", "-n", "4", "-c", "2", "--rps", "0", "--warmup", "0",
        "--retrieval", "off", "--client", "thread", "--stack", "in-process", "--out", str(out), *QUICK_ORCHESTRATOR,
    ]
    assert compare.main(argv) == 0

    summary = json.loads((out / "compare.json").read_text())
    rows = {row["scenario"]: row for row in summary["scenarios"]}
    assert list(rows) == [s.key for s in compare.SCENARIOS]
    for key, row in rows.items():
        assert row["count"] == 4 and row["errors"] == 0, (key, row)
        assert row["engine_busy_ratio"] is not None, f"{key}: engine busy time not found on the dispatcher"
        assert set(row["latency_s"]) == {"p50", "p95", "p99"} and set(row["ttft_s"]) == {"p50", "p95"}
        report = json.loads((out / f"scenario-{key}.json").read_text())
        jsonschema.Draft202012Validator(SWITCHYARD_REPORT_SCHEMA).validate(report)
    assert rows["A"]["overrides"]["orchestrator.inference_mode"] == "inline"
    assert rows["D"]["overrides"]["batching.flush_interval_ms"] == "auto"
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| scenario |" in (out / "compare.md").read_text()
    assert "| D B, adaptive flush" in capsys.readouterr().out


def test_compare_runs_each_service_in_its_own_process_by_default(tmp_path, monkeypatch, pydoc_index_dir):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "results"
    argv = ["-D", "ghz/data/mixed.json", "-n", "6", "-c", "2", "--rps", "0", "--warmup", "1",
            "--scenarios", "A,B", "--client", "thread", "--set", f"retrieval.index_dir={pydoc_index_dir}",
            "--out", str(out), *QUICK_ORCHESTRATOR]
    assert compare.main(argv) == 0
    summary = json.loads((out / "compare.json").read_text())
    assert summary["meta"]["stack"] == "processes" and summary["meta"]["retrieval"] is True
    for row in summary["scenarios"]:
        assert row["stack"] == "processes"
        assert row["count"] == 6 and row["errors"] == 0, row
        # the dispatcher's figures crossed the process boundary through its /metrics
        assert row["engine_busy_ratio"] is not None and row["engine_busy_ratio"] > 0, row
        assert row["batch_size_mean"] is not None and row["batch_size_mean"] >= 1, row
    baseline = summary["scenarios"][0]
    assert baseline["scenario"] == "A" and baseline["batch_size_mean"] == 1.0  # one request per flush


def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="expected a comma list of A, B, C10, C20, C50, D"):
        compare.pick_scenarios("A,Z")
    assert [s.key for s in compare.pick_scenarios("d,a")] == ["A", "D"]


def test_a_negative_warmup_is_refused_before_any_stack_starts(tmp_path, capsys):
    """--warmup -1 started the first scenario's stack and ended in a ValueError traceback, 'total must be >= 1'."""
    with pytest.raises(SystemExit) as exit_:
        compare.main(["--warmup", "-1", "--scenarios", "A", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--warmup: expected a count of calls >= 0 (0: none), got -1" in capsys.readouterr().err


def test_settings_parse_as_json_or_text():
    assert compare.parse_settings(["scheduler.policy=fifo", "batching.max_batch_size=16"]) == {
        "scheduler.policy": "fifo",
        "batching.max_batch_size": 16,
    }
    # the keys as docs/configuration.md names them resolve to the same
    assert compare.parse_settings(["policy=fifo", "flush.max_batch_size=16"]) == {
        "scheduler.policy": "fifo",
        "batching.max_batch_size": 16,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        compare.parse_settings(["policy"])


def test_compare_takes_a_documented_set_key_and_names_a_bad_one(capsys):
    assert compare.main(["--set", "flush.max_batch_sise=16", "--scenarios", "A"]) == 2
    assert "--set flush.max_batch_sise: flush has no key 'max_batch_sise'; did you mean 'max_batch_size'?" in \
        capsys.readouterr().err


async def test_a_stack_process_stops_when_its_parent_goes_and_serves_profiles_as_switchyard_serve(tmp_path):
    import asyncio
    import gzip
    import urllib.request

    from switchyard_harness.bench import stack_process
    from switchyard.api import profile_pb2
    from switchyard.common.config import SwitchyardConfig

    child = await stack_process.start("dispatcher", SwitchyardConfig())
    try:
        assert child.proc.returncode is None
        url = child.metrics_url.rsplit("/metrics", 1)[0] + "/debug/pprof/profile?seconds=0.2"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
        profile = profile_pb2.Profile.FromString(gzip.decompress(body))
        assert profile.duration_nanos > 0
        child.proc.stdin.close()  # what the parent's death does to the pipe
        assert await asyncio.wait_for(child.proc.wait(), 60) == 0  # a graceful stop
    finally:
        await child.stop()
    assert not child.config_file.exists()


def test_the_scenarios_leave_the_configured_redis_and_task_store_alone(tmp_path, monkeypatch, capsys):
    """A config whose [dram] and task store are another stack's (switchyard up's Redis on 127.0.0.1:6379 and
    data/tasks.sqlite3, as the shipped config names them): the scenarios use neither. Before, each scenario's
    services took them as configured, recorded the bench's agents' memory in that stack's Redis and leased its
    task store (and, with no stack running, logged 'DRAM tier unavailable' for each scenario)."""
    import redis
    from other_stack_config import other_stack_config
    from redis_fixtures import start_redis

    monkeypatch.chdir(ROOT)
    theirs = start_redis()  # the other stack's Redis
    try:
        config_dir, their_store = other_stack_config(tmp_path, redis_port=theirs.port)
        out = tmp_path / "results"
        argv = ["-D", "ghz/data/chat.json", "-n", "4", "-c", "2", "--rps", "0", "--warmup", "0",
                "--scenarios", "B", "--retrieval", "off", "--client", "thread", "--stack", "in-process",
                "--config-dir", str(config_dir), "--out", str(out), *QUICK_ORCHESTRATOR]
        assert compare.main(argv) == 0
        client = redis.Redis(host=theirs.host, port=theirs.port)
        assert client.dbsize() == 0, sorted(client.keys())
    finally:
        theirs.stop()
    assert not their_store.parent.exists()
    summary = json.loads((out / "compare.json").read_text())
    assert summary["meta"]["dram"].startswith("off")
    assert summary["scenarios"][0]["count"] == 4 and summary["scenarios"][0]["errors"] == 0
    assert "DRAM tier of the stacks: off" in capsys.readouterr().out
