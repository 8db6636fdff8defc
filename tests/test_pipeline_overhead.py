"""``python tools/pipeline_overhead.py``: a short run, its stack beside a config whose task store is another's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from other_stack_config import other_stack_config

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_leaves_the_configured_task_store_and_redis_alone(tmp_path):
    """Before: its orchestrator took the configured task store (data/tasks.sqlite3, a running switchyard up
    stack's) and DRAM tier (127.0.0.1:6379, that stack's Redis); now it has a task store in the run's temporary
    folder and no DRAM tier."""
    config_dir, their_store = other_stack_config(tmp_path)
    env = {**os.environ, "SWITCHYARD_CONFIG_DIR": str(config_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "harness")])}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "pipeline_overhead.py"), "--seconds", "0.4",
                          "--rounds", "1", "--concurrency", "4"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pipeline / floor:" in run.stdout, run.stdout
    assert not their_store.parent.exists()
    assert "DRAM tier unavailable" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize(("tool", "argv", "says"), [
    ("pipeline_overhead.py", ["--seconds", "nan"], "--seconds: expected a finite number of seconds > 0, got nan"),
    ("tracing_overhead.py", ["--calls", "0"], "--calls: expected a count >= 1, got 0"),  # StatisticsError
    ("task_store_bench.py", ["--concurrency", "0"], "--concurrency: expected a count >= 1, got 0"),  # a hang
])
def test_a_measuring_tool_refuses_a_count_or_duration_it_cannot_run_naming_it(tool, argv, says):
    """The README's measuring tools: nan seconds was a traceback naming --duration (the load plan's flag), a
    zero count a StatisticsError or IndexError traceback, or a run that never ended."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "harness")])}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *argv], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 2 and f"{tool}: error: {says}" in run.stderr, run.stderr[-2000:]


def test_a_server_that_exits_at_start_is_reported_at_once_not_after_the_ports_wait(tmp_path):
    """A child that exited at start (here: its config folder is not there) left the run waiting 60 s for a port
    that would never come, then a bare queue.Empty traceback; it is now named by its exit as soon as it exits."""
    env = {**os.environ, "SWITCHYARD_CONFIG_DIR": str(tmp_path / "no-such-config"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "harness")])}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "pipeline_overhead.py"), "--seconds", "0.4",
                          "--rounds", "1", "--concurrency", "4"],
                         capture_output=True, text=True, timeout=50, env=env, cwd=tmp_path)
    assert run.returncode == 1
    assert "pipeline_overhead.py: _serve_stack exited at start (exit code 1)" in run.stderr, run.stderr[-3000:]
    assert "queue.Empty" not in run.stderr
