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
