"""``python -m switchyard_harness.bench.orchestrator_lag``: a short run against a real dispatcher process."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from switchyard_harness.bench import orchestrator_lag

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_leaves_the_configured_task_store_and_redis_alone(tmp_path, monkeypatch, capsys, caplog):
    """Before: each of its three orchestrators took the configured task store (data/tasks.sqlite3, a running
    switchyard up stack's) and DRAM tier (logging 'DRAM tier unavailable: Redis at 127.0.0.1:6379' with no stack
    running); now they have a task store in the run's temporary folder and no DRAM tier."""
    monkeypatch.chdir(ROOT)
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
    assert orchestrator_lag.main(["--tasks", "16", "--concurrency", "4", "--words", "40",
                                  "--config-dir", str(config_dir)]) == 0
    out = capsys.readouterr()
    assert "orchestrator CPU steps: 16 chat tasks" in out.out
    assert not their_store.parent.exists()
    assert not [r.getMessage() for r in caplog.records if "DRAM tier" in r.getMessage()]
