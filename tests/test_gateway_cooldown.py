"""Circuit breaker per upstream model: a failing model is skipped for its cooldown, the fallback serves."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gateway_fixtures import clean_proxy_env, gateway_config, start_sim  # noqa: F401

from switchyard.gateway.client import GatewayClient
from switchyard.gateway.cooldown import Cooldowns
from switchyard.gateway.errors import GatewayError, ModelCoolingDown, UpstreamRateLimited, UpstreamServerError
from switchyard.gateway.events import ChatRequest, Finished
from switchyard_harness.faults import Fault
from switchyard.gateway.metrics import (
    CIRCUIT_STATES,
    CIRCUIT_TRANSITIONS,
    GATEWAY_CIRCUIT_STATE,
    GATEWAY_CIRCUIT_TRANSITIONS,
)

PRIMARY, FALLBACK = "claude-sonnet-4-5", "gpt-4o-mini"


def is_open(model: str) -> bool:
    return GATEWAY_CIRCUIT_STATE.labels(model, "open")._value.get() == 1


def transitions(model: str, before: str, after: str) -> float:
    return GATEWAY_CIRCUIT_TRANSITIONS.labels(model, before, after)._value.get()


def ask() -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hello there"}])


async def served_by(client: GatewayClient, request: ChatRequest | None = None) -> str:
    events = [e async for e in client.stream_chat(request or ask())]
    assert isinstance(events[-1], Finished)
    return events[-1].model


def cooldown(**values) -> dict:
    return {"cooldown": {"enabled": True, "failures": 2, "cooldown_s": 60.0, **values}, "max_retries": 0}


async def test_a_failing_model_is_skipped_for_its_cooldown(clean_proxy_env):
    opened_before = transitions(PRIMARY, "closed", "open")
    with start_sim(faults={PRIMARY: Fault(status=503)}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown())) as client:
            assert not is_open(PRIMARY)
            assert [await served_by(client) for _ in range(2)] == [FALLBACK, FALLBACK]
            assert server.state.counts[PRIMARY] == 2
            assert is_open(PRIMARY)
            assert await served_by(client) == FALLBACK
            assert server.state.counts[PRIMARY] == 2  # open: not even tried
    assert transitions(PRIMARY, "closed", "open") == opened_before + 1


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
    assert "cooling down" in str(caught.value) and "first_cooldown_s, doubled at each reopening up to cooldown_s" \
        in str(caught.value)


@pytest.mark.parametrize("fault", [Fault(status=400), Fault(status=429), Fault(status=409), Fault(status=451),
                                   Fault(stream_error=400), Fault(stream_error=429)],
                         ids=["request-error", "rate-limit", "conflict", "legal", "request-error-in-stream",
                              "rate-limit-in-stream"])
async def test_the_requests_own_faults_and_rate_limits_never_open_the_circuit(clean_proxy_env, fault):
    """Also when the server says so inside the stream (vLLM's error object, its status in ``code``): the
    request's own fault is neither retried nor counted against the model; nor is a 409, a conflict with the
    server's state (ABORTED, retried), which says nothing of the model's health."""
    with start_sim(faults={PRIMARY: fault}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown())) as client:
            for _ in range(4):
                try:
                    await served_by(client)  # a 429 may be served by the fallback
                except GatewayError as exc:
                    assert exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        grpc.StatusCode.ABORTED)
        assert server.state.counts[PRIMARY] == 4  # tried every time: never skipped
    assert not is_open(PRIMARY)


async def test_after_the_cooldown_one_success_closes_the_circuit(clean_proxy_env):
    with start_sim(faults={PRIMARY: Fault(status=503, fail_first=2)}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown(cooldown_s=0.2))) as client:
            assert [await served_by(client) for _ in range(2)] == [FALLBACK, FALLBACK]
            assert is_open(PRIMARY)
            await asyncio.sleep(0.3)  # past the cooldown: half-open, one trial request
            assert await served_by(client) == PRIMARY
            assert not is_open(PRIMARY)
            assert await served_by(client) == PRIMARY


# ---------------------------------------------------------------------------- half-open probes


class Clock:
    """Monotonic seconds stepped by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failure() -> GatewayError:
    return UpstreamServerError("upstream 503 (test)")


async def open_circuit(cooldowns: Cooldowns, model: str) -> None:
    async def fail() -> None:
        raise failure()

    for _ in range(cooldowns.config.cooldown.failures):
        with pytest.raises(UpstreamServerError):
            await cooldowns.call(model, fail)
    assert cooldowns.state(model) == "open"


def breaker(clock: Clock, **values) -> Cooldowns:
    return Cooldowns(gateway_config("http://127.0.0.1:1/v1", **cooldown(cooldown_s=10.0, **values)), clock=clock)


@pytest.mark.parametrize("probes", [1, 3])
async def test_half_open_admits_exactly_the_configured_probes_and_refuses_the_rest_at_once(probes) -> None:
    clock = Clock()
    cooldowns = breaker(clock, half_open_probes=probes)
    await open_circuit(cooldowns, PRIMARY)
    clock.now += 10.5  # past the cooldown
    release = asyncio.Event()
    admitted = 0

    async def probe() -> str:
        nonlocal admitted
        admitted += 1
        await release.wait()
        return "ok"

    calls = [asyncio.ensure_future(cooldowns.call(PRIMARY, probe)) for _ in range(10)]
    await asyncio.sleep(0)
    refused = [c for c in calls if c.done()]
    assert admitted == probes and len(refused) == 10 - probes
    for call in refused:
        assert isinstance(call.exception(), ModelCoolingDown)
        assert "half_open_probes" in str(call.exception())
    assert cooldowns.state(PRIMARY) == "half_open"
    assert GATEWAY_CIRCUIT_STATE.labels(PRIMARY, "half_open")._value.get() == 1
    release.set()
    assert [await c for c in calls if c not in refused] == ["ok"] * probes
    assert cooldowns.state(PRIMARY) == "closed"


@pytest.mark.parametrize("outcome", ["served", "failed", "said_nothing"])
async def test_a_call_with_nowhere_else_to_go_waits_for_the_probes_outcome(outcome) -> None:
    """Half-open, one probe out: a call waiting for the probes (no fallback left, no other endpoint) is sent once
    the probe succeeds, refused as while open once it fails, and takes the probe's place when it tells nothing.
    Refused at once, such calls failed UNAVAILABLE in front of a transformers serve back from a stall."""
    clock = Clock()
    cooldowns = breaker(clock, half_open_probes=1)
    await open_circuit(cooldowns, PRIMARY)
    clock.now += 10.5  # past the cooldown
    release = asyncio.Event()
    sent = []

    async def probe() -> str:
        await release.wait()
        if outcome == "failed":
            raise failure()
        if outcome == "said_nothing":
            raise UpstreamRateLimited("429 (test)")
        return "ok"

    async def waiter(n: int) -> str:
        sent.append(n)
        return "ok"

    first = asyncio.ensure_future(cooldowns.call(PRIMARY, probe))
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(cooldowns.call(PRIMARY, lambda n=n: waiter(n), wait_for_probes=True))
               for n in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiting) and sent == []  # neither refused nor sent while the probe runs
    release.set()
    outcomes = await asyncio.gather(first, *waiting, return_exceptions=True)
    if outcome == "served":
        assert outcomes == ["ok"] * 4 and sorted(sent) == [0, 1, 2]
        assert cooldowns.state(PRIMARY) == "closed"
    elif outcome == "failed":
        assert isinstance(outcomes[0], UpstreamServerError) and sent == []
        assert all(isinstance(o, ModelCoolingDown) and "skipped for" in str(o) for o in outcomes[1:])
        assert cooldowns.state(PRIMARY) == "open"
    else:  # the first waiter became the probe, and its success closed the circuit for the others
        assert isinstance(outcomes[0], UpstreamRateLimited) and outcomes[1:] == ["ok"] * 3
        assert cooldowns.state(PRIMARY) == "closed"


