"""Retry-After is honoured (capped, within the deadline); request errors never fall back."""

from __future__ import annotations

import asyncio
import email.utils
import time

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401

from switchyard.gateway.classify import error_for_status, retry_after_s
from switchyard.gateway.client import GatewayClient
from switchyard.gateway.cooldown import Cooldowns
from switchyard.gateway.errors import BadUpstreamRequest, GatewayError, UpstreamRateLimited, UpstreamServerError
from switchyard.gateway.events import ChatRequest
from switchyard_harness.faults import Fault
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
    # a number that is not finite says no wait (an endless one closed the model's calls for good)
    for endless in ("inf", "Infinity", "1e999", "nan"):
        assert retry_after_s({"retry-after": endless}) is None, endless
        assert retry_after_s({"retry-after-ms": endless, "retry-after": "2"}) == 2.0, endless


def _rate_limited(seconds: float) -> GatewayError:
    return error_for_status(429, '{"error": {"message": "slow down"}}', {"retry-after": str(seconds)},
                            url="http://u/v1/chat/completions", model="m", key=ApiKey("K", None))


async def test_the_wait_honours_retry_after_within_the_cap() -> None:
    config = gateway_config("http://127.0.0.1:1/v1", max_retries=2, retry_backoff_initial_s=0.01,
                            retry_backoff_max_s=0.02, retry_after_max_s=5)
    waits: list[float] = []
    attempts = iter([_rate_limited(2), _rate_limited(5)])

    async def once(model: str) -> str:
        error = next(attempts, None)
        if error is not None:
            raise error
        return "ok"

    async def record(seconds: float) -> None:
        waits.append(seconds)

    assert await with_retries("m", once, config, sleep=record) == "ok"
    assert waits[0] >= 2.0 and waits[1] >= 5.0  # never less than asked


async def test_a_wait_longer_than_the_cap_is_never_shortened_the_call_fails_naming_model_and_wait() -> None:
    config = gateway_config("http://127.0.0.1:1/v1", max_retries=3, retry_after_max_s=30)
    attempts = 0

    async def once(model: str) -> str:
        nonlocal attempts
        attempts += 1
        raise _rate_limited(90)

    async def never(seconds: float) -> None:
        raise AssertionError(f"slept {seconds} s: retried before the 90 s the upstream asked for")

    with pytest.raises(UpstreamRateLimited) as caught:
        await with_retries("m", once, config, sleep=never)
    assert attempts == 1
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "model 'm' asked to wait 90.0 s" in str(caught.value) and "retry_after_max_s (30 s)" in str(caught.value)


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


NOTATIONS = {
    "delta-seconds": Fault(status=429, retry_after=90),
    "retry-after-ms": Fault(status=429, retry_after_ms=90_000),
    "http-date": Fault(status=429, retry_after_date=90),
}
PRIMARY, FALLBACK = "claude-sonnet-4-5", "gpt-4o-mini"


async def _served_by(client: GatewayClient) -> str:
    events = [e async for e in client.stream_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}]))]
    return events[-1].model


@pytest.mark.parametrize("fault", NOTATIONS.values(), ids=NOTATIONS.keys())
async def test_a_90s_wait_against_a_30s_cap_goes_to_the_fallback_and_the_model_is_not_asked_again(
        clean_proxy_env, fault) -> None:
    with start_sim(faults={PRIMARY: fault}) as server:
        config = gateway_config(server.base_url, max_retries=3, retry_after_max_s=30)
        async with GatewayClient(config) as client:
            assert [await _served_by(client) for _ in range(3)] == [FALLBACK] * 3
        assert server.state.counts[PRIMARY] == 1  # 0 requests before the 90 s it asked for
        assert server.state.counts[FALLBACK] == 3


