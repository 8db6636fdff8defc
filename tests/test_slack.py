"""Slack, least slack first and the early refusal (switchyard.dispatcher.scheduler.slack)."""

from __future__ import annotations

import math

import grpc
import pytest

from switchyard.dispatcher.scheduler import slack


def test_slack_is_time_left_minus_work():
    assert slack.slack_s(10.0, 3.0, 2.0) == 5.0
    assert slack.slack_s(1.0, 3.0, 0.5) == -2.5
    assert slack.slack_s(None) == math.inf
    assert slack.slack_s(5.0, -1.0, -1.0) == 5.0


def test_cannot_make_it_below_zero_slack():
    assert slack.cannot_make_it(-0.1)
    assert not slack.cannot_make_it(0.0)
    assert not slack.cannot_make_it(math.inf)


def test_check_refuses_by_name_with_deadline_exceeded():
    assert slack.check("r-ok", 10.0, 1.0, 1.0) == 8.0
    with pytest.raises(slack.CannotMeetDeadline) as caught:
        slack.check("r-late", 1.0, 2.0, 0.5)
    err = caught.value
    assert err.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "r-late" in str(err) and "slack -1.5 s" in str(err)
    assert err.slack_s == pytest.approx(-1.5)
