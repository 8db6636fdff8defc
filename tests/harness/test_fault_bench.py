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
