"""The metrics operators' rules read: readiness per service and each queue's capacity."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from switchyard.common.config import QueueConfig, SwitchyardConfig
from switchyard.common.queues import WorkQueue
from switchyard.common.server import start_server
from switchyard.dispatcher.service import DispatcherService

pytestmark = pytest.mark.no_gpu


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_serving_is_1_while_health_says_serving_and_0_once_draining() -> None:
    config = SwitchyardConfig()
    service = DispatcherService(config)
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    try:
        assert value("switchyard_serving", service="dispatcher") == 1
    finally:
        await srv.stop(0.1)
    assert value("switchyard_serving", service="dispatcher") == 0


def test_queue_capacity_is_exported_and_its_series_exist_before_the_first_item() -> None:
    name = f"q{uuid.uuid4().hex[:8]}"  # a queue no other test made
    WorkQueue(name, QueueConfig(capacity=7, workers=1, timeout_ms=100))
    assert value("switchyard_queue_capacity", queue=name) == 7
    assert value("switchyard_queue_depth", queue=name) == 0  # switchyard top shows the queue from the start
    assert value("switchyard_queue_busy_workers", queue=name) == 0
    # A series born with its first item would hide that item from rate(): it must start at 0.
    for outcome in ("admitted", "expired", "cancelled"):
        assert value("switchyard_queue_wait_seconds_count", queue=name, outcome=outcome) == 0
    assert value("switchyard_queue_rejected_total", queue=name, reason="full") == 0
