"""``switchyard bench fault`` (:func:`switchyard_harness.bench.fault.run_fault`) against
`switchyard up --dispatchers 3`: SIGKILL one dispatcher under load, and every call and
SubmitTask'd task is accounted for (the stack itself is tested in tests/test_scale_out.py)."""

from __future__ import annotations

import pytest

from switchyard_harness.bench.fault import run_fault
from test_scale_out import DISPATCHERS, pid, three  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


async def test_sigkill_under_load_retries_unstarted_calls_names_the_replica_and_loses_no_task(three):
    endpoints = {name: (three.address(name), three.metrics_url(name), pid(three, name)) for name in DISPATCHERS}
    report = await run_fault(three.address("orchestrator"), endpoints, three.metrics_url("orchestrator"),
                             "dispatcher-3", concurrency=12, duration_s=5, kill_at_s=2, max_tokens=64, submit=20)
    print("\n".join(report.lines()))
    assert report.succeeded > 0 and report.calls == report.succeeded + report.failed_after_tokens
    assert report.failed_before_tokens == 0 and not report.other_failures, report.other_failures
    assert report.failed_after_tokens == report.failed_after_tokens_naming_victim, "a cut stream names its replica"
    assert report.submitted == 20 and report.submitted_lost == 0, report.submitted_errors
    assert report.submitted_succeeded + report.submitted_failed == 20


def test_a_stack_that_ends_at_start_up_is_reported_at_once_with_its_log(tmp_path, capsys):
    """--index-dir naming no index: retrieval fails to start and switchyard up exits 1 at once, but the run sat
    silent for its whole 300 s wait for health (UpProcess.ready), then printed the log. Now it reports as soon
    as the launcher ends (UpProcess.started): the wait is cut by the exit, well inside pytest's 300 s."""
    from switchyard_harness.bench import fault

    assert fault.main(["--index-dir", str(tmp_path / "no-index"), "--duration", "5", "--kill-at", "1"]) == 1
    err = capsys.readouterr().err
    assert "the stack did not become healthy" in err and "no vector index in" in err, err
