"""Circuit breaker per upstream model: a failing model is skipped for its cooldown, the fallback serves."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401

from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Finished
from switchyard.gateway.faults import Fault
from switchyard.gateway.metrics import GATEWAY_CIRCUIT_OPEN, GATEWAY_COOLDOWNS

PRIMARY, FALLBACK = "claude-sonnet-4-5", "gpt-4o-mini"


def ask() -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hello there"}])


async def served_by(client: GatewayClient) -> str:
    events = [e async for e in client.stream_chat(ask())]
    assert isinstance(events[-1], Finished)
    return events[-1].model


def cooldown(**values) -> dict:
    return {"cooldown": {"enabled": True, "failures": 2, "cooldown_s": 60.0, **values}, "max_retries": 0}


async def test_a_failing_model_is_skipped_for_its_cooldown(clean_proxy_env):
    opened_before = GATEWAY_COOLDOWNS.labels(PRIMARY)._value.get()
    with start_sim(faults={PRIMARY: Fault(status=503)}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown())) as client:
            assert GATEWAY_CIRCUIT_OPEN.labels(PRIMARY)._value.get() == 0
            assert [await served_by(client) for _ in range(2)] == [FALLBACK, FALLBACK]
            assert server.state.counts[PRIMARY] == 2
            assert GATEWAY_CIRCUIT_OPEN.labels(PRIMARY)._value.get() == 1
            assert await served_by(client) == FALLBACK
            assert server.state.counts[PRIMARY] == 2  # open: not even tried
    assert GATEWAY_COOLDOWNS.labels(PRIMARY)._value.get() == opened_before + 1


async def test_without_a_fallback_an_open_circuit_fails_fast_naming_the_cooldown(clean_proxy_env):
    with start_sim(faults={PRIMARY: Fault(status=503)}) as server:
        async with GatewayClient(gateway_config(server.base_url, fallback_model="", **cooldown())) as client:
            for _ in range(2):
                with pytest.raises(GatewayError):
                    await served_by(client)
            with pytest.raises(GatewayError) as caught:
                await served_by(client)
        assert server.state.counts[PRIMARY] == 2
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "cooling down" in str(caught.value) and "model_gateway.cooldown.cooldown_s" in str(caught.value)


@pytest.mark.parametrize("status", [400, 429], ids=["request-error", "rate-limit"])
async def test_the_requests_own_faults_and_rate_limits_never_open_the_circuit(clean_proxy_env, status):
    with start_sim(faults={PRIMARY: Fault(status=status)}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown())) as client:
            for _ in range(4):
                try:
                    await served_by(client)  # a 429 may be served by the fallback
                except GatewayError as exc:
                    assert exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert server.state.counts[PRIMARY] == 4  # tried every time: never skipped
    assert GATEWAY_CIRCUIT_OPEN.labels(PRIMARY)._value.get() == 0


async def test_after_the_cooldown_one_success_closes_the_circuit(clean_proxy_env):
    with start_sim(faults={PRIMARY: Fault(status=503, fail_first=2)}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown(cooldown_s=0.2))) as client:
            assert [await served_by(client) for _ in range(2)] == [FALLBACK, FALLBACK]
            assert GATEWAY_CIRCUIT_OPEN.labels(PRIMARY)._value.get() == 1
            await asyncio.sleep(0.3)  # past the cooldown: half-open, one trial request
            assert await served_by(client) == PRIMARY
            assert GATEWAY_CIRCUIT_OPEN.labels(PRIMARY)._value.get() == 0
            assert await served_by(client) == PRIMARY
