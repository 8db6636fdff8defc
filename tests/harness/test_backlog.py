"""switchyard_harness.backlog: settling a load generator's backlog (its cancels against a real HTTP face are in
test_http_bench.py and test_field_workflows.py)."""

from __future__ import annotations

import asyncio

import pytest

from switchyard_harness import backlog

pytestmark = pytest.mark.no_gpu


async def test_a_cancel_left_unanswered_is_named_with_its_bound():
    """aiohttp's timeout has no message: the task's outcome read 'error: TimeoutError: '."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # reads the request, never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        outcomes = await backlog.settle(f"http://127.0.0.1:{port}", ["task-1"], keep=False, timeout_s=0.2)
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert outcomes == {"task-1": ("", "error: no answer within 0.2 s")}
    assert "(first: no answer within 0.2 s)" in backlog.backlog_summary(outcomes, 0, keep=False)


async def test_tasks_whose_cancel_failed_are_not_counted_as_finished_in_the_summary():
    """The orchestrator stopped during a locust run: every cancel at the stop was refused, and the line read
    'backlog at the stop: 0 of the 99 tasks the users submitted had not finished (0 queued, 0 running): cancelled;
    99 could not be cancelled': whether those 99 had finished is not known, and 0 of them was cancelled."""
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens there now: each cancel is refused
    outcomes = await backlog.settle(f"http://127.0.0.1:{port}", ["task-1", "task-2"], keep=False, timeout_s=2)
    outcomes["task-3"] = ("queued", "cancelled")
    outcomes["task-4"] = ("", "done")
    summary = backlog.backlog_summary(outcomes, 0, keep=False)
    assert summary.startswith(
        "backlog at the stop: of the 4 tasks the users submitted, 2 could not be cancelled (first: "), summary
    assert summary.endswith("), so whether they had finished is not known; of the other 2, 1 had not finished "
                            "(1 queued, 0 running): cancelled (--keep-backlog keeps them)"), summary
    kept = backlog.backlog_summary(outcomes, 0, keep=True)
    assert kept.startswith("backlog at the stop: of the 4 tasks the users submitted, 2 could not be read"), kept
    assert backlog.backlog_summary({"task-3": ("queued", "cancelled")}, 0, keep=False) == (  # as it was
        "backlog at the stop: 1 of the 1 tasks the users submitted had not finished (1 queued, 0 running): "
        "cancelled (--keep-backlog keeps them)")