async def test_one_failing_probe_reopens_and_a_late_probe_of_that_period_changes_nothing() -> None:
    clock = Clock()
    cooldowns = breaker(clock, half_open_probes=2)
    await open_circuit(cooldowns, PRIMARY)
    clock.now += 10.5
    release = asyncio.Event()

    async def slow_ok() -> str:
        await release.wait()
        return "ok"

    async def fail() -> None:
        raise failure()

    late = asyncio.ensure_future(cooldowns.call(PRIMARY, slow_ok))
    await asyncio.sleep(0)
    reopened = transitions(PRIMARY, "half_open", "open")
    with pytest.raises(UpstreamServerError):
        await cooldowns.call(PRIMARY, fail)
    assert cooldowns.state(PRIMARY) == "open" and transitions(PRIMARY, "half_open", "open") == reopened + 1
    release.set()
    assert await late == "ok"
    assert cooldowns.state(PRIMARY) == "open"  # its success belongs to the period that already failed
    with pytest.raises(ModelCoolingDown, match="skipped for"):
        await cooldowns.call(PRIMARY, slow_ok)


@pytest.mark.parametrize("neutral", [UpstreamRateLimited("429 (test)"), asyncio.CancelledError()],
                         ids=["rate-limit", "cancelled"])
async def test_a_probe_that_tells_nothing_frees_its_place_and_neither_closes_nor_opens(neutral) -> None:
    clock = Clock()
    cooldowns = breaker(clock, half_open_probes=1)
    await open_circuit(cooldowns, PRIMARY)
    clock.now += 10.5

    async def says_nothing() -> None:
        raise neutral

    with pytest.raises(type(neutral)):
        await cooldowns.call(PRIMARY, says_nothing)
    assert cooldowns.state(PRIMARY) == "half_open"  # purgatory closed the circuit here

    async def ok() -> str:
        return "ok"

    assert await cooldowns.call(PRIMARY, ok) == "ok"  # the place it held is free again
    assert cooldowns.state(PRIMARY) == "closed"


