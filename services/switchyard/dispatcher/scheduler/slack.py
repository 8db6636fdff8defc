"""Deadlines budgeted across a task: slack, least slack first, and refusing what cannot make it.

A task's caller gives it a time limit (``orchestrator.task_time_limit_s``, or
the caller's own); each of its model calls reaches the dispatcher with the
task's *time left* and the *expected remaining work* after this call (the
orchestrator's measured step and tool times for the steps still ahead). The
request's own *expected service time* is the engine's prefill of what it has
not computed plus its expected decode. Then::

    slack = time_left - expected_remaining_work - expected_service

is the time the task can still afford to wait, and within a priority class
the requests at risk (slack below ``scheduler.at_risk_slack_s``) are served
least slack first, ahead of the rest of their class. This is least-laxity-first
(laxity = deadline - now - remaining work; Mok 1983), the dynamic-priority
companion of earliest deadline first (Liu & Layland 1973): with known work,
serving least laxity first meets every deadline that any order meets on one
server, and unlike EDF it sees that a long task with a later deadline may be
the more urgent. Work with no deadline has infinite slack: it is never at
risk, and is ordered with the rest of its class by fairness
(:mod:`.fair`).

A request whose slack is already negative cannot make its deadline even if
served at once: it is refused early, by name (DEADLINE_EXCEEDED naming the
request and its slack, :class:`CannotMeetDeadline`), instead of using the
engine for an answer that comes too late. :func:`cannot_make_it` is that test.
The order itself is the fair policy's queue key
(:meth:`switchyard.dispatcher.scheduler.fair.FairScheduler.fair_key`: latest start ``now + slack``).

All times are seconds; ``now`` is the caller's clock (``time.monotonic()``).
"""

from __future__ import annotations

import math

from switchyard.common.errors import RequestDeadlineExceeded, request_named

__all__ = ["NO_DEADLINE", "CannotMeetDeadline", "cannot_make_it", "check", "slack_s"]

NO_DEADLINE = math.inf
"""Slack of a request whose task has no deadline."""


def slack_s(time_left_s: float | None, expected_remaining_work_s: float = 0.0, expected_service_s: float = 0.0) -> float:
    """``time_left - expected_remaining_work - expected_service`` (seconds; may be negative).

    ``time_left_s`` None (not given) or infinite means no deadline: :data:`NO_DEADLINE`; a time left of 0
    or less is a deadline already past (a negative slack). Negative work estimates count as 0.

    Args:
        time_left_s: the task's time left when the request arrives (None: no deadline).
        expected_remaining_work_s: the task's expected work after this request (its remaining steps
            and tool calls).
        expected_service_s: this request's expected engine time (prefill + decode).
    """
    if time_left_s is None or math.isinf(time_left_s):
        return NO_DEADLINE
    return float(time_left_s) - max(0.0, expected_remaining_work_s) - max(0.0, expected_service_s)


def cannot_make_it(slack: float, margin_s: float = 0.0) -> bool:
    """True when the task cannot meet its deadline even if this request is served at once: ``slack < 0``, or
    short by more than ``margin_s`` (the caller's tolerance of its estimates, seconds >= 0)."""
    return slack < -margin_s


CANNOT_MEET_DEADLINE = "cannot meet its task's deadline"
"""The phrase every early refusal's message carries (:class:`CannotMeetDeadline`): what a caller matches."""


class CannotMeetDeadline(RequestDeadlineExceeded):
    """Refused early (DEADLINE_EXCEEDED): the request's task cannot meet its deadline (negative slack).

    The message names the request, what set its task's deadline (``deadline_source``, where its orchestrator
    said), its slack and the three terms it came from.
    """

    def __init__(self, request_id: str, slack: float, time_left_s: float, remaining_work_s: float,
                 service_s: float, deadline_source: str = "") -> None:
        super().__init__(request_id, time_left_s, "in the dispatcher's queue")
        source = f" ({deadline_source})" if deadline_source else ""
        self.args = (f"request {request_named(request_id)} {CANNOT_MEET_DEADLINE}{source}: slack {slack:.3g} s "
                     f"(time left {time_left_s:.3g} s - expected remaining work {remaining_work_s:.3g} s - "
                     f"expected service {service_s:.3g} s); refused before it was served",)
        self.slack_s = slack


def check(request_id: str, time_left_s: float | None, expected_remaining_work_s: float = 0.0,
          expected_service_s: float = 0.0, margin_s: float = 0.0, deadline_source: str = "") -> float:
    """The request's slack; raises when it cannot make its deadline (short by more than ``margin_s``), naming
    ``deadline_source`` (what set the task's deadline; "": not known).

    Raises:
        CannotMeetDeadline: ``cannot_make_it(slack, margin_s)``.
    """
    slack = slack_s(time_left_s, expected_remaining_work_s, expected_service_s)
    if cannot_make_it(slack, margin_s):
        raise CannotMeetDeadline(request_id, slack, float(time_left_s or 0.0), max(0.0, expected_remaining_work_s),
                                 max(0.0, expected_service_s), deadline_source)
    return slack
