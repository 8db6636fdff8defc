"""The double buffer: flush by size, by interval and on drain; nothing lost, duplicated or reordered."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard.dispatcher.double_buffer import BufferClosedError, DoubleBuffer, FlushReason

pytestmark = pytest.mark.no_gpu

GUARD_S = 5.0  # only guards against a hang; no test asserts on time


async def test_flushes_by_size() -> None:
    buf: DoubleBuffer[int] = DoubleBuffer(4, flush_interval_s=60.0)
    for i in range(4):
        await buf.put(i)
    batch, reason = await asyncio.wait_for(buf.next_batch(), GUARD_S)
    assert batch == [0, 1, 2, 3]
    assert reason is FlushReason.SIZE
    assert buf.flushes == {FlushReason.SIZE: 1}


async def test_flushes_by_interval_with_a_partial_buffer() -> None:
    buf: DoubleBuffer[str] = DoubleBuffer(100, flush_interval_s=0.01)
    for item in "abc":
        await buf.put(item)
    batch, reason = await asyncio.wait_for(buf.next_batch(), GUARD_S)
    assert batch == ["a", "b", "c"]
    assert reason is FlushReason.INTERVAL
    assert buf.pending == 0


async def test_close_drains_then_ends() -> None:
    buf: DoubleBuffer[int] = DoubleBuffer(10, flush_interval_s=60.0)
    await buf.put(1)
    await buf.put(2)
    buf.close()
    assert await buf.next_batch() == ([1, 2], FlushReason.DRAIN)
    assert await buf.next_batch() is None
    with pytest.raises(BufferClosedError):
        await buf.put(3)


async def test_full_buffers_push_back_instead_of_dropping() -> None:
    buf: DoubleBuffer[int] = DoubleBuffer(2, flush_interval_s=60.0)
    for i in range(4):  # 0,1 swapped out; 2,3 fill the active list
        await buf.put(i)
    blocked = asyncio.create_task(buf.put(4))
    await asyncio.sleep(0)
    assert not blocked.done()  # both lists full: the producer waits
    assert await buf.next_batch() == ([0, 1], FlushReason.SIZE)
    await asyncio.wait_for(blocked, GUARD_S)
    assert await buf.next_batch() == ([2, 3], FlushReason.SIZE)
    buf.close()
    assert await buf.next_batch() == ([4], FlushReason.DRAIN)


async def test_flush_interval_is_read_from_a_callable() -> None:
    interval = {"s": 60.0}
    buf: DoubleBuffer[int] = DoubleBuffer(100, flush_interval_s=lambda: interval["s"])
    await buf.put(1)
    waiter = asyncio.create_task(buf.next_batch())
    await asyncio.sleep(0.02)
    assert not waiter.done()  # 60 s window: still filling
    interval["s"] = 0.001
    await buf.put(2)  # wakes the consumer, which reads the new interval
    assert await asyncio.wait_for(waiter, GUARD_S) == ([1, 2], FlushReason.INTERVAL)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        DoubleBuffer(0, 0.01)
    with pytest.raises(ValueError, match="flush_interval_s"):
        DoubleBuffer(1, 0.0)


# --------------------------------------------------------------------------- property-based

_submitter = st.lists(
    st.tuples(st.sampled_from(["core", "normal", "batch"]), st.sampled_from([0.0, 0.0, 0.0005, 0.002])),
    min_size=0,
    max_size=12,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    submitters=st.lists(_submitter, min_size=1, max_size=8),
    max_batch_size=st.integers(1, 6),
    interval_ms=st.sampled_from([0.5, 1.0, 3.0]),
    consumer_delay_ms=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 1000),
)
def test_concurrent_submitters_get_exactly_once_in_order_within_priority(
    submitters: list[list[tuple[str, float]]],
    max_batch_size: int,
    interval_ms: float,
    consumer_delay_ms: float,
    seed: int,
) -> None:
    async def scenario() -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
        buf: DoubleBuffer[tuple[int, int, str]] = DoubleBuffer(max_batch_size, interval_ms / 1000)
        accepted: list[tuple[int, int, str]] = []  # in the order put() accepted them
        rng = random.Random(seed)

        async def submit(who: int, items: list[tuple[str, float]]) -> None:
            await asyncio.sleep(rng.random() * 0.001)
            for n, (priority, pause) in enumerate(items):
                item = (who, n, priority)
                await buf.put(item)
                accepted.append(item)  # no await between the append inside put() and here
                if pause:
                    await asyncio.sleep(pause)

        async def consume() -> list[tuple[int, int, str]]:
            got: list[tuple[int, int, str]] = []
            while (flushed := await buf.next_batch()) is not None:
                batch, reason = flushed
                assert 1 <= len(batch) <= max_batch_size
                assert reason is not FlushReason.SIZE or len(batch) == max_batch_size
                got.extend(batch)
                if consumer_delay_ms:
                    await asyncio.sleep(consumer_delay_ms / 1000)
            return got

        consumer = asyncio.create_task(consume())
        await asyncio.wait_for(asyncio.gather(*(submit(i, items) for i, items in enumerate(submitters))), 30)
        buf.close()
        return accepted, await asyncio.wait_for(consumer, 30)

    accepted, delivered = asyncio.run(scenario())
    # exactly once
    assert sorted(delivered) == sorted(accepted)
    assert len(set(delivered)) == len(delivered) == sum(len(s) for s in submitters)
    # in order within each priority class
    for priority in ("core", "normal", "batch"):
        assert [x for x in delivered if x[2] == priority] == [x for x in accepted if x[2] == priority]
    # and each submitter's own items in submission order
    for who in {x[0] for x in delivered}:
        numbers = [x[1] for x in delivered if x[0] == who]
        assert numbers == sorted(numbers), who
