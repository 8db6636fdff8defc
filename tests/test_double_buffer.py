"""The double buffer and the scheduler intake built on it: swaps, the idle fast path, exactly-once delivery."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.common.config import SwitchyardConfig
from switchyard.common.errors import DispatcherNotServing, QueueFullError
from switchyard.common.priority import PriorityClass
from switchyard.dispatcher.double_buffer import DoubleBuffer, FlushReason
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.request import Request, RequestStatus

pytestmark = pytest.mark.no_gpu

_PRIORITY = {c.label: c for c in PriorityClass}


def test_put_reports_full_and_swap_hands_over_in_put_order() -> None:
    buf: DoubleBuffer[int] = DoubleBuffer(3, flush_interval_s=0.02)
    assert buf.deadline() is None
    assert buf.put(1, now=10.0) is False
    assert buf.deadline() == pytest.approx(10.02)  # the first item fixes the deadline
    assert buf.put(2, now=10.01) is False
    assert buf.put(3, now=10.015) is True  # full: the owner swaps (SIZE)
    assert buf.swap() == [1, 2, 3]
    assert buf.active_size == 0 and buf.deadline() is None
    buf.put(4, now=11.0)
    assert buf.swap() == [4]


def test_take_hands_over_the_wanted_items_and_keeps_the_rest_in_order() -> None:
    buf: DoubleBuffer[int] = DoubleBuffer(10, flush_interval_s=0.02)
    for i in range(6):
        buf.put(i, now=10.0 + i)
    assert buf.take(lambda i: i % 3 == 1) == [1, 4]
    assert buf.deadline() == pytest.approx(10.02)  # still the first item's
    assert buf.take(lambda i: i > 100) == []
    assert buf.swap() == [0, 2, 3, 5]
    buf.put(7, now=20.0)
    assert buf.take(lambda i: True) == [7]
    assert buf.active_size == 0 and buf.deadline() is None


def test_interval_is_read_when_the_first_item_arrives() -> None:
    interval = {"s": 0.05}
    buf: DoubleBuffer[int] = DoubleBuffer(10, flush_interval_s=lambda: interval["s"])
    buf.put(1, now=0.0)
    assert buf.deadline() == pytest.approx(0.05)
    buf.swap()
    interval["s"] = 0.001
    buf.put(2, now=1.0)
    assert buf.deadline() == pytest.approx(1.001)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        DoubleBuffer(0, 0.01)
    with pytest.raises(ValueError, match="flush_interval_s"):
        DoubleBuffer(1, 0.0)


# --------------------------------------------------------------------------- the scheduler's intake


def scheduler(**overrides: object):  # type: ignore[no-untyped-def]
    config = SwitchyardConfig().with_overrides(**{"scheduler.max_admitted_per_decision": 1000, **overrides})
    return make_scheduler(config, SimEngine(config))


def req(name: str, priority: str = "normal", arrival: float = 0.0) -> Request:
    return Request(name, prompt="p", prompt_tokens=10, max_tokens=10, priority=_PRIORITY[priority], arrival=arrival)


def test_idle_engine_takes_a_request_at_once() -> None:
    s = scheduler()
    s.add_request(req("a"), now=1.0)
    out = s.schedule(now=1.0)  # the loop's very next turn, no interval waited
    assert [q.request_id for q in out.admitted] == ["a"]
    assert out.admitted[0].flush_reason == FlushReason.IDLE
    assert out.admitted[0].queue_wait_s == pytest.approx(1.0)  # arrival 0.0 in this synthetic clock


def test_arrivals_during_a_step_join_the_next_step_together() -> None:
    s = scheduler()
    s.add_request(req("first"), now=0.0)
    s.schedule(now=0.0)  # running now: the engine is busy stepping
    for i in range(5):  # arrive during the step: they fill the active buffer, nothing else moves
        s.add_request(req(f"b{i}", arrival=0.001 * i), now=0.001 * i)
    assert s.intake.active_size == 5 and s.waiting == []
    out = s.schedule(now=0.01)  # the step boundary
    assert [q.request_id for q in out.admitted] == [f"b{i}" for i in range(5)]
    assert {q.flush_reason for q in out.admitted} == {FlushReason.STEP}
    assert {q.batch_size for q in out.admitted} == {5}


def test_a_full_buffer_swaps_at_max_batch_size_mid_step() -> None:
    s = scheduler(**{"batching.max_batch_size": 4})
    s.add_request(req("first"), now=0.0)
    s.schedule(now=0.0)
    for i in range(4):
        s.add_request(req(f"b{i}"), now=0.001)
    assert s.intake.active_size == 0 and len(s.waiting) == 4
    assert {q.flush_reason for q in s.waiting} == {FlushReason.SIZE}


async def test_interval_flush_bounds_the_wait_for_a_swap() -> None:
    import time

    from switchyard.dispatcher.engine_loop import StepLoop

    config = SwitchyardConfig().with_overrides(**{"batching.flush_interval_ms": 5})
    s = scheduler(**{"batching.flush_interval_ms": 5})
    loop = StepLoop(config, SimEngine(config), s)  # its task is not started: it owns the flush timer alone
    s.add_request(req("first"), now=0.0)
    s.schedule(now=0.0)
    assert s.flush_deadline is None
    at = time.monotonic()
    loop.submit(req("late", arrival=at))  # the loop hands it on and arms its flush timer
    assert s.flush_deadline == pytest.approx(at + 0.005)  # the scheduler says when; the loop's timer acts
    await asyncio.sleep(0.03)  # a long step: the interval timer swaps the buffer meanwhile
    assert [q.request_id for q in s.waiting] == ["late"]
    assert s.waiting[0].flush_reason == FlushReason.INTERVAL
    loop._cancel_flush_timer()


def test_full_queue_refuses_at_once_and_closed_dispatcher_refuses_too() -> None:
    s = scheduler(**{"queues.inference.capacity": 2})
    s.add_request(req("a"), now=0.0)
    s.add_request(req("b"), now=0.0)
    with pytest.raises(QueueFullError, match=r"inference queue full: 2 items waiting \(queues.inference.capacity\)"):
        s.add_request(req("c"), now=0.0)
    assert s.num_queued == 2
    s.schedule(now=0.0)  # both admitted: their places are free again
    assert s.num_queued == 0
    s.add_request(req("d"), now=0.0)
    s.close()
    with pytest.raises(DispatcherNotServing, match="shutting down"):
        s.add_request(req("e"), now=0.0)
    assert s.schedule(now=0.0).admitted[0].flush_reason == FlushReason.DRAIN


def test_cancelled_buffered_request_leaves_the_buffer_and_frees_its_place() -> None:
    s = scheduler()
    s.add_request(req("first"), now=0.0)
    s.schedule(now=0.0)
    gone = req("gone")
    s.add_request(gone, now=0.0)
    s.add_request(req("stays"), now=0.0)
    s.finish_requests([gone], RequestStatus.FINISHED_ABORTED, now=0.0)
    assert gone.finish_reason == "cancelled" and s.num_queued == 1
    assert [q.request_id for q in s.schedule(now=0.01).admitted] == ["stays"]


# --------------------------------------------------------------------------- property-based

_arrivals = st.lists(
    st.tuples(st.sampled_from(["core", "normal", "batch"]), st.booleans()),  # (class, step boundary after it)
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(arrivals=_arrivals, max_batch_size=st.integers(1, 8), policy=st.sampled_from(["fifo", "priority"]))
def test_every_request_is_admitted_exactly_once_in_order_within_its_class(
    arrivals: list[tuple[str, bool]], max_batch_size: int, policy: str
) -> None:
    config = SwitchyardConfig().with_overrides(
        **{"scheduler.max_admitted_per_decision": 3, "batching.max_batch_size": max_batch_size,
           "scheduler.preemption_enabled": False, "scheduler.policy": policy}
    )
    s = make_scheduler(config, SimEngine(config))
    accepted: list[Request] = []
    admitted: list[Request] = []
    now = 0.0
    for n, (cls, boundary) in enumerate(arrivals):
        now += 0.001
        item = req(f"r{n}", cls, arrival=now)
        s.add_request(item, now)
        accepted.append(item)
        if boundary:
            admitted += s.schedule(now).admitted
    while s.num_waiting:
        now += 0.001
        admitted += s.schedule(now).admitted
    assert len(admitted) == len(set(map(id, admitted))) == len(accepted)  # exactly once
    for cls in _PRIORITY:
        assert [q for q in admitted if q.priority.label == cls] == [q for q in accepted if q.priority.label == cls]
    assert s.num_queued == 0