@pytest.mark.parametrize("fault", NOTATIONS.values(), ids=NOTATIONS.keys())
async def test_a_90s_wait_without_a_fallback_fails_before_the_first_token_naming_the_model_and_the_wait(
        clean_proxy_env, fault) -> None:
    with start_sim(faults={PRIMARY: fault}) as server:
        config = gateway_config(server.base_url, max_retries=3, retry_after_max_s=30, fallback_model="")
        async with GatewayClient(config) as client:
            errors = []
            for _ in range(2):
                with pytest.raises(GatewayError) as caught:
                    await _served_by(client)
                errors.append(caught.value)
        assert server.state.counts[PRIMARY] == 1  # the second call was refused here, not sent
    first, second = errors
    assert first.code == second.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"model {PRIMARY!r} asked to wait 8" in str(first) or f"model {PRIMARY!r} asked to wait 9" in str(first)
    assert "retry_after_max_s (30 s)" in str(first) and "never shortened" in str(first)
    assert f"upstream model {PRIMARY!r} asked to wait" in str(second) and "s of it left" in str(second)
    assert first.tokens_sent == second.tokens_sent == 0


@pytest.mark.parametrize("status", [503, 529])  # 529: Anthropic's overloaded_error, read as a server failure
async def test_an_overloaded_answer_asking_for_longer_than_the_call_has_left_fails_unavailable_at_once(
        clean_proxy_env, status) -> None:
    with start_sim(faults={PRIMARY: Fault(status=status, retry_after=20)}) as server:
        config = gateway_config(server.base_url, max_retries=3, retry_after_max_s=30, fallback_model="",
                                cooldown={"enabled": False})
        async with GatewayClient(config) as client:
            request = ChatRequest(messages=[{"role": "user", "content": "hi"}], timeout_s=5.0)
            with pytest.raises(GatewayError) as caught:
                async for _ in client.stream_chat(request):
                    pass
        assert server.state.counts[PRIMARY] == 1
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"model {PRIMARY!r} asked to wait 20.0 s" in str(caught.value) and "left before the call's deadline" in str(caught.value)


async def test_a_retry_that_would_not_leave_an_attempts_time_to_first_token_is_not_started(clean_proxy_env) -> None:
    """A 429 asking for 0.5 s with 1 s left: the wait ends before the deadline, but an attempt of this model
    server takes 0.8 s to its first token, so the retry was sent, cut at the deadline, and the caller read a bare
    DEADLINE_EXCEEDED. It is not started: the 429's RESOURCE_EXHAUSTED names the wait, the time an attempt takes,
    the time left and who set the deadline (the caller's, from its task's time limit)."""
    faults = {PRIMARY: Fault(status=429, retry_after=0.5, fail_first=1, slow_ms=800), FALLBACK: Fault(slow_ms=800)}
    with start_sim(faults=faults) as server:
        config = gateway_config(server.base_url, max_retries=3, retry_after_max_s=30, fallback_model="")
        async with GatewayClient(config) as client:
            # a call of the server's other model measures its time to first token (the limit's TTFT)
            [e async for e in client.stream_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}],
                                                             model=FALLBACK, max_tokens=1))]
            assert client.pool.expected_ttft_s(PRIMARY) >= 0.8
            request = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=1, timeout_s=1.0,
                                  deadline_source="orchestrator.task_time_limit_s.chat = 1")
            with pytest.raises(GatewayError) as caught:
                async for _ in client.stream_chat(request):
                    pass
        assert server.state.counts[PRIMARY] == 1  # the retry was never sent
    said = str(caught.value)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, said
    assert f"model {PRIMARY!r} asked to wait 0.5 s, leaving" in said, said
    assert "s an attempt takes to its first token" in said, said
    assert "before the call's deadline (set by its caller, from orchestrator.task_time_limit_s.chat = 1)" in said


async def test_a_refusal_past_the_deadline_names_who_set_it() -> None:
    config = gateway_config("http://127.0.0.1:1/v1", max_retries=3)

    async def once(model: str) -> str:
        raise _rate_limited(10)

    deadline = asyncio.get_running_loop().time() + 1.0
    with pytest.raises(UpstreamRateLimited) as caught:
        await with_retries("m", once, config, deadline, deadline_set_by="model_gateway.total_timeout_s = 1")
    assert "left before the call's deadline (set by model_gateway.total_timeout_s = 1)" in str(caught.value)