def test_every_state_and_transition_is_exported_from_zero_for_each_configured_model() -> None:
    Cooldowns(gateway_config("http://127.0.0.1:1/v1", **cooldown()))
    for model in (PRIMARY, FALLBACK):
        states = {s: GATEWAY_CIRCUIT_STATE.labels(model, s)._value.get() for s in CIRCUIT_STATES}
        assert sum(states.values()) == 1
        for before, after in CIRCUIT_TRANSITIONS:
            assert transitions(model, before, after) >= 0


async def test_half_open_through_the_client_sends_one_probe_the_rest_go_to_the_fallback(clean_proxy_env):
    with start_sim(faults={PRIMARY: Fault(status=503, fail_first=2, slow_ms=300)}) as server:
        async with GatewayClient(gateway_config(server.base_url, **cooldown(cooldown_s=0.2))) as client:
            assert [await served_by(client) for _ in range(2)] == [FALLBACK, FALLBACK]
            await asyncio.sleep(0.3)  # past the cooldown: half-open
            # the probe takes 0.3 s an item (3 items), so the other nine are asked while it is in flight
            short = ChatRequest(messages=[{"role": "user", "content": "hello there"}], max_tokens=3)
            served = await asyncio.gather(*(served_by(client, short) for _ in range(10)))
        assert served.count(PRIMARY) == 1 and served.count(FALLBACK) == 9
        assert server.state.counts[PRIMARY] == 3  # two failures, then exactly one probe


async def test_the_open_period_doubles_at_each_reopening_up_to_the_cooldown_and_starts_over_once_closed() -> None:
    """A model server restarted in a few seconds is tried again within first_cooldown_s (before, every
    opening lasted cooldown_s: 30 s of refusals after the server was back, seen in front of transformers
    serve); one that stays down is probed at 2, 4, 8, 16 s, then every cooldown_s."""
    clock = Clock()
    cooldowns = breaker(clock, first_cooldown_s=2.0)  # cooldown_s 10

    async def fail() -> None:
        raise failure()

    async def ok() -> str:
        return "ok"

    await open_circuit(cooldowns, PRIMARY)
    waits = []
    for _ in range(5):  # each period: refused until it ends, then its probe fails
        opened_at, probed = clock.now, False
        while not probed:
            clock.now += 0.25
            try:
                await cooldowns.call(PRIMARY, fail)
            except ModelCoolingDown:
                continue
            except UpstreamServerError:
                probed = True  # admitted as the half-open probe, and failed
        waits.append(clock.now - opened_at)
        assert cooldowns.state(PRIMARY) == "open"  # the probe failed: open again
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
    clock.now += 10.0
    assert await cooldowns.call(PRIMARY, ok) == "ok" and cooldowns.state(PRIMARY) == "closed"
    await open_circuit(cooldowns, PRIMARY)  # closed in between: the next opening starts over
    clock.now += 2.0
    assert await cooldowns.call(PRIMARY, ok) == "ok"


