"""``python tools/pipeline_overhead.py``: a short run, its stack beside a config whose task store is another's."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_leaves_the_configured_task_store_and_redis_alone(tmp_path):
    """Before: its orchestrator took the configured task store (data/tasks.sqlite3, a running switchyard up
    stack's) and DRAM tier (127.0.0.1:6379, that stack's Redis); now it has a task store in the run's temporary
    folder and no DRAM tier."""
    with socket.socket() as sock:  # a port nothing listens on: the configured Redis, absent
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    config_dir = tmp_path / "config"
    shutil.copytree(ROOT / "config", config_dir)
    policy = config_dir / "memory_policy.toml"
    policy.write_text(policy.read_text().replace("port = 6379", f"port = {dead}", 1))
    their_store = tmp_path / "theirs" / "tasks.sqlite3"
    settings = config_dir / "switchyard.json"
    settings.write_text(settings.read_text().replace('"data/tasks.sqlite3"', json.dumps(str(their_store)), 1))
    env = {**os.environ, "SWITCHYARD_CONFIG_DIR": str(config_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "harness")])}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "pipeline_overhead.py"), "--seconds", "0.4",
                          "--rounds", "1", "--concurrency", "4"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pipeline / floor:" in run.stdout, run.stdout
    assert not their_store.parent.exists()
    assert "DRAM tier unavailable" not in run.stderr, run.stderr[-3000:]
