"""The adaptive upstream concurrency limit: unit rules, and a real fake upstream that answers 429."""

from __future__ import annotations

import asyncio

import pytest
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401
from prometheus_client import REGISTRY

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import AdaptiveConcurrencyConfig, ConfigError, SwitchyardConfig, load_config
from switchyard.common.server import start_server
from switchyard.dispatcher.adaptive_limit import AdaptiveConcurrencyLimit
from switchyard.dispatcher.service import DispatcherService
from switchyard.common.channels import open_channel

pytestmark = pytest.mark.no_gpu


def test_limit_grows_while_ttft_holds_and_is_used() -> None:
    limit = AdaptiveConcurrencyLimit(AdaptiveConcurrencyConfig(initial_limit=8, max_limit=64))
    for _ in range(200):
        limit.in_flight = int(limit.limit)  # every stream the limit allows is in use
        limit.on_sample(0.05)
    assert limit.limit == 64  # up to the ceiling, never past it
    assert REGISTRY.get_sample_value("switchyard_upstream_concurrency_limit") == 64


def test_limit_grows_only_while_more_than_half_of_it_is_used() -> None:
    limit = AdaptiveConcurrencyLimit(AdaptiveConcurrencyConfig(initial_limit=8))
    limit.in_flight = 1
    for _ in range(100):
        limit.on_sample(0.05)
    assert limit.limit == 8
    limit.in_flight = 8
    for _ in range(100):
        limit.on_sample(0.05)
    assert limit.limit == pytest.approx(16, abs=1.5)  # grew until 8 in flight was no longer more than half


def test_limit_shrinks_when_ttft_rises_past_tolerance() -> None:
    limit = AdaptiveConcurrencyLimit(AdaptiveConcurrencyConfig(initial_limit=100, tolerance=2.0, min_limit=4))
    limit.in_flight = 100
    for _ in range(50):
        limit.on_sample(0.05)  # baseline
    grown = limit.limit
    for _ in range(50):
        limit.on_sample(0.5)  # 10x the baseline: the upstream queues
    assert limit.limit < grown / 2


def test_overload_halves_the_limit_once_per_ttft_window_down_to_the_floor() -> None:
    limit = AdaptiveConcurrencyLimit(AdaptiveConcurrencyConfig(initial_limit=32, min_limit=3, backoff_ratio=0.5))
    limit.on_sample(0.1)
    limit.on_overload(now=10.0)
    limit.on_overload(now=10.05)  # same burst of 429s: counted once
    assert limit.limit == 16
    for k in range(10):
        limit.on_overload(now=11.0 + k)
    assert limit.limit == 3


def test_bounds_are_checked_and_the_pool_must_hold_the_ceiling() -> None:
    with pytest.raises(ConfigError, match="initial_limit"):
        SwitchyardConfig().with_overrides(**{"upstream.concurrency": {"initial_limit": 0}})
    with pytest.raises(ConfigError, match="max_connections"):
        SwitchyardConfig().with_overrides(**{"upstream.max_connections": 8})


async def test_dispatcher_backs_off_an_upstream_that_answers_429_above_its_concurrency(clean_proxy_env) -> None:
    with start_sim(max_streams=4, latency=True) as upstream:
        config = load_config("config").with_overrides(**{
            "dispatcher.engine": "openai",
            "upstream.base_url": upstream.base_url,
            "upstream.api_key_required": False,
            "upstream.max_retries": 8,
            "upstream.retry_backoff_initial_s": 0.01,
            "upstream.retry_backoff_max_s": 0.05,
            "upstream.concurrency": {"initial_limit": 32, "min_limit": 1, "max_limit": 64},
        })
        service = DispatcherService(config)
        srv = await start_server([service], "127.0.0.1", 0, config.server)
        try:
            async with open_channel(f"127.0.0.1:{srv.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)

                async def one(i: int) -> agent_pb2.GenerateChunk:
                    request = agent_pb2.GenerateRequest(request_id=f"u{i}", prompt="<question>what is a list?</question>",
                                                        max_tokens=16)
                    return [c async for c in stub.Generate(request, timeout=60)][-1]

                results = await asyncio.gather(*(one(i) for i in range(40)))
        finally:
            await srv.stop(1.0)
    assert all(r.HasField("done") for r in results)  # nothing lost: retried, then served
    assert upstream.state.rejected_overload > 0 and upstream.state.peak_open_streams <= 4
    assert service.limit is not None and service.limit.limit < 32  # it learned the upstream takes less