async def test_a_short_wait_is_waited_out_by_later_calls_too(clean_proxy_env) -> None:
    """A wait within the cap: the next call is held until it has passed, then reaches the model."""
    with start_sim(faults={PRIMARY: Fault(status=429, retry_after=0.3, fail_first=1)}) as server:
        config = gateway_config(server.base_url, max_retries=2, retry_after_max_s=30, fallback_model="")
        async with GatewayClient(config) as client:
            assert await _served_by(client) == PRIMARY
        assert server.state.counts[PRIMARY] == 2
        first, second = server.state.arrivals[PRIMARY]
        assert second - first >= 0.3


def test_the_retry_waits_a_retry_after_out_by_the_cooldowns_clock_on_uvloop() -> None:
    """uvloop rounds a delay to whole milliseconds (10.4 ms: 10) and times it from a millisecond clock, so
    a retry that slept the 10.4 ms a 429 asked for woke, now and then, before time.monotonic() (the
    cooldown's clock) had advanced as far, and was refused without being sent. Thirty calls: each must be
    sent twice."""
    import uvloop

    config = gateway_config("http://127.0.0.1:1/v1", max_retries=1)

    async def calls() -> list[float]:
        gaps = []
        for _ in range(30):
            cooldowns, sent = Cooldowns(config), []

            async def attempt(model: str) -> str:
                async def once() -> str:
                    sent.append(time.monotonic())
                    if len(sent) == 1:
                        raise _rate_limited(0.0104)
                    return "ok"

                return await cooldowns.call(model, once)

            assert await with_retries("m", attempt, config) == "ok"
            gaps.append(sent[1] - sent[0])
        return gaps

    assert min(uvloop.run(calls())) >= 0.0104


@pytest.mark.parametrize("asked", [{"retry_after_ms": 250.49}, {"retry_after_date": 1}])
def test_a_retry_after_a_wait_is_not_refused_by_the_wait_it_waited_out(clean_proxy_env, asked) -> None:
    """The services run on uvloop, whose timers round a delay down to whole milliseconds and may fire before
    time.monotonic() (the clock the model's cooldown keeps the wait by) has advanced as far: the retry that
    had waited the asked 0.25049 s woke a fraction of a millisecond early, was refused without being sent
    ("asked to wait 0.3 s ...; 0.0 s of it left, so the call was not sent"), and with max_retries 1 the call
    failed although the server would have served it."""
    import uvloop

    async def call() -> str:
        with start_sim(faults={PRIMARY: Fault(status=429, fail_first=1, **asked)}) as server:
            config = gateway_config(server.base_url, max_retries=1, retry_after_max_s=30, fallback_model="")
            async with GatewayClient(config) as client:
                served = await _served_by(client)
            assert server.state.counts[PRIMARY] == 2
        return served

    for _ in range(3):
        assert uvloop.run(call()) == PRIMARY


async def test_a_first_failure_unlike_the_last_is_named_beside_it() -> None:
    """transformers serve: a request past its KV cache kills its batching worker (an error string in the stream),
    and every retry then answers 503 "CB worker is dead": the call failed naming the 503 alone, the real cause
    hidden behind the retries."""
    config = gateway_config("http://127.0.0.1:1/v1", max_retries=2, retry_backoff_initial_s=0.01,
                            retry_backoff_max_s=0.02)
    attempts = iter([UpstreamServerError("upstream error inside the stream: KV cache too small"),
                     UpstreamServerError("HTTP 503: CB worker is dead"),
                     UpstreamServerError("HTTP 503: CB worker is dead")])

    async def once(model: str) -> str:
        raise next(attempts)

    async def no_wait(seconds: float) -> None:
        pass

    with pytest.raises(UpstreamServerError) as failed:
        await with_retries("m", once, config, sleep=no_wait)
    assert str(failed.value) == ("HTTP 503: CB worker is dead; the first attempt failed otherwise: upstream error "
                                 "inside the stream: KV cache too small")
    alike = iter([UpstreamServerError("HTTP 503: busy") for _ in range(3)])

    async def same(model: str) -> str:
        raise next(alike)

    with pytest.raises(UpstreamServerError) as failed:
        await with_retries("m", same, config, sleep=no_wait)
    assert str(failed.value) == "HTTP 503: busy"  # nothing to add where every attempt said the same
