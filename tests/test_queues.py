"""WorkQueue: a full queue rejects, a long wait times out, nothing is dropped."""

import asyncio

import pytest

from switchyard.common.config import QueueConfig
from switchyard.common.queues import QueueFullError, QueueTimeoutError, WorkQueue


async def test_runs_items_and_reports_wait():
    q = WorkQueue("orchestration", QueueConfig(capacity=4, workers=2, timeout_ms=1000))
    q.start()
    try:
        async def job(x):
            await asyncio.sleep(0)
            return x * 2

        results = await asyncio.gather(*(q.run(lambda x=x: job(x)) for x in range(4)))
        assert [r for r, _ in results] == [0, 2, 4, 6]
        assert all(wait >= 0 for _, wait in results)
    finally:
        await q.stop()


async def test_full_queue_rejects_naming_queue():
    q = WorkQueue("retrieval", QueueConfig(capacity=2, workers=1, timeout_ms=5000))
    release = asyncio.Event()
    q.start()
    try:
        blocker = asyncio.create_task(q.run(release.wait))
        await asyncio.sleep(0.01)  # the worker holds the blocker
        assert q.place() == 0
        waiting = [q.submit(release.wait) for _ in range(2)]
        with pytest.raises(QueueFullError, match="retrieval queue full"):
            q.submit(release.wait)
        with pytest.raises(QueueFullError, match="retrieval queue full"):
            q.place()  # admission to a full queue is refused the same way
        release.set()
        await blocker
        for ticket in waiting:  # the two accepted items still run: nothing dropped
            await ticket.result()
    finally:
        await q.stop()


async def test_wait_longer_than_timeout_fails_naming_queue():
    q = WorkQueue("orchestration", QueueConfig(capacity=8, workers=1, timeout_ms=50))
    release = asyncio.Event()
    q.start()
    try:
        blocker = asyncio.create_task(q.run(release.wait))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueTimeoutError, match=r"orchestration queue.*timeout_ms = 50"):
            await q.run(release.wait)
        release.set()
        await blocker
        ran = []
        await q.run(lambda: asyncio.sleep(0, result=ran.append(1)))
        assert ran == [1]  # the timed-out item was skipped, not run late
    finally:
        await q.stop()


async def test_exception_reaches_caller():
    q = WorkQueue("inference", QueueConfig(capacity=2, workers=1, timeout_ms=1000))
    q.start()
    try:
        async def boom():
            raise ValueError("bad")

        with pytest.raises(ValueError, match="bad"):
            await q.run(boom)
    finally:
        await q.stop()
