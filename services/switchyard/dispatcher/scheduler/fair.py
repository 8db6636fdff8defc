"""The fair policy: priority classes, and inside a class deadlines at risk first, then fairness.

Order of the waiting set (smallest key first), fixed when a request joins it::

    (class, not at risk, latest start if at risk, tenant's weighted service, session's service, arrival)

- Classes strictly: core, then normal, then batch (no aging across classes;
  the ``priority`` policy's aging is not applied here).
- A request *at risk* (its slack below :attr:`FairScheduler.slack_urgent_s`)
  goes ahead of the rest of its class, least slack first (latest start time
  ``now + slack``): :mod:`.slack` (least-laxity-first; earliest deadline
  first, Liu & Layland 1973). Slack comes from the request's ``time_left_s``,
  ``expected_remaining_work_s`` and its own expected service (the engine's
  prefill of its uncomputed tokens).
- The rest: the tenant's weighted attained service (llm-d inference
  scheduler's per-flow fairness, the flow being the tenant), then the agent
  session's (Autellix's program-level least attained service), then arrival:
  :mod:`.fairness`.

A request whose task can no longer make its deadline is refused when it
arrives (:class:`~switchyard.dispatcher.scheduler.slack.CannotMeetDeadline`,
DEADLINE_EXCEEDED naming it and its slack) instead of being served late.

Attained service is charged after every engine step from what the step
computed for each of its requests (:meth:`FairScheduler.update_from_output`:
the prompt tokens it prefilled, one per decoded token). The order is the
waiting queue's key (:class:`FairQueue`, the
:class:`~switchyard.dispatcher.scheduler.request_queue.RequestQueue` contract),
fixed when a request joins the queue.

Admission and preemption are the ``priority`` policy's.
"""

from __future__ import annotations

from typing import Any

from switchyard.dispatcher.engines.base import StepBatch, StepResult
from switchyard.dispatcher.request import Request, RequestOutput
from switchyard.dispatcher.scheduler import slack as slack_rule
from switchyard.dispatcher.scheduler.base import class_rank
from switchyard.dispatcher.scheduler.fairness import FairnessLedger
from switchyard.dispatcher.scheduler.priority import PriorityScheduler
from switchyard.dispatcher.scheduler.request_queue import OrderKey, RequestQueue


class FairQueue(RequestQueue):
    """The fair policy's waiting queue: ``order_key`` is :meth:`FairScheduler.fair_key`."""

    name = "fair"

    def __init__(self, policy: "FairScheduler") -> None:
        super().__init__()
        self.policy = policy

    def order_key(self, req: Request, now: float) -> OrderKey:
        return self.policy.fair_key(req, now)


class FairScheduler(PriorityScheduler):
    """Classes, then least slack for work at risk, then tenant and session fairness (module docstring).

    Args: see :class:`~switchyard.dispatcher.scheduler.core.SchedulerCore`.
    """

    name = "fair"
    fairness_half_life_s = 60.0
    """Half-life of attained service, seconds."""
    slack_urgent_s = 5.0
    """A request whose slack is below this many seconds is at risk: least slack first in its class."""
    tenant_weights: dict[str, float] = {}
    """Tenant id -> weight (unnamed tenants weigh 1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ledger = FairnessLedger(self.fairness_half_life_s, dict(self.tenant_weights))
        super().__init__(*args, **kwargs)

    def make_queue(self) -> RequestQueue:
        """:class:`FairQueue`, ordered by :meth:`fair_key`."""
        return FairQueue(self)

    def expected_service_s(self, req: Request) -> float:
        """Seconds of engine time ``req`` is expected to need: the prefill of what it has not computed."""
        return self.tiers.recompute_seconds(req.num_uncomputed_tokens)

    def slack(self, req: Request, now: float) -> float:
        """``req``'s slack at ``now`` (:func:`switchyard.dispatcher.scheduler.slack.slack_s`), seconds."""
        left = None if req.task_time_left_s is None else req.task_time_left_s - max(0.0, now - req.arrival)
        return slack_rule.slack_s(left, req.expected_remaining_work_s, self.expected_service_s(req))

    def add_request(self, req: Request, now: float) -> None:
        """As :meth:`SchedulerCore.add_request`, refusing first a request that cannot make its deadline.

        Raises:
            CannotMeetDeadline: its slack is already negative (DEADLINE_EXCEEDED).
        """
        if req.task_time_left_s is not None:
            left = req.task_time_left_s - max(0.0, now - req.arrival)
            slack_rule.check(req.request_id, left, req.expected_remaining_work_s, self.expected_service_s(req))
        super().add_request(req, now)

    def fair_key(self, req: Request, now: float) -> OrderKey:
        """``(class, not at risk, latest start if at risk, tenant's weighted service, session's service,
        arrival)`` for ``req`` joining the queue at ``now`` (the module docstring's order)."""
        slack = self.slack(req, now)
        urgent = slack < self.slack_urgent_s
        tenant, session, arrival = self.ledger.order_key(req.agent_id, req.tenant_id, req.arrival, now)
        return (float(class_rank(req)), 0.0 if urgent else 1.0, now + slack if urgent else 0.0, tenant, session,
                arrival)

    def update_from_output(self, batch: StepBatch, result: StepResult, now: float) -> list[RequestOutput]:
        """:meth:`SchedulerCore.update_from_output`, after charging each of ``batch``'s requests the
        service the step gave it: the prompt tokens it prefilled, one token per decode."""
        for req, tokens in batch.prefill:
            if tokens > 0:
                self.ledger.charge(req.agent_id, req.tenant_id, tokens, now)
        for req in batch.decode:
            self.ledger.charge(req.agent_id, req.tenant_id, 1, now)
        return super().update_from_output(batch, result, now)
