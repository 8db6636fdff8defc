"""Adaptive flush window: driven by synthetic arrival streams and service times (no clocks, no sleeps)."""

import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard.common.config import ConfigError, BatchingConfig, SwitchyardConfig
from switchyard.dispatcher.adaptive_flush import AdaptiveFlush

pytestmark = pytest.mark.no_gpu


def make_controller(**overrides) -> AdaptiveFlush:
    fields = {
        "max_batch_size": 32,
        "flush_interval_ms": "auto",
        "p95_budget_ms": 1000,
        "min_interval_ms": 1,
        "max_interval_ms": 100,
    }
    fields.update(overrides)
    return AdaptiveFlush(BatchingConfig(**fields))


def feed_steady(ctl: AdaptiveFlush, rate_per_s: float, seconds: float, start: float = 0.0) -> float:
    """Arrivals every 1/rate seconds from ``start``; returns the time of the last one."""
    step = 1.0 / rate_per_s
    t = start
    for i in range(int(rate_per_s * seconds)):
        t = start + i * step
        ctl.record_arrival(t)
    return t


def test_no_arrivals_gives_the_shortest_window():
    ctl = make_controller()
    assert ctl.arrival_rate(now=5.0) == 0.0
    assert ctl.window(now=5.0) == pytest.approx(0.001)


def test_high_rate_waits_just_long_enough_to_fill_a_batch():
    ctl = make_controller()
    now = feed_steady(ctl, rate_per_s=1000, seconds=1.0)
    assert ctl.arrival_rate(now) == pytest.approx(1000, rel=0.01)
    assert ctl.window(now) == pytest.approx((32 - 1) / 1000, rel=0.02)  # 31 more after the first, at 1000/s


def test_low_rate_is_capped_by_max_interval():
    ctl = make_controller()
    now = feed_steady(ctl, rate_per_s=10, seconds=1.0)
    assert ctl.window(now) == pytest.approx(0.100)


def test_p95_budget_caps_the_window():
    ctl = make_controller(p95_budget_ms=1000)
    now = feed_steady(ctl, rate_per_s=10, seconds=1.0)
    for _ in range(20):
        ctl.record_batch_service(0.95)
    assert ctl.service_p95() == pytest.approx(0.95)
    assert ctl.window(now) == pytest.approx(0.05)


def test_service_beyond_budget_falls_back_to_the_shortest_window():
    ctl = make_controller(p95_budget_ms=500)
    now = feed_steady(ctl, rate_per_s=200, seconds=1.0)
    ctl.record_batch_service(0.8)
    assert ctl.window(now) == pytest.approx(0.001)


def test_p95_ignores_a_rare_slow_batch():
    ctl = make_controller(p95_budget_ms=1000)
    for _ in range(59):
        ctl.record_batch_service(0.2)
    ctl.record_batch_service(5.0)
    assert ctl.service_p95() == pytest.approx(0.2)


def test_window_shrinks_as_the_rate_rises():
    windows = []
    for rate in (50, 200, 800, 3200):
        ctl = make_controller()
        now = feed_steady(ctl, rate_per_s=rate, seconds=1.0)
        windows.append(ctl.window(now))
    assert windows == sorted(windows, reverse=True)
    assert windows[0] > windows[-1]


def test_the_window_a_new_buffer_gets_does_not_depend_on_how_full_the_last_one_was():
    """The window was computed from a copy of the buffer's size taken at each arrival and never reset at a
    flush: the next buffer's first item got the window of a buffer 31 items full (10 ms instead of 200)."""
    from switchyard.common.config import SwitchyardConfig
    from switchyard.dispatcher.double_buffer import FlushReason
    from switchyard.dispatcher.request import Request
    from switchyard.dispatcher.service import DispatcherService

    config = SwitchyardConfig().with_overrides(**{
        "batching.flush_interval_ms": "auto", "batching.max_batch_size": 32, "batching.max_interval_ms": 200,
        "scheduler.time_slice_ms": 1000})
    service = DispatcherService(config)
    scheduler, adaptive = service.scheduler, service.scheduler.adaptive_flush
    assert adaptive is not None
    now = time.monotonic()  # the double buffer asks the window with the clock's now
    for i in range(31):  # 100 requests a second fill the first buffer with 31
        at = now - 0.31 + i * 0.01
        scheduler.add_request(Request(request_id=f"a{i}", prompt="x", prompt_tokens=1, max_tokens=1, arrival=at), at)
    scheduler.flush(FlushReason.STEP, now)
    scheduler.add_request(Request(request_id="next", prompt="x", prompt_tokens=1, max_tokens=1, arrival=now), now)
    # 31 more at 100/s take 0.31 s: the window is the longest allowed (or the P95 budget), not (32 - 31) / 100
    assert adaptive.last_window_s >= min(0.2, config.batching.p95_budget_ms / 1000)
    assert scheduler.intake.deadline() == pytest.approx(now + adaptive.last_window_s)


