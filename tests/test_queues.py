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


async def test_every_wait_is_observed_once_under_how_it_ended_expired_and_cancelled_included():
    """switchyard_queue_wait_seconds was observed when a worker took an item: an item that waited past the
    queue's timeout_ms, or whose caller left, was left out, so the wait read short exactly while the queue was
    overloaded. Each wait is observed once, under its outcome; every outcome's series starts at 0."""
    from registry_values import metric

    name = "orchestration-waits"
    q = WorkQueue(name, QueueConfig(capacity=8, workers=1, timeout_ms=50))

    def counts() -> dict[str, float]:
        return {outcome: metric("switchyard_queue_wait_seconds_count", queue=name, outcome=outcome)
                for outcome in ("admitted", "expired", "cancelled")}

    assert counts() == {"admitted": 0, "expired": 0, "cancelled": 0}
    release = asyncio.Event()
    q.start()
    try:
        blocker = asyncio.create_task(q.run(release.wait))
        await asyncio.sleep(0.01)  # the worker holds the blocker
        with pytest.raises(QueueTimeoutError):
            await q.run(release.wait)
        expired = metric("switchyard_queue_wait_seconds_sum", queue=name, outcome="expired")
        assert expired >= 0.05  # its whole wait, to the timeout
        left = asyncio.create_task(q.run(release.wait))
        await asyncio.sleep(0.01)
        left.cancel()  # its caller goes while it waits
        with pytest.raises(asyncio.CancelledError):
            await left
        release.set()
        await blocker
        await q.run(lambda: asyncio.sleep(0))  # the worker skips the two abandoned items: no second observation
        assert counts() == {"admitted": 2, "expired": 1, "cancelled": 1}
        held = asyncio.Event()
        q.submit(held.wait)
        await asyncio.sleep(0.01)  # the worker holds it
        q.submit(held.wait)  # still waiting when the queue stops
    finally:
        await q.stop()
    assert counts() == {"admitted": 3, "expired": 1, "cancelled": 2}


async def test_an_item_whose_wait_ended_leaves_its_place_to_the_next():
    """An item that timed out, or whose caller left, stayed in the queue until a worker came to skip it: it
    held one of ``capacity`` places (a queue of such items refused every new one 'full' while none waited) and
    counted in the depth. It leaves as its wait ends."""
    q = WorkQueue("retrieval-left", QueueConfig(capacity=1, workers=1, timeout_ms=50))
    release = asyncio.Event()
    q.start()
    try:
        blocker = asyncio.create_task(q.run(release.wait))
        await asyncio.sleep(0.01)  # the worker holds the blocker
        with pytest.raises(QueueTimeoutError):
            await q.run(release.wait)
        assert q.depth == 0 and q.place() == 0
        left = asyncio.create_task(q.run(release.wait))  # its place is free: taken, not refused 'full'
        await asyncio.sleep(0.01)
        assert q.depth == 1
        left.cancel()  # its caller goes while it waits
        with pytest.raises(asyncio.CancelledError):
            await left
        assert q.depth == 0
        ticket = q.submit(lambda: asyncio.sleep(0, result="ran"))  # accepted: nothing waits
        release.set()
        await blocker
        assert (await ticket.result())[0] == "ran"
    finally:
        await q.stop()
