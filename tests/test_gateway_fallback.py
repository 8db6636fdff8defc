"""Fallback model before the first token only; tokens already sent are never repeated."""

from __future__ import annotations

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401

from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Finished, Token
from switchyard_harness.faults import Fault

PRIMARY, FALLBACK = "claude-sonnet-4-5", "gpt-4o-mini"
FULL_ANSWER = "A short answer (the sim engine has no model) about: hello there."  # a chat: nothing retrieved


def ask() -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hello there"}])


@pytest.mark.parametrize(
    "fault",
    [Fault(cut_after=0), Fault(status=503), Fault(malformed_after=0), Fault(status=404)],
    ids=["stream-dies-before-token", "503", "malformed", "404"],
)
async def test_fallback_when_primary_fails_before_first_token(clean_proxy_env, fault):
    with start_sim(faults={PRIMARY: fault}) as server:
        async with GatewayClient(gateway_config(server.base_url, max_retries=1)) as client:
            events = [e async for e in client.stream_chat(ask())]
        assert server.state.counts[FALLBACK] == 1
    assert "".join(e.text for e in events if isinstance(e, Token)) == FULL_ANSWER
    assert isinstance(events[-1], Finished) and events[-1].model == FALLBACK


async def test_no_fallback_and_no_repeat_after_a_token_was_sent(clean_proxy_env):
    with start_sim(faults={PRIMARY: Fault(cut_after=3)}) as server:
        received: list[str] = []
        async with GatewayClient(gateway_config(server.base_url, max_retries=2)) as client:
            with pytest.raises(GatewayError) as caught:
                async for event in client.stream_chat(ask()):
                    received.append(event.text)
        assert server.state.counts == {PRIMARY: 1}  # neither retried nor sent to the fallback
    assert received == ["A", " short", " answer"]
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert "after 3 streamed item(s)" in str(caught.value) and "no token is repeated" in str(caught.value)


async def test_no_fallback_on_auth_failure(clean_proxy_env):
    with start_sim(faults={"*": Fault(expired=True)}) as server:
        async with GatewayClient(gateway_config(server.base_url)) as client:
            with pytest.raises(GatewayError) as caught:
                async for _ in client.stream_chat(ask()):
                    pass
        assert FALLBACK not in server.state.counts
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_fault_by_model_suffix_reaches_the_server(clean_proxy_env):
    with start_sim() as server:
        async with GatewayClient(gateway_config(server.base_url, max_retries=0)) as client:
            events = [e async for e in client.stream_chat(
                ChatRequest(messages=[{"role": "user", "content": "hello there"}], model=f"{PRIMARY}#status=502"))]
    assert events[-1].model == FALLBACK


async def test_no_fallback_when_the_client_named_an_unknown_model(clean_proxy_env):
    with start_sim() as server:
        async with GatewayClient(gateway_config(server.base_url, max_retries=1)) as client:
            request = ChatRequest(messages=[{"role": "user", "content": "hi"}], model="claude-sonnet-4.5")
            with pytest.raises(GatewayError) as caught:
                [e async for e in client.stream_chat(request)]
        assert server.state.counts.get(FALLBACK, 0) == 0
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert "'claude-sonnet-4.5'" in str(caught.value) and "'claude-sonnet-4-5'" in str(caught.value)
