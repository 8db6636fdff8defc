"""Retry-After is honoured (capped, within the deadline); request errors never fall back."""

from __future__ import annotations

import asyncio
import email.utils

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401

from switchyard.gateway.classify import error_for_status, retry_after_s
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import BadUpstreamRequest, GatewayError, UpstreamRateLimited
from switchyard.gateway.events import ChatRequest
from switchyard.gateway.faults import Fault
from switchyard.gateway.keys import ApiKey
from switchyard.gateway.resilience import with_retries

pytestmark = pytest.mark.no_gpu


def test_retry_after_reads_seconds_http_dates_and_milliseconds() -> None:
    assert retry_after_s({"retry-after": "2"}) == 2.0
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 3, usegmt=True)
    assert retry_after_s({"retry-after": date}, now=now) == pytest.approx(3.0)
    assert retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5  # the finer one wins
    assert retry_after_s({}) is None and retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({"retry-after": email.utils.formatdate(now - 60, usegmt=True)}, now=now) == 0.0


def _rate_limited(seconds: float) -> GatewayError:
    return error_for_status(429, '{"error": {"message": "slow down"}}', {"retry-after": str(seconds)},
                            url="http://u/v1/chat/completions", model="m", key=ApiKey("K", None))


async def test_the_wait_honours_retry_after_capped_by_config() -> None:
    config = gateway_config("http://127.0.0.1:1/v1", max_retries=2, retry_backoff_initial_s=0.01,
                            retry_backoff_max_s=0.02, retry_after_max_s=5)
    waits: list[float] = []
    attempts = iter([_rate_limited(2), _rate_limited(60)])

    async def once(model: str) -> str:
        error = next(attempts, None)
        if error is not None:
            raise error
        return "ok"

    async def record(seconds: float) -> None:
        waits.append(seconds)

    assert await with_retries("m", once, config, sleep=record) == "ok"
    assert waits[0] >= 2.0 and waits[1] == pytest.approx(5.0, abs=0.03)  # asked 60 s, capped at 5


async def test_a_retry_after_past_the_deadline_fails_at_once_with_the_upstream_error() -> None:
    config = gateway_config("http://127.0.0.1:1/v1", max_retries=3)

    async def once(model: str) -> str:
        raise _rate_limited(10)

    async def never(seconds: float) -> None:
        raise AssertionError("slept past the deadline")

    deadline = asyncio.get_running_loop().time() + 1.0
    with pytest.raises(UpstreamRateLimited, match="would outlast the call's deadline"):
        await with_retries("m", once, config, deadline, sleep=never)


async def test_request_errors_never_fall_back(clean_proxy_env) -> None:
    with start_sim(faults={"claude-sonnet-4-5": Fault(status=400)}) as server:
        async with GatewayClient(gateway_config(server.base_url, max_retries=0)) as client:
            with pytest.raises(BadUpstreamRequest) as err:
                async for _ in client.stream_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}])):
                    pass
        assert server.state.counts.get("gpt-4o-mini", 0) == 0  # the fallback model was never asked
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
