"""``python -m switchyard_harness.bench.orchestrator_lag``: a short run against a real dispatcher process."""

from __future__ import annotations

from pathlib import Path

import pytest
from other_stack_config import other_stack_config

from switchyard_harness.bench import orchestrator_lag

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_leaves_the_configured_task_store_and_redis_alone(tmp_path, monkeypatch, capsys, caplog):
    """Before: each of its three orchestrators took the configured task store (data/tasks.sqlite3, a running
    switchyard up stack's) and DRAM tier (logging 'DRAM tier unavailable: Redis at 127.0.0.1:6379' with no stack
    running); now they have a task store in the run's temporary folder and no DRAM tier."""
    monkeypatch.chdir(ROOT)
    config_dir, their_store = other_stack_config(tmp_path)
    assert orchestrator_lag.main(["--tasks", "16", "--concurrency", "4", "--words", "40",
                                  "--config-dir", str(config_dir)]) == 0
    out = capsys.readouterr()
    assert "orchestrator CPU steps: 16 chat tasks" in out.out
    assert not their_store.parent.exists()
    assert not [r.getMessage() for r in caplog.records if "DRAM tier" in r.getMessage()]


@pytest.mark.parametrize("flag", ["--tasks", "--concurrency", "--words"])
def test_a_count_below_one_is_refused_before_anything_starts(capsys, flag):
    """--tasks 0 started the dispatcher and each orchestrator to end in 'the load generator failed'; --words 0 ran."""
    with pytest.raises(SystemExit) as exit_:
        orchestrator_lag.main([flag, "0"])
    assert exit_.value.code == 2 and f"{flag}: expected a count >= 1, got 0" in capsys.readouterr().err
