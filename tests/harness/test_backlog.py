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