async def test_an_open_circuit_half_opens_once_its_endpoint_answers_again() -> None:
    """In front of transformers serve, a server restarted after 45 s was served 12 s after it answered again:
    the open period had doubled to 16 s while it was down. While open, the endpoint's health is read at most
    every health_check_interval_s (on a refused call) and its first answer half-opens the circuit, however
    long the open period has grown; the refusal repeats the last fault's cause."""
    clock = Clock()
    answers: list[bool] = []
    checks = 0

    async def health() -> bool:
        nonlocal checks
        checks += 1
        return answers.pop(0)

    cooldowns = breaker(clock, first_cooldown_s=30.0, health_check_interval_s=1.0)  # a long open period
    cooldowns.health_check = health

    async def ok() -> str:
        return "ok"

    await open_circuit(cooldowns, PRIMARY)
    answers.extend([False, True])
    with pytest.raises(ModelCoolingDown) as refused:
        await cooldowns.call(PRIMARY, ok)  # refused; starts the first check (no answer)
    assert "the last: upstream 503 (test)" in str(refused.value)  # the cause, not only the cooldown
    await asyncio.sleep(0)
    clock.now += 0.5
    with pytest.raises(ModelCoolingDown):
        await cooldowns.call(PRIMARY, ok)  # within the interval: no second check
    assert checks == 1 and cooldowns.state(PRIMARY) == "open"
    clock.now += 0.6
    with pytest.raises(ModelCoolingDown):
        await cooldowns.call(PRIMARY, ok)  # starts the second check: it answers
    await asyncio.sleep(0)
    assert checks == 2 and cooldowns.state(PRIMARY) == "half_open"
    assert await cooldowns.call(PRIMARY, ok) == "ok" and cooldowns.state(PRIMARY) == "closed"  # 1.1 s, not 30


async def test_an_open_circuit_is_checked_in_the_background_with_no_call_arriving() -> None:
    """While open, the endpoint's health is read without any call starting the read: its first answer half-opens
    the circuit, so the first call after a server's return is its probe, not a refusal. Closing the breaker
    stops the checks of a circuit still open."""
    clock = Clock()
    answers = [False, True]

    async def health() -> bool:
        clock.now += 1.0  # each read ends past the interval: the next one may start
        return answers.pop(0) if answers else False

    cooldowns = breaker(clock, first_cooldown_s=30.0, health_check_interval_s=0.01)
    cooldowns.health_check = health
    await open_circuit(cooldowns, PRIMARY)
    for _ in range(1000):
        if cooldowns.state(PRIMARY) != "open":
            break
        await asyncio.sleep(0.01)
    assert cooldowns.state(PRIMARY) == "half_open" and not answers

    async def fail() -> None:
        raise failure()

    with pytest.raises(UpstreamServerError):
        await cooldowns.call(PRIMARY, fail)  # the probe fails: open again, checked no more this period
    assert cooldowns.state(PRIMARY) == "open"
    await cooldowns.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith(("circuit-watch", "health-check"))]


async def test_the_background_check_waits_one_interval_after_the_circuit_opens() -> None:
    """A server that lists its models while one of them fails (its own 503): the background check read its health
    as the circuit opened, half-opened it at once, and the failing model was tried again with no open period
    (test_a_failing_model_is_skipped_for_its_cooldown failed by that race). The first check comes one
    health_check_interval_s after the opening."""
    cooldowns = breaker(Clock(), first_cooldown_s=30.0, health_check_interval_s=60.0)
    checks: list[float] = []
    cooldowns.health_check = answering_health(checks)
    await open_circuit(cooldowns, PRIMARY)
    for _ in range(20):  # the watch's turns on the loop
        await asyncio.sleep(0)
    assert not checks and cooldowns.state(PRIMARY) == "open"
    await cooldowns.aclose()


def answering_health(checks: list[float], clock: Clock | None = None):  # type: ignore[no-untyped-def]
    """A health check that answers (True), noting each read in ``checks`` (``clock``'s time, or 0)."""
    async def health() -> bool:
        checks.append(clock.now if clock is not None else 0.0)
        return True

    return health


