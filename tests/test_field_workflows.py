"""The field's workflows against a real stack (`switchyard up --free-ports`, three processes): the curl submit and
status commands on the HTTP face, the locustfile headless, and a CPU profile of a served orchestrator."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from stack_fixtures import UpStack

from switchyard.common.profiling import read_pprof, top_functions

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def up(pydoc_index_dir):
    stack = UpStack(pydoc_index_dir)
    stack.wait_ready()
    yield stack
    stack.stop()


def http_url(up: UpStack) -> str:
    for line in up.lines:
        if m := re.match(r"\s+http\s+(http://\S+:\d+)\s", line):
            return m.group(1)
    raise AssertionError("no http line printed:\n" + "".join(up.lines))


def request(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as reply:
        return json.loads(reply.read())


def test_the_fields_curl_submit_and_status_answer_as_the_field_shows(up):
    base = http_url(up)
    body = {"agent_id": "test-001", "priority": "core", "task_type": "react_loop", "max_tokens": 128}
    accepted = request(f"{base}/api/v1/agent/submit", body)
    assert accepted["status"] == "accepted" and isinstance(accepted["queue_position"], int) and accepted["task_id"]
    for _ in range(600):
        status = request(f"{base}/api/v1/agent/test-001/status")
        if status["state"] in ("finished", "failed"):
            break
        time.sleep(0.1)
    assert status["state"] == "finished", status
    assert status["task_id"] == accepted["task_id"]
    assert status["compute_score_used"] > 0 and status["memory_peak_mb"] > 0


def test_the_locustfile_runs_headless_without_a_failure_and_writes_the_watched_figures(up, tmp_path):
    """Headless, as the field runs it: no failure, the watched figures written, and the backlog the users left
    cancelled at the stop (it ran on for minutes after locust exited: load nobody asked for)."""
    watch = tmp_path / "watch.csv"
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "locust" / "locustfile.py"), "--headless",
         "--users", "10", "--spawn-rate", "10", "--run-time", "4s", "--host", http_url(up),
         "--csv", str(tmp_path / "run"), "--watch-csv", str(watch), "--watch-interval", "1",
         "--switchyard-metrics", up.metrics_url("dispatcher"), "--only-summary"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr  # locust exits 1 on any failure
    with open(tmp_path / "run_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("/api/v1/agent/submit", "/api/v1/agent/run (SSE)", "SSE final"):
        assert int(stats[name]["Request Count"]) > 0, stats.keys()
        assert int(stats[name]["Failure Count"]) == 0
    with open(watch, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 4  # one at the start, one a second, one at the end
    gpu_read = 0.0
    with urllib.request.urlopen(up.metrics_url("dispatcher"), timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("switchyard_gpu_available "):
                gpu_read = float(line.split()[1])
    for row in rows:
        assert row["error"] == ""
        for column in ("engine_busy_ratio", "compute_score", "kv_fragmentation_ratio", "kv_oom_total"):
            float(row[column])
        # without NVML the GPU's utilisation is not read: an empty cell, not a 0 that reads as an idle GPU
        assert (0 <= float(row["gpu_utilization_ratio"]) <= 1) if gpu_read else row["gpu_utilization_ratio"] == ""
    assert int(rows[-1]["requests"]) > 0 and rows[-1]["failures"] == "0"
    assert any(float(row["compute_score"]) > 0 or float(row["engine_busy_ratio"]) > 0 for row in rows)

    # the backlog at the stop: every task still queued or running was cancelled, and reads so afterwards
    assert "backlog at the stop: " in run.stderr and "cancelled (--keep-backlog keeps them)" in run.stderr, run.stderr
    with open(tmp_path / "run_backlog.csv", newline="") as f:
        backlog = list(csv.DictReader(f))
    assert {row["outcome"] for row in backlog} <= {"cancelled", "done"}, backlog
    cancelled = [row for row in backlog if row["outcome"] == "cancelled"]
    assert cancelled, "no task was left at the stop: nothing checked"  # react_loop tasks take seconds each
    for row in cancelled[:20]:
        status = request(f"{http_url(up)}/api/v1/tasks/{row['task_id']}")
        assert status["state"] == "failed" and status["error"].startswith(
            f"CANCELLED: cancelled by CancelTask while {row['state'].upper()}"), status


@pytest.fixture(scope="module")
def orchestrator_profile(up) -> bytes:
    """One 1-second CPU profile of the served orchestrator's event loop, as the field's curl fetches it (the two
    tests below read the same bytes: a second fetch would only add its second)."""
    url = up.metrics_url("orchestrator").rsplit("/metrics", 1)[0] + "/debug/pprof/profile?seconds=1"
    with urllib.request.urlopen(url, timeout=60) as reply:
        return reply.read()


def test_a_served_orchestrator_answers_a_cpu_profile_of_its_event_loop(orchestrator_profile):
    profile = read_pprof(orchestrator_profile)
    names = [row.filename for row in top_functions(profile)]
    assert any("switchyard" in name for name in names)
    assert profile.duration_nanos >= 0.9e9


def test_a_saved_profile_is_read_back_by_switchyard_profile(orchestrator_profile, tmp_path):
    """The field's curl writes the profile to a file; ``switchyard profile FILE`` prints its top functions and
    GC pauses without asking a service again (before, FILE was taken for a service name and refused)."""
    saved = tmp_path / "agent_cpu.pprof"
    saved.write_bytes(orchestrator_profile)
    run = subprocess.run([sys.executable, "-m", "switchyard.cli", "profile", str(saved), "--top", "5"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "GC pauses:" in run.stdout and "cum%" in run.stdout and "event loop waiting:" in run.stdout
    # an idle second: few functions besides the loop's waiting and the entry frames, which are left out
    assert len([line for line in run.stdout.splitlines() if re.match(r"\s*[\d.]+ms ", line)]) <= 5
    (tmp_path / "not.pprof").write_text("hello")
    bad = subprocess.run([sys.executable, "-m", "switchyard.cli", "profile", str(tmp_path / "not.pprof")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "is not a pprof profile" in bad.stderr


def test_completion_rate_cancels_the_tasks_it_left_unfinished(up):
    """tools/completion_rate.py offers react_loop tasks faster than the stack completes them (docs/benchmarks.md: 40
    a second for 150 s, 11 to 28 finished a second); the thousands it left queued ran on for minutes after it exited,
    under whatever ran next. Now they are cancelled at its end and reported, as the locustfile's and bench http's."""
    from switchyard.common.up_files import default_path as up_file

    own = up_file().with_name(f"up-{up.proc.pid}.json")  # where a second stack on this machine writes its endpoints
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "completion_rate.py"), "--http", http_url(up), "--rps", "40",
         "--seconds", "2", "--interval", "1"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "SWITCHYARD_UP_FILE": str(own if own.exists() else up_file())})
    assert run.returncode == 0, run.stdout + run.stderr
    summary = re.search(r"backlog at the end: (\d+) of the (\d+) tasks the run submitted had not finished "
                        r"\((\d+) queued, (\d+) running\): cancelled \(--keep-backlog keeps them\)", run.stdout)
    assert summary, run.stdout
    assert int(summary[2]) == 80 and int(summary[1]) > 0, summary[0]  # 512 tokens a task: most cannot end in 2 s
    with urllib.request.urlopen(up.metrics_url("orchestrator"), timeout=10) as reply:
        text = reply.read().decode()
    for state in ("queued", "running"):
        assert f'switchyard_submitted_tasks{{state="{state}"}} 0.0' in text, state
