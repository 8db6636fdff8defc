"""The loop's report to the metrics: throttled on the busy path, and the throttle holds when the loop waits with
work held.

The stream loop waits after every decision, and each stream's end wakes it; publishing whatever was pending at
each wait made one report per call: 4.4 % of the dispatcher's event loop in front of ``sim-openai`` at 8
streams (docs/benchmarks.md). A report pending when the loop waits with work held is published when it falls
due; when the loop waits with nothing to do, at once.
"""

from __future__ import annotations

import asyncio
import time

from nvml_fixtures import FakeNvml
from switchyard_harness.testing.scheduling import accept

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher import engine_loop
from switchyard.dispatcher.engine_loop import STATS_INTERVAL_S, StepLoop
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.scheduler.compute_score import ComputeScoreMonitor


def _loop() -> StepLoop:
    config = SwitchyardConfig()
    engine = SimEngine(config)
    monitor = ComputeScoreMonitor(config.scheduler, busy_seconds=lambda: engine.busy_seconds, nvml=FakeNvml())
    return StepLoop(config, engine, make_scheduler(config, engine, monitor=monitor))


def _count_reports(monkeypatch) -> list[int]:
    reports: list[int] = []
    publish = engine_loop.metrics.publish_stats
    monkeypatch.setattr(engine_loop.metrics, "publish_stats", lambda stats: (reports.append(1), publish(stats)))
    return reports


class _Clock:
    """The loop's ``time`` module, frozen until moved: whether a report is due never depends on how fast this
    machine runs the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)


def _frozen_clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(engine_loop, "time", clock)
    return clock


async def test_a_report_pending_while_work_is_held_waits_for_its_due_time_not_for_the_loops_wait(monkeypatch) -> None:
    loop = _loop()
    reports = _count_reports(monkeypatch)
    clock = _frozen_clock(monkeypatch)
    loop._publish_stats()  # a report now: the next is due STATS_INTERVAL_S later
    accept(loop.scheduler, [Request(request_id="held", prompt="x", prompt_tokens=4, max_tokens=4)],
           now=time.monotonic())
    loop._publish_stats(throttled=True)  # the busy path within the interval: pending
    assert len(reports) == 1 and loop.scheduler.has_work
    loop._publish_when_due()  # the loop waits with work held: not yet
    timer = loop._stats_timer
    loop._publish_when_due()  # and again: one timer, still nothing published
    assert len(reports) == 1 and timer is not None and loop._stats_timer is timer
    clock.now += STATS_INTERVAL_S  # due now: the timer publishes it (waited for, however long it takes here)
    await asyncio.wait_for(_until(lambda: len(reports) == 2), timeout=30)
    assert loop._stats_timer is None
    loop._publish_when_due()
    assert len(reports) == 2  # nothing pending

    loop._publish_stats(throttled=True)  # pending again, work still held
    clock.now += STATS_INTERVAL_S
    loop._publish_when_due()  # due when the loop waits: published at once, no timer
    assert len(reports) == 3 and loop._stats_timer is None


async def test_a_busy_path_report_that_carries_the_pending_one_cancels_its_timer(monkeypatch) -> None:
    """The timer is for the report pending when the loop waited; a busy-path publish that falls due first carries
    it. Left running, the timer then published whatever the busy path had skipped since, before that skip's own
    due time: a second report within the interval."""
    loop = _loop()
    reports = _count_reports(monkeypatch)
    clock = _frozen_clock(monkeypatch)
    loop._publish_stats()
    accept(loop.scheduler, [Request(request_id="held", prompt="x", prompt_tokens=4, max_tokens=4)],
           now=time.monotonic())
    loop._publish_stats(throttled=True)
    loop._publish_when_due()
    timer = loop._stats_timer
    assert timer is not None and len(reports) == 1
    clock.now += STATS_INTERVAL_S
    loop._publish_stats(throttled=True)  # the busy path, due: it publishes the pending report
    assert len(reports) == 2 and timer.cancelled() and loop._stats_timer is None


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_report_pending_when_the_loop_waits_with_nothing_to_do_is_published_at_once(monkeypatch) -> None:
    loop = _loop()
    reports = _count_reports(monkeypatch)
    _frozen_clock(monkeypatch)
    loop._publish_stats()
    loop._publish_stats(throttled=True)
    assert len(reports) == 1 and not loop.scheduler.has_work
    loop._publish_when_due()
    assert len(reports) == 2
