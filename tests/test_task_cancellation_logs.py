"""A RunTask ended by its caller's deadline leaves no "Task exception was never retrieved" traceback."""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
import pytest

from switchyard.api import agent_pb2
from test_orchestrator import stack

pytestmark = pytest.mark.no_gpu


async def test_runtasks_cut_by_their_deadline_log_no_unretrieved_task_exception(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    async with stack() as (stub, down):
        down.gate = asyncio.Event()  # generation never ends on its own: each call's deadline ends it
        async def one(timeout: float) -> grpc.StatusCode:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"), timeout=timeout):
                    pass
            return err.value.code()

        for _ in range(3):
            codes = await asyncio.gather(*(one(0.2 + 0.01 * i) for i in range(40)))
            assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
        await asyncio.sleep(0.3)  # let the server's handlers and their tasks end
        gc.collect()
        await asyncio.sleep(0)
    gc.collect()
    unretrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert unretrieved == [], unretrieved[0].getMessage()


async def test_settle_reads_an_unawaited_tasks_exception_and_logs_a_bug_once_by_name(caplog) -> None:
    from switchyard.common.tasks import settle

    async def fails(exc: BaseException) -> None:
        raise exc

    caplog.set_level(logging.DEBUG)
    settle(asyncio.create_task(fails(TimeoutError("expected")), name="outcome"))
    settle(asyncio.create_task(fails(KeyError("bug")), name="reader"), expected=lambda e: not isinstance(e, KeyError))
    await asyncio.sleep(0.01)
    gc.collect()
    await asyncio.sleep(0)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("DEBUG", "outcome ended with TimeoutError: expected (nobody was waiting for it)") in messages
    assert ("ERROR", "reader failed: 'bug'") in messages
    assert not any("never retrieved" in m for _, m in messages)