def test_a_burst_is_forgotten_after_the_rate_window():
    ctl = make_controller()
    now = feed_steady(ctl, rate_per_s=2000, seconds=0.5)
    assert ctl.window(now) < 0.02
    later = now + 5.0
    assert ctl.arrival_rate(later) == 0.0
    assert ctl.window(later) == pytest.approx(0.001)


def test_poisson_arrivals_track_the_mean_rate():
    rng = random.Random(7)
    ctl = make_controller()
    t = 0.0
    for _ in range(3000):
        t += rng.expovariate(500)
        ctl.record_arrival(t)
    assert ctl.arrival_rate(t) == pytest.approx(500, rel=0.2)
    assert ctl.window(t) == pytest.approx(32 / 500, rel=0.25)


@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.5), min_size=0, max_size=200),
    services=st.lists(st.floats(min_value=0.0, max_value=3.0), max_size=30),
    batch=st.integers(min_value=1, max_value=256),
)
def test_window_always_within_bounds(gaps, services, batch):
    ctl = make_controller(max_batch_size=batch, min_interval_ms=2, max_interval_ms=50)
    t = 0.0
    for gap in gaps:
        t += gap
        ctl.record_arrival(t)
    for s in services:
        ctl.record_batch_service(s)
    assert 0.002 <= ctl.window(t) <= 0.050


def test_controller_is_the_interval_callable():
    ctl = make_controller()
    assert ctl() == pytest.approx(0.001)


def test_bad_service_time_is_rejected():
    ctl = make_controller()
    with pytest.raises(ValueError, match="service_s"):
        ctl.record_batch_service(-1.0)


def test_config_accepts_auto_and_rejects_other_words():
    cfg = SwitchyardConfig().with_overrides(**{"batching.flush_interval_ms": "auto"})
    assert cfg.batching.adaptive
    assert not SwitchyardConfig().batching.adaptive
    with pytest.raises(ConfigError, match=r"flush_interval_ms.*'often'.*\"auto\""):
        SwitchyardConfig().with_overrides(**{"batching.flush_interval_ms": "often"})
    with pytest.raises(ConfigError, match="min_interval_ms"):
        SwitchyardConfig().with_overrides(**{"batching.min_interval_ms": 200, "batching.max_interval_ms": 100})


def test_engine_step_caps_the_window_at_low_rates():
    ctl = AdaptiveFlush(
        BatchingConfig(max_batch_size=32, flush_interval_ms="auto", max_interval_ms=100), engine_step_s=0.020
    )
    now = feed_steady(ctl, rate_per_s=10, seconds=1.0)
    assert ctl.window(now) == pytest.approx(0.020)
    fast = feed_steady(ctl, rate_per_s=4000, seconds=0.5, start=now + 2)
    assert ctl.window(fast) == pytest.approx(32 / 4000, rel=0.05)
    with pytest.raises(ValueError, match="engine_step_s"):
        AdaptiveFlush(BatchingConfig(), engine_step_s=0)


def test_only_an_arrival_the_buffer_takes_is_counted_by_the_adaptive_interval():
    """The arrival was counted before the scheduler could refuse it (a full queue, a draining dispatcher): under
    overload the interval's arrival rate counted refusals as arrivals."""
    from switchyard.common.config import SwitchyardConfig
    from switchyard.common.errors import QueueFullError
    from switchyard.dispatcher.request import Request
    from switchyard.dispatcher.service import DispatcherService

    config = SwitchyardConfig().with_overrides(**{"batching.flush_interval_ms": "auto",
                                                  "queues.inference.capacity": 1})
    service = DispatcherService(config)
    adaptive = service.scheduler.adaptive_flush
    assert adaptive is not None
    arrivals = adaptive._arrivals
    service.scheduler.add_request(Request(request_id="a", prompt="hi", prompt_tokens=1, max_tokens=1), 1.0)
    assert len(arrivals) == 1
    with pytest.raises(QueueFullError):
        service.scheduler.add_request(Request(request_id="b", prompt="hi", prompt_tokens=1, max_tokens=1), 1.1)
    assert len(arrivals) == 1
