"""The waiting queue's contract: a policy is its order_key; another ordering plugs into the scheduler."""

from __future__ import annotations

import pytest

from switchyard.common.priority import PriorityClass
from switchyard.api import agent_pb2
from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import FcfsQueue, PriorityAgingQueue, RequestQueue, make_scheduler
from switchyard.dispatcher.scheduler.priority import head_start
from switchyard_harness.testing.scheduling import accept
from switchyard_harness.testing.capacity import FixedSlots

pytestmark = pytest.mark.no_gpu


def req(rid: str, arrival: float, priority: int = agent_pb2.NORMAL, max_tokens: int = 4, **fields: object) -> Request:
    return Request(request_id=rid, prompt="x", prompt_tokens=4, max_tokens=max_tokens, arrival=arrival,
                   priority=PriorityClass.from_proto(priority), **fields)


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_orders_by_arrival_and_ties_keep_the_order_they_joined() -> None:
    queue = FcfsQueue()
    for r in (req("b", 2.0), req("a", 1.0), req("c", 2.0), req("d", 0.5)):
        queue.add(r, now=3.0)
    assert ids(queue) == ["d", "a", "b", "c"] and len(queue) == 4
    assert queue.peek().request_id == "d" and queue.pop().request_id == "d"
    [b] = [r for r in queue if r.request_id == "b"]
    assert queue.remove(b) and not queue.remove(b) and ids(queue) == ["a", "c"]


def test_priority_aging_gives_each_class_its_head_start_and_resumed_agents_the_head_of_their_class() -> None:
    queue = PriorityAgingQueue(head_start(SwitchyardConfig().scheduler))  # core 5 s, normal 2.2 s, batch 0
    queue.add(req("batch", 0.0, agent_pb2.BATCH), now=10.0)
    queue.add(req("normal", 3.0), now=10.0)
    queue.add(req("core", 6.0, agent_pb2.CORE), now=10.0)
    queue.add(req("late-normal", 1.0), now=10.0)
    queue.add(req("resumed", 9.0, resume=True), now=10.0)  # ahead of every waiting new normal request
    # virtual arrivals: batch 0, normal 0.8, core 1.0, late-normal -1.2; resumed takes late-normal's -1.2
    assert ids(queue) == ["resumed", "late-normal", "batch", "normal", "core"]


class LeastServedFirst(RequestQueue):
    """Least output first (a request preempted after some tokens waits behind fresh ones), then arrival."""

    def order_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (float(req.num_output_tokens), req.arrival)


def test_another_order_plugs_into_the_scheduler_through_order_key() -> None:
    sched = make_scheduler(SwitchyardConfig(), queue=LeastServedFirst(), capacity=FixedSlots(1))
    served, fresh, older = req("served", 0.0), req("fresh", 2.0), req("older", 1.0)
    served.output_tokens = ["a", "b"]  # it ran before
    accept(sched, [served, fresh, older], now=3.0)
    assert [r.request_id for r in sched.waiting] == ["older", "fresh", "served"]
    assert [r.request_id for r in sched.schedule(now=3.0).admitted] == ["older"]


def test_reorder_computes_every_key_again() -> None:
    class Slack(RequestQueue):
        """Least slack first: deadline - now - work left (here 0.1 s per token)."""

        def order_key(self, req: Request, now: float) -> tuple[float, ...]:
            return (req.deadline - now - 0.1 * req.remaining_tokens,)  # type: ignore[operator]

    queue = Slack()
    short, long = req("short", 0.0, deadline=10.0, max_tokens=1), req("long", 0.0, deadline=11.0, max_tokens=40)
    queue.add(short, now=0.0)
    queue.add(long, now=0.0)
    assert ids(queue) == ["long", "short"]  # 11 - 4 < 10 - 0.1
    long.deadline = 20.0
    assert ids(queue) == ["long", "short"]  # keys are fixed while waiting...
    queue.reorder(now=1.0)
    assert ids(queue) == ["short", "long"]  # ...until the policy reorders