async def test_a_restarted_server_is_served_within_the_health_check_interval(clean_proxy_env):
    """A real sim-openai stopped (the circuit opens for 30 s) and started again on the same port: the gateway
    serves again within about health_check_interval_s of its return."""
    import time

    from switchyard_harness.sim_openai import SimOpenAIOptions, run_in_thread

    config = {"cooldown": {"enabled": True, "failures": 1, "first_cooldown_s": 30.0, "cooldown_s": 30.0,
                           "health_check_interval_s": 0.2}, "max_retries": 0}
    with start_sim() as first:
        port = first.port
        client = GatewayClient(gateway_config(first.base_url, fallback_model="", **config))
        assert await served_by(client) == PRIMARY
    try:
        with pytest.raises(GatewayError):
            await served_by(client)  # down: the circuit opens for 30 s
        with run_in_thread(SimOpenAIOptions(latency=False), port=port):
            back = time.monotonic()
            while True:
                try:
                    assert await served_by(client) == PRIMARY
                    break
                except ModelCoolingDown:
                    assert time.monotonic() - back < 5.0, "still refused 5 s after the server came back"
                    await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def test_a_server_that_lists_its_models_but_fails_its_calls_is_not_probed_every_second() -> None:
    """sim-openai --fault status=503 answers GET /models: each check half-opened the circuit and its probe
    failed, 39 times in 40 s. A probe admitted on a check's word that fails stops the checks until that
    open period ends."""
    clock = Clock()
    checks: list[float] = []

    async def fail() -> None:
        raise failure()

    cooldowns = breaker(clock, first_cooldown_s=8.0, health_check_interval_s=1.0)  # cooldown_s 10
    cooldowns.health_check = answering_health(checks, clock)
    await open_circuit(cooldowns, PRIMARY)
    with pytest.raises(ModelCoolingDown):
        await cooldowns.call(PRIMARY, fail)  # starts a check: it answers
    await asyncio.sleep(0)
    assert cooldowns.state(PRIMARY) == "half_open"
    with pytest.raises(UpstreamServerError):
        await cooldowns.call(PRIMARY, fail)  # the probe fails: open for 10 s (the second opening)
    probes = 0
    for _ in range(18):  # 9 s of calls every half second: refused, and no check starts
        clock.now += 0.5
        try:
            await cooldowns.call(PRIMARY, fail)
        except ModelCoolingDown as refused:
            assert "or until it answers again" not in str(refused)
        except UpstreamServerError:
            probes += 1
        await asyncio.sleep(0)
    assert len(checks) == 1 and probes == 0 and cooldowns.state(PRIMARY) == "open"


async def test_callers_naming_ever_new_models_cannot_grow_the_circuit_table() -> None:
    """A circuit that holds nothing is the same as none: past MAX_CIRCUITS such circuits are let go; one that
    counted a failure or is open is kept."""
    from switchyard.gateway.cooldown import MAX_CIRCUITS

    cooldowns = breaker(Clock())

    async def ok() -> str:
        return "ok"

    await open_circuit(cooldowns, PRIMARY)
    for i in range(3 * MAX_CIRCUITS):
        await cooldowns.call(f"made-up-{i}", ok)
    assert len(cooldowns._circuits) <= MAX_CIRCUITS
    assert cooldowns.state(PRIMARY) == "open"


async def test_the_time_left_of_an_open_circuit_never_reads_zero() -> None:
    """An answer 20 ms before the circuit half-opens said "skipped for 0.0 s more"."""
    clock = Clock()
    cooldowns = breaker(clock)
    await open_circuit(cooldowns, PRIMARY)

    async def ok() -> str:
        return "ok"

    with pytest.raises(ModelCoolingDown, match=r"skipped for \d+\.\d s more"):
        await cooldowns.call(PRIMARY, ok)
    clock.now = cooldowns._circuits[PRIMARY].open_until - 0.02
    with pytest.raises(ModelCoolingDown, match="skipped for under 0.1 s more"):
        await cooldowns.call(PRIMARY, ok)


@pytest.mark.parametrize("asked", [1e20, 10 * 365 * 86400.0, 25.0, 4.0])
async def test_a_wait_asked_for_is_held_locally_at_most_the_cooldown_then_asked_again(asked) -> None:
    """A 429's Retry-After refuses the model's calls locally, at most for ``cooldown.cooldown_s`` (10 s here): a
    finite nonsense (1e20 s, an HTTP date ten years ahead) had locked the model out for as long. A wait within it
    is held whole; after the hold one call reaches the server again."""
    from switchyard.gateway.errors import UpstreamAskedToWait
    clock = Clock()
    cooldowns = breaker(clock)
    sent = 0

    async def rate_limited() -> str:
        nonlocal sent
        sent += 1
        error = UpstreamRateLimited("429 (test)")
        error.retry_after_s = asked
        raise error

    async def served() -> str:
        nonlocal sent
        sent += 1
        return "ok"

    with pytest.raises(UpstreamRateLimited):
        await cooldowns.call(PRIMARY, rate_limited)
    held = min(asked, 10.0)
    clock.now += held - 0.5
    with pytest.raises(UpstreamAskedToWait) as refused:
        await cooldowns.call(PRIMARY, served)
    assert sent == 1 and refused.value.retry_after_s == pytest.approx(asked - held + 0.5)  # the whole wait's rest
    if asked > 10.0:
        assert "model_gateway.cooldown.cooldown_s = 10 s" in str(refused.value), str(refused.value)
    clock.now += 1.0
    assert await cooldowns.call(PRIMARY, served) == "ok" and sent == 2
