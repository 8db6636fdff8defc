"""Every gateway row of the error table (docs/architecture.md), against a real local HTTP server speaking SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct

import grpc
import pytest
from gateway_fixtures import TEST_KEY, clean_proxy_env, gateway_config, sim_openai, start_sim  # noqa: F401

from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest, Token
from switchyard_harness.faults import Fault

KEY_ENV = "SWITCHYARD_TEST_API_KEY"


def ask(model: str = "", **fields) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hello there"}], model=model, **fields)


async def stream_error(cfg, request: ChatRequest | None = None) -> GatewayError:
    async with GatewayClient(cfg) as client:
        with pytest.raises(GatewayError) as caught:
            async for _ in client.stream_chat(request or ask()):
                pass
    return caught.value


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- keys


async def test_missing_key_is_unauthenticated_and_names_the_variable(sim_openai, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    err = await stream_error(gateway_config(sim_openai.base_url, api_key_required=True))
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert KEY_ENV in str(err) and "not set" in str(err)
    # the way out for a local server that takes no key is named beside the key's
    assert "model_gateway.api_key_required to false (SWITCHYARD_UPSTREAM_API_KEY_REQUIRED=false)" in str(err)
    assert sim_openai.state.requests == []


async def test_key_with_trailing_newline_is_unauthenticated_with_length_never_the_key(sim_openai, monkeypatch):
    monkeypatch.setenv(KEY_ENV, TEST_KEY + "\n")
    err = await stream_error(gateway_config(sim_openai.base_url, api_key_required=True))
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    message = str(err)
    assert KEY_ENV in message and f"length {len(TEST_KEY) + 1}" in message and "trailing '\\n'" in message
    assert TEST_KEY not in message and TEST_KEY[:12] not in message


async def test_upstream_401_names_variable_length_and_whitespace_never_the_key(monkeypatch, clean_proxy_env):
    monkeypatch.setenv(KEY_ENV, TEST_KEY)
    with start_sim(api_key="the-right-key", faults={"*": Fault(echo_key=True)}) as server:
        err = await stream_error(gateway_config(server.base_url, api_key_required=True))
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    message = str(err)
    assert "401" in message and KEY_ENV in message
    assert f"length {len(TEST_KEY)}, no whitespace" in message
    assert TEST_KEY not in message and "[redacted]" in message  # the server echoed it; redacted


@pytest.mark.parametrize("status, code, retried, says", [
    (403, grpc.StatusCode.PERMISSION_DENIED, False, "refused"),  # gRPC's mapping of HTTP 403
    (418, grpc.StatusCode.INVALID_ARGUMENT, False, "rejected"),
    (451, grpc.StatusCode.INVALID_ARGUMENT, False, "rejected"),
    (408, grpc.StatusCode.UNAVAILABLE, True, "timed the request for model"),  # the server timed it out, as a 5xx
    # the statuses that are not the request's fault, which all read INVALID_ARGUMENT (402, 409, 425 ...):
    (402, grpc.StatusCode.FAILED_PRECONDITION, False, "no credit or quota left"),  # the account's
    (405, grpc.StatusCode.NOT_FOUND, False, "takes no POST"),  # the base URL's
    (407, grpc.StatusCode.UNAUTHENTICATED, False, "proxy between here and the model server"),
    (409, grpc.StatusCode.ABORTED, True, "conflicts with a state of the server"),
    (410, grpc.StatusCode.NOT_FOUND, False, "gone for good"),
    (421, grpc.StatusCode.UNAVAILABLE, True, "over another connection"),
    (424, grpc.StatusCode.UNAVAILABLE, True, "the model server failed"),
    (425, grpc.StatusCode.UNAVAILABLE, True, "TLS handshake"),
    (501, grpc.StatusCode.UNIMPLEMENTED, False, "does not implement"),
])
async def test_each_upstream_status_maps_to_its_own_code(status, code, retried, says, clean_proxy_env):
    """Only the request's own fault is INVALID_ARGUMENT, which blames the caller: a 402 (an account out of credit),
    a 409 or a 425 (the server's state, asked to retry) read so, neither retried nor sent to the fallback."""
    with start_sim(faults={"*": Fault(status=status)}) as server:
        err = await stream_error(gateway_config(server.base_url, max_retries=0))
    assert err.code == code and str(status) in str(err) and says in str(err)
    assert err.retryable == retried and not err.refuses_load


async def test_openais_429_insufficient_quota_is_the_accounts_not_a_rate_limit(clean_proxy_env):
    """OpenAI answers an account out of credit 429 insufficient_quota: read as a rate limit, it was retried, the
    adaptive limit backed off and a submitted task went back to the backlog, for a wait that fixes nothing."""
    from switchyard.gateway.classify import error_for_status
    from switchyard.gateway.decode import StreamDecoder
    from switchyard.gateway.keys import ApiKey

    body = json.dumps({"error": {"message": "You exceeded your current quota, please check your plan and billing "
                                            "details.", "type": "insufficient_quota", "param": None,
                                 "code": "insufficient_quota"}})
    key = ApiKey("OPENAI_API_KEY", "sk-live-1")
    answered = error_for_status(429, body, {}, url="https://api.openai.com/v1/chat/completions", model="gpt-4o",
                                key=key)
    with pytest.raises(GatewayError) as in_stream:
        StreamDecoder("gpt-4o", key=key).feed(body)
    for error in (answered, in_stream.value):
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION and not error.refuses_load
        assert not error.retryable and not error.fallback_ok and "OPENAI_API_KEY" in str(error)
    plain = error_for_status(429, json.dumps({"error": {"message": "Rate limit reached", "type": "requests",
                                                        "code": "rate_limit_exceeded"}}), {}, url="u", model="m",
                             key=key)
    assert plain.code == grpc.StatusCode.RESOURCE_EXHAUSTED and plain.refuses_load


async def test_expired_oauth_token_says_reauthenticate_or_use_api_key(clean_proxy_env):
    with start_sim(faults={"*": Fault(expired=True)}) as server:
        err = await stream_error(gateway_config(server.base_url))
    assert err.code == grpc.StatusCode.UNAUTHENTICATED
    assert "expired" in str(err) and "re-authenticate" in str(err) and "API key" in str(err)


# --------------------------------------------------------------------------- models


async def test_unknown_model_is_not_found_with_nearest_id(sim_openai):
    err = await stream_error(gateway_config(sim_openai.base_url, fallback_model=""), ask("claude-sonnet-4.5"))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert "'claude-sonnet-4.5'" in str(err) and "did you mean 'claude-sonnet-4-5'" in str(err)


async def test_an_alias_mapped_to_an_unknown_id_is_not_found_naming_both(sim_openai):
    # the caller sent "sonnet"; the message named only the id model_map sent it as, which the caller never wrote
    cfg = gateway_config(sim_openai.base_url, fallback_model="", model_map={"sonnet": "claude-sonnet-4.5"})
    err = await stream_error(cfg, ask("sonnet"))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert "model 'claude-sonnet-4.5' (the request's 'sonnet', through model_gateway.model_map)" in str(err)


async def test_unknown_default_model_with_unknown_fallback_reports_both(sim_openai):
    cfg = gateway_config(sim_openai.base_url, default_model="claude-sonnet-4.5", fallback_model="gpt-4o-mini-x")
    err = await stream_error(cfg, ask())  # no model named: the configured default, then the fallback
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert "claude-sonnet-4-5" in str(err) and "fallback model 'gpt-4o-mini-x' failed too" in str(err)


async def test_a_fallback_not_found_names_no_request_mapping_it_never_had(clean_proxy_env):
    # The fallback's id is the configuration's, not the request's: the note on its not-found read "model
    # 'gpt-4o-mini-x' (the request's 'claude-sonnet-4-5', through model_gateway.model_map)", a mapping that never
    # was. The request's own alias, mapped and not found, is still named (the test above).
    with start_sim(faults={"claude-sonnet-4-5": Fault(status=503)}) as server:
        cfg = gateway_config(server.base_url, fallback_model="gpt-4o-mini-x", max_retries=0)
        err = await stream_error(cfg, ask("claude-sonnet-4-5"))
    assert "fallback model 'gpt-4o-mini-x' failed too: model 'gpt-4o-mini-x' not found upstream" in str(err), err
    assert "the request's" not in str(err)
    with start_sim(faults={"claude-sonnet-4-5": Fault(status=503)}) as server:
        cfg = gateway_config(server.base_url, fallback_model="fast", model_map={"fast": "gpt-4o-mini-x"},
                             max_retries=0)
        err = await stream_error(cfg, ask("claude-sonnet-4-5"))
    assert "model 'gpt-4o-mini-x' (model_gateway.fallback_model 'fast', through model_gateway.model_map)" in str(err)


async def test_wrong_base_url_path_is_not_found_naming_v1(sim_openai):
    err = await stream_error(gateway_config(sim_openai.base_url.removesuffix("/v1")))
    assert err.code == grpc.StatusCode.NOT_FOUND and "/v1" in str(err)


# --------------------------------------------------------------------------- transport


async def test_dead_proxy_is_unavailable_naming_variable_and_address(sim_openai, monkeypatch):
    proxy = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HTTP_PROXY", proxy)
    err = await stream_error(gateway_config(sim_openai.base_url, max_retries=1))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "local proxy failed" in str(err) and f"HTTP_PROXY={proxy}" in str(err) and "NO_PROXY" in str(err)
    assert sim_openai.state.requests == []


async def test_no_proxy_bypasses_the_dead_proxy(sim_openai, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    async with GatewayClient(gateway_config(sim_openai.base_url)) as client:
        events = [e async for e in client.stream_chat(ask())]
    assert any(isinstance(e, Token) for e in events)


async def test_upstream_down_is_unavailable_naming_address(clean_proxy_env):
    base = f"http://127.0.0.1:{closed_port()}/v1"
    err = await stream_error(gateway_config(base, max_retries=1))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert base in str(err) and "switchyard serve sim-openai" in str(err)
    assert str(err).endswith("or fix model_gateway.base_url"), str(err)


async def test_an_https_url_of_a_plain_http_server_says_to_use_http(sim_openai):
    """A model server started without TLS behind an https:// base_url read 'start the model server', which runs."""
    base = sim_openai.base_url.replace("http://", "https://", 1)
    err = await stream_error(gateway_config(base, max_retries=0, fallback_model=""))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "answers plain HTTP, not TLS" in str(err) and str(err).endswith("use http:// in model_gateway.base_url")
    assert "start the model server" not in str(err), str(err)


async def test_a_url_the_environment_set_is_the_one_its_fix_names(clean_proxy_env, monkeypatch, sim_openai):
    """The README's model-server recipe sets the URL with SWITCHYARD_UPSTREAM_BASE_URL, which overrides
    model_gateway.base_url: a server not started, or a URL without /v1, said 'fix model_gateway.base_url', a key
    that changes nothing while the variable is set (doctor named the variable)."""
    base = f"http://127.0.0.1:{closed_port()}/v1"
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", base)
    down = await stream_error(gateway_config(base, max_retries=0))
    assert down.code == grpc.StatusCode.UNAVAILABLE
    assert "or fix SWITCHYARD_UPSTREAM_BASE_URL (it overrides model_gateway.base_url)" in str(down), str(down)
    root = sim_openai.base_url.removesuffix("/v1")
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", root)
    no_v1 = await stream_error(gateway_config(root))
    assert no_v1.code == grpc.StatusCode.NOT_FOUND
    assert "SWITCHYARD_UPSTREAM_BASE_URL (it overrides model_gateway.base_url) must be the OpenAI-compatible root" \
        in str(no_v1), str(no_v1)


async def test_a_pools_unreachable_endpoint_names_the_pools_list(clean_proxy_env):
    bases = [f"http://127.0.0.1:{closed_port()}/v1" for _ in range(2)]
    err = await stream_error(gateway_config(bases[0], max_retries=0, pool={"endpoints": bases}))
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "model_gateway.pool.endpoints" in str(err) and "model_gateway.base_url" not in str(err), str(err)


async def test_total_timeout_is_deadline_exceeded(clean_proxy_env):
    with start_sim(faults={"*": Fault(slow_ms=3000)}) as server:
        err = await stream_error(gateway_config(server.base_url, total_timeout_s=0.2, fallback_model=""))
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "total_timeout_s" in str(err)


async def test_the_callers_deadline_bounds_the_upstream_call(clean_proxy_env):
    """The dispatcher passes its caller's remaining time on (ChatRequest.timeout_s): the upstream call
    ends by then even when model_gateway.total_timeout_s would allow more."""
    with start_sim(faults={"*": Fault(slow_ms=3000)}) as server:
        request = ChatRequest(messages=[{"role": "user", "content": "hi"}], timeout_s=0.2)
        err = await stream_error(gateway_config(server.base_url, total_timeout_s=60, fallback_model=""), request)
        # where the caller's deadline came from, as it names it (the orchestrator: its task's time limit)
        sourced = ChatRequest(messages=[{"role": "user", "content": "hi"}], timeout_s=0.2,
                              deadline_source="orchestrator.task_time_limit_s.chat = 0.2")
        named = await stream_error(gateway_config(server.base_url, total_timeout_s=60, fallback_model=""), sourced)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "the caller's deadline (0.2s left)" in str(err)
    assert "the caller's deadline (0.2s left, from orchestrator.task_time_limit_s.chat = 0.2)" in str(named)


@pytest.mark.parametrize("budget", ["callers", "total"])
async def test_no_fallback_request_is_sent_once_the_calls_deadline_has_passed(clean_proxy_env, budget):
    """The primary timed out at the call's deadline (the caller's, or model_gateway.total_timeout_s) and the
    fallback model was asked anyway: its request reached the server for a call no one waited for, the error said
    the fallback 'did not complete within the caller's deadline (0.3s left)' having had none of it, and a task's
    error named the fallback model as the one it waited on ('(model gpt-4o-mini) for 0.00144 s')."""
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}],
                          timeout_s=0.3 if budget == "callers" else None)
    with start_sim(faults={"*": Fault(slow_ms=3000)}) as server:
        cfg = gateway_config(server.base_url, total_timeout_s=60 if budget == "callers" else 0.3,
                             fallback_model="gpt-4o-mini")
        err = await stream_error(cfg, request)
        await asyncio.sleep(0.2)  # a request sent at the deadline has reached the server by now
        sent = [body["model"] for body in server.state.requests]
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert str(err).endswith("fallback model 'gpt-4o-mini' not tried: the call's deadline had passed"), err
    assert sent == ["claude-sonnet-4-5"]


@pytest.mark.parametrize("streamed", [False, True], ids=["before-its-first-token", "mid-stream"])
async def test_a_call_whose_callers_deadline_ran_out_counts_as_cancelled_not_as_the_models_failure(
        clean_proxy_env, streamed):
    """The caller's deadline passing is its caller giving up, as a cancel is: whether the gateway's own clock or
    gRPC's cancel of the handler saw it first decided the outcome (DEADLINE_EXCEEDED or CANCELLED), and the
    DEADLINE_EXCEEDED ones counted as the model failing in switchyard_gateway_requests_total, where
    SwitchyardUpstreamFailing reads them (a run of tasks with short deadlines: 12 DEADLINE_EXCEEDED beside 6 ok,
    'fails most calls'). The caller still hears DEADLINE_EXCEEDED; the gateway's own bound
    (model_gateway.total_timeout_s: the model too slow) still counts DEADLINE_EXCEEDED."""
    from prometheus_client import REGISTRY

    def count(outcome: str) -> float:
        return REGISTRY.get_sample_value("switchyard_gateway_requests_total",
                                         {"model": "claude-sonnet-4-5", "outcome": outcome}) or 0.0

    fault = Fault(slow_ms=400) if streamed else Fault(slow_ms=3000)  # a token each 0.4 s, or none within 3 s
    with start_sim(faults={"*": fault}) as server:
        before = count("CANCELLED"), count("DEADLINE_EXCEEDED")
        request = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=50, timeout_s=1.0)
        err = await stream_error(gateway_config(server.base_url, total_timeout_s=60, fallback_model=""), request)
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "the caller's deadline" in str(err)
        assert (count("CANCELLED"), count("DEADLINE_EXCEEDED")) == (before[0] + 1, before[1])
        err = await stream_error(gateway_config(server.base_url, total_timeout_s=1.0, fallback_model=""),
                                 ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=50))
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "total_timeout_s" in str(err)
        assert (count("CANCELLED"), count("DEADLINE_EXCEEDED")) == (before[0] + 1, before[1] + 1)


# --------------------------------------------------------------------------- broken streams


@pytest.mark.parametrize(
    ("fault", "code", "says"),
    [
        (Fault(cut_after=0), grpc.StatusCode.UNAVAILABLE, "closed mid-response"),
        (Fault(no_finish=True), grpc.StatusCode.UNAVAILABLE, "before any finish_reason and without 'data: [DONE]'"),
        (Fault(malformed_after=0), grpc.StatusCode.INTERNAL, "not JSON"),
        (Fault(no_choices=True), grpc.StatusCode.INTERNAL, "reading choices"),
    ],
    ids=["truncated", "no-finish-no-done", "malformed-chunk", "no-choices"],
)
async def test_broken_stream_names_what_was_received(clean_proxy_env, fault, code, says):
    with start_sim(faults={"*": fault}) as server:
        err = await stream_error(gateway_config(server.base_url, fallback_model="", max_retries=0))
    assert err.code == code
    assert says in str(err)


@pytest.mark.parametrize("fault", [
    Fault(cut_after=0), Fault(no_finish=True), Fault(malformed_after=2), Fault(no_choices=True),
    Fault(status=429), Fault(status=400), Fault(status=503), Fault(expired=True),
], ids=["cut", "no-finish", "malformed", "no-choices", "429", "400", "503", "expired"])
async def test_every_upstream_failure_names_the_upstream_that_answered(clean_proxy_env, fault):
    """With a pool of replicas the message is how a user tells which one failed: every status error and
    every stream the decoder refuses names the URL (before, 429, 400, an expired token, a stream without
    an ending, a malformed chunk and chunks without choices did not)."""
    with start_sim(faults={"*": fault}) as server:
        err = await stream_error(gateway_config(server.base_url, fallback_model="", max_retries=0))
    assert f"{server.base_url}/chat/completions" in str(err), str(err)


async def test_a_model_the_server_does_not_serve_names_the_upstream_too(sim_openai):
    err = await stream_error(gateway_config(sim_openai.base_url, default_model="no-such-model", fallback_model=""))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert f"{sim_openai.base_url}/chat/completions" in str(err), str(err)


async def test_malformed_chunk_message_quotes_the_chunk(clean_proxy_env):
    with start_sim(faults={"*": Fault(malformed_after=0)}) as server:
        err = await stream_error(gateway_config(server.base_url, fallback_model=""))
    assert '"content": "tru' in str(err)


# --------------------------------------------------------------------------- statuses and retries


async def test_rate_limit_is_resource_exhausted(clean_proxy_env):
    with start_sim(faults={"*": Fault(status=429)}) as server:
        err = await stream_error(gateway_config(server.base_url, fallback_model="", max_retries=1))
        assert server.state.counts["claude-sonnet-4-5"] == 2
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "429" in str(err)


async def test_bad_request_is_invalid_argument(clean_proxy_env):
    with start_sim(faults={"*": Fault(status=400)}) as server:
        err = await stream_error(gateway_config(server.base_url, fallback_model=""))
        assert server.state.counts["claude-sonnet-4-5"] == 1  # not retried
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "bad request" in str(err)


async def test_server_error_is_retried_with_backoff_then_served(clean_proxy_env):
    with start_sim(faults={"*": Fault(status=503, fail_first=2)}) as server:
        async with GatewayClient(gateway_config(server.base_url, max_retries=2, fallback_model="")) as client:
            events = [e async for e in client.stream_chat(ask())]
        assert server.state.counts["claude-sonnet-4-5"] == 3
    assert any(isinstance(e, Token) for e in events)


async def test_server_error_after_retries_is_unavailable(clean_proxy_env):
    with start_sim(faults={"*": Fault(status=503)}) as server:
        err = await stream_error(gateway_config(server.base_url, max_retries=2, fallback_model=""))
        assert server.state.counts["claude-sonnet-4-5"] == 3
    assert err.code == grpc.StatusCode.UNAVAILABLE and "503" in str(err)


# --------------------------------------------------------------------------- transports


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_both_http_transports_stream_and_fail_by_the_same_table(clean_proxy_env, transport):
    """model_gateway.http_transport: the answer, a cut stream and a dead upstream read the same on either."""
    with start_sim() as server:
        async with GatewayClient(gateway_config(server.base_url, http_transport=transport)) as client:
            events = [e async for e in client.stream_chat(ask())]
            assert type(next(iter(client.pool.endpoints.values())).http._transport).__name__ == (
                "UpstreamTransport" if transport == "aiohttp" else "AsyncHTTPTransport")
    assert [e for e in events if isinstance(e, Token)] and events[-1].finish_reason == "stop"
    with start_sim(faults={"*": Fault(cut_after=2)}) as server:
        err = await stream_error(gateway_config(server.base_url, fallback_model="", max_retries=0,
                                                http_transport=transport))
    assert err.code == grpc.StatusCode.UNAVAILABLE and "closed mid-response" in str(err)
    base = f"http://127.0.0.1:{closed_port()}/v1"
    err = await stream_error(gateway_config(base, max_retries=0, http_transport=transport))
    assert err.code == grpc.StatusCode.UNAVAILABLE and base in str(err)
    assert "(ConnectError: " in str(err)  # refused, not timed out (httpx-aiohttp alone says ConnectTimeout)


SSE_ANSWER = (
    b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    b'data: {"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


@contextlib.asynccontextmanager
async def tcp_upstream(answer):
    """A TCP server on 127.0.0.1 (port 0) that runs ``answer(reader, writer)`` on each connection, for answers no
    HTTP server library would send; yields its base URL, ending in ``/v1``."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP request off ``reader``: its head returned, its body (``content-length``) read and dropped."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


async def answer_json(writer: asyncio.StreamWriter, status: str, body: object) -> None:
    """Answer ``status`` (e.g. ``"404 Not Found"``) with ``body`` as JSON, then close the connection."""
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
                 "connection: close\r\n\r\n".encode() + data)
    await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def raw_upstream(head: bytes, body: bytes = b""):
    """A TCP server on 127.0.0.1 that answers every request with ``head`` then ``body``, and closes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # its body too: a socket closed with bytes unread sends an RST, not a FIN
        writer.write(head + body)
        await writer.drain()
        writer.close()

    async with tcp_upstream(answer) as base:
        yield base


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
@pytest.mark.parametrize("keepalive", [b"", b": ping\n\n", b"\n", b"id: 7\n\n"],
                         ids=["silent", "comment", "blank-line", "id-line"])
@pytest.mark.parametrize(("budget", "hold"), [("callers", False), ("total", False), ("callers", True)])
async def test_a_stream_that_stalls_after_its_first_token_ends_at_the_calls_deadline(clean_proxy_env, budget, hold,
                                                                                    keepalive, transport):
    """The deadline was checked only as an event came: a server that stalled after its first token held the call
    for model_gateway.read_timeout_s past a caller's deadline (then UNAVAILABLE 'raise read_timeout_s'), and one
    that kept the stalled stream alive with what carries no event (a ': ping' comment, as sse-starlette's servers
    send, a blank line, an 'id:' line) past model_gateway.total_timeout_s too, for as long as it kept on."""
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        first = SSE_ANSWER.split(b"\n\n")[0] + b"\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (len(first), first) * 2)  # two tokens, then the stall
        try:
            for _ in range(100):  # 10 s of the stall at most: the call ends long before, or the test fails
                await writer.drain()
                if keepalive:
                    writer.write(b"%x\r\n%s\r\n" % (len(keepalive), keepalive))
                await asyncio.sleep(0.1)
                if reader.at_eof():
                    break
        except ConnectionError:
            pass
        finally:
            closed.set()
            writer.close()

    from prometheus_client import REGISTRY

    from switchyard.gateway.metrics import STREAM_ENDINGS

    def endings() -> dict[str, float]:
        return {e: REGISTRY.get_sample_value("switchyard_upstream_stream_endings_total", {"ending": e}) or 0.0
                for e in STREAM_ENDINGS}

    before = endings()
    async with tcp_upstream(answer) as base:
        cfg = gateway_config(base, fallback_model="", max_retries=0, http_transport=transport, read_timeout_s=5,
                             total_timeout_s=60 if budget == "callers" else 0.5)
        request = ask(timeout_s=0.5 if budget == "callers" else None)
        async with GatewayClient(cfg) as client:
            items = []
            with pytest.raises(GatewayError) as caught:
                async for item in client.stream_chat(request):
                    items.append(item)
                    if hold and len(items) == 2:  # held past the deadline: the next read ends the call
                        await asyncio.sleep(1.0)
            await asyncio.wait_for(closed.wait(), 10)  # the connection was let go with the call
    err = caught.value
    assert [type(item) for item in items] == [Token, Token]
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert ("the caller's deadline (0.5s left)" if budget == "callers" else "total_timeout_s=0.5s") in str(err), err
    assert "after 2 streamed item" in str(err), err
    # its ending counted once, as the deadline's: the caller's gave up (cancelled), total_timeout_s timed it out
    after = endings()
    assert {e: after[e] - before[e] for e in STREAM_ENDINGS if after[e] != before[e]} == {
        "cancelled" if budget == "callers" else "timeout": 1}


CLOUDFLARE_524 = (
    b'<!DOCTYPE html>\n<!--[if lt IE 7]> <html class="no-js ie6 oldie" lang="en-US"> <![endif]-->\n'
    b'<!--[if gt IE 8]><!--> <html class="no-js" lang="en-US"> <!--<![endif]-->\n<head>\n'
    b"<title>api.example.com | 524: A timeout occurred</title>\n<meta charset=\"UTF-8\" />\n"
    b"<script>(function(){window._cf_chl_opt={};})();</script>\n</head>\n<body><div id=\"cf-wrapper\">"
    b"<h1>A timeout occurred</h1><p>Error code 524</p></div></body>\n</html>\n"
)


@pytest.mark.parametrize("status, content_type, body, code, said", [
    # FastAPI's request validation answer (transformers serve, LitServe): what each entry says of which field,
    # never the request it echoes back in 'input'
    ("422 Unprocessable Entity", "application/json",
     json.dumps({"detail": [{"type": "missing", "loc": ["body", "messages", 0, "content"], "msg": "Field required",
                             "input": {"role": "user", "name": "the caller's own prompt"}}]}).encode(),
     grpc.StatusCode.INVALID_ARGUMENT, "'body.messages.0.content: Field required'"),
    ("502 Bad Gateway", "text/html", b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
     b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.25.3</center>\r\n</body>\r\n</html>\r\n",
     grpc.StatusCode.UNAVAILABLE, "'502 Bad Gateway (an HTML page)'"),  # nginx in front of a stopped server
    ("524 Origin Time-out", "text/html; charset=UTF-8", CLOUDFLARE_524, grpc.StatusCode.UNAVAILABLE,
     "'api.example.com | 524: A timeout occurred (an HTML page)'"),  # Cloudflare in front of a slow one
    ("413 Request Entity Too Large", "text/html", b"<html><body><h1>413 Request Entity Too Large</h1>"
     b"<p>nginx</p></body></html>", grpc.StatusCode.INVALID_ARGUMENT,
     "'413 Request Entity Too Large nginx (an HTML page)'"),  # no title: the page's text
], ids=["fastapi_422", "nginx_502", "cloudflare_524", "untitled_413"])
async def test_an_error_body_is_named_by_what_it_says_not_its_markup(clean_proxy_env, status, content_type, body,
                                                                     code, said):
    """A proxy's HTML page was quoted as markup ('<!DOCTYPE html>\\n<!--[if lt IE 7]> <html class=...' named nothing
    of a Cloudflare timeout), and FastAPI's validation list as a Python repr that quoted the request back; each is
    named by its words: the page's title (else its text), the field and what is wrong with it."""
    head = (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    async with raw_upstream(head, body) as base:
        err = await stream_error(gateway_config(base, max_retries=0, fallback_model=""), ask("tiny-llama"))
    assert err.code == code and f"(upstream said {said})" in str(err), str(err)
    assert "prompt" not in str(err) and "<" not in str(err).split("upstream said", 1)[1]


@pytest.mark.parametrize("error, code", [
    ({"message": "This model's maximum context length is 4096 tokens", "type": "BadRequestError", "code": 400},
     grpc.StatusCode.INVALID_ARGUMENT),
    ({"message": "Rate limit reached", "type": "rate_limit_exceeded"}, grpc.StatusCode.RESOURCE_EXHAUSTED),
], ids=["400", "429"])
async def test_a_200_json_error_body_to_a_stream_request_is_the_error_it_carries(clean_proxy_env, error, code):
    """A server or gateway that fails a stream request before streaming may answer 200 with its JSON error body. It
    read as 'answered application/json ... ignores stream', INTERNAL whatever the error said: a prompt too long was
    a Switchyard fault, a rate limit retried as nothing. A 200 JSON answer that is no error stays that error."""
    data = json.dumps({"error": error}).encode()
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nretry-after: 7\r\n"
            b"connection: close\r\n\r\n" % len(data))
    async with raw_upstream(head, data) as base:
        err = await stream_error(gateway_config(base, fallback_model="", max_retries=0))
    assert err.code == code and error["message"] in str(err) and base in str(err), str(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the wait the response asks for is kept (it was read from {})
        assert err.retry_after_s == 7.0


@pytest.mark.parametrize("status, moved_to", [
    ("301 Moved Permanently", "https://models.example/v1"),
    ("307 Temporary Redirect", "/v2"),  # relative: resolved against the URL asked
], ids=["https", "relative"])
async def test_a_redirect_names_where_it_points_and_is_not_followed(clean_proxy_env, status, moved_to):
    """An http:// URL of a server that redirects to https://, or a path it moved: the redirect was read as the
    answer, INTERNAL "asked ... for a stream but it answered text/html", where it pointed never named (and the
    model list read "did not return OpenAI's model list"). It is the base URL's fault, NOT_FOUND, naming the root
    to set; it is not followed (the key would go to a URL the set-up did not name)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = (await read_request(reader)).split(b" ", 2)[1].decode()  # /v1/chat/completions, /v1/models
        writer.write(f"HTTP/1.1 {status}\r\nlocation: {moved_to}{path.removeprefix('/v1')}\r\ncontent-length: 0"
                     "\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    async with tcp_upstream(answer) as base:
        cfg = gateway_config(base, fallback_model="", max_retries=0)
        err = await stream_error(cfg)
        async with GatewayClient(cfg) as client:
            with pytest.raises(GatewayError) as listing:
                await client.list_models()
    root = moved_to if moved_to.startswith("https") else base.removesuffix("/v1") + moved_to
    for error in (err, listing.value):
        assert error.code == grpc.StatusCode.NOT_FOUND, str(error)
        assert f"set model_gateway.base_url to '{root}'" in str(error), str(error)


async def test_a_model_named_without_its_latest_tag_is_one_ollama_serves(clean_proxy_env):
    """Ollama lists ``llama3:latest`` and serves ``llama3`` as it. Read as unlisted, its 400 for a model that takes
    no tools (naming the model) was NOT_FOUND 'unknown model', and doctor failed the model: the server serves
    it, so the 400 is the request's (INVALID_ARGUMENT) and doctor passes it."""
    from switchyard.gateway import doctor

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        if head.startswith(b"GET "):
            status, body = "200 OK", {"object": "list", "data": [
                {"id": "llama3:latest", "object": "model", "created": 1, "owned_by": "library"}]}
        else:  # Ollama's OpenAI-compatible error (openai/openai.go NewError)
            status, body = "400 Bad Request", {"error": {
                "message": "registry.ollama.ai/library/llama3:latest does not support tools", "type": "api_error",
                "param": None, "code": None}}
        await answer_json(writer, status, body)

    async with tcp_upstream(answer) as base:
        cfg = gateway_config(base, default_model="llama3", fallback_model="", max_retries=0)
        err = await stream_error(cfg, ask("llama3"))
        checks = await doctor.run_checks(cfg, probe=False)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "does not support tools" in str(err), str(err)
    model_check = next(c for c in checks if c.name == "model llama3")
    assert model_check.ok and not model_check.warning, model_check


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_a_header_line_of_12000_bytes_is_served_on_both_transports(clean_proxy_env, transport):
    """aiohttp refuses header lines over 8,190 bytes by default; httpx (h11) takes them, so the gateway must too."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-big: " + b"a" * 12_000
            + b"\r\nconnection: close\r\n\r\n")
    async with raw_upstream(head, SSE_ANSWER) as base:
        async with GatewayClient(gateway_config(base, http_transport=transport, fallback_model="")) as client:
            events = [e async for e in client.stream_chat(ask())]
    assert [e.text for e in events if isinstance(e, Token)] == ["hi"]


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_a_bad_status_line_is_unavailable_and_retried_on_both_transports(clean_proxy_env, transport):
    """What aiohttp's parser refuses (ClientResponseError) reads as httpx's RemoteProtocolError: UNAVAILABLE,
    retried, not an INTERNAL engine failure; and named as an answer that is no HTTP/1.1, not a cut connection."""
    async with raw_upstream(b"HELLO THIS IS NOT HTTP\r\n\r\n") as base:
        err = await stream_error(gateway_config(base, http_transport=transport, fallback_model="", max_retries=1))
    assert err.code == grpc.StatusCode.UNAVAILABLE and "answered, not in HTTP/1.1" in str(err) and base in str(err)


@contextlib.asynccontextmanager
async def hanging_up_upstream(how: str):
    """A server on 127.0.0.1 that accepts each POST's connection, reads the request and ends the connection
    before any status line: ``close`` (a FIN) or ``reset`` (an RST). A GET is answered 200 with no body (a
    ``/metrics`` with no figures, so a pool's scrape keeps it up). Yields its base URL and the POSTs counted."""
    posts = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)  # its body too: closed with bytes unread, a ``close`` would send an RST
        if head.startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
        else:
            posts.append(head)
            if how == "reset":
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                          struct.pack("ii", 1, 0))
        writer.close()

    async with tcp_upstream(answer) as base:
        yield base, posts


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_a_connection_ended_before_the_headers_is_a_cut_call_not_an_unreachable_server(
        clean_proxy_env, transport, how):
    """A server that accepted the connection and closed or reset it before answering (a worker that crashed on
    the request, an idle keep-alive connection closed as it was reused) was, on aiohttp, httpx-aiohttp's
    ConnectTimeout: "upstream unavailable (ConnectTimeout: ServerDisconnectedError ...); start the model
    server", and its endpoint was marked down in a pool, as if it could not be reached. httpx says
    RemoteProtocolError / ReadError: a cut call, retried and failed over like one."""
    async with hanging_up_upstream(how) as (base, posts):
        err = await stream_error(gateway_config(base, http_transport=transport, fallback_model="", max_retries=1))
        assert len(posts) == 2, "retried"
    assert err.code == grpc.StatusCode.UNAVAILABLE and "closed mid-response" in str(err), str(err)
    assert "Timeout" not in str(err) and "start the model server" not in str(err), str(err)
    async with hanging_up_upstream(how) as (base, posts):
        with start_sim() as server:
            cfg = gateway_config(base, http_transport=transport, fallback_model="", default_model="sim-7b",
                                 pool={"endpoints": [base, server.base_url], "scrape_interval_s": 60.0})
            async with GatewayClient(cfg) as client:
                for agent in range(8):
                    events = [e async for e in client.stream_chat(ask(affinity_key=f"agent-{agent}"))]
                    assert events[-1].finish_reason == "stop"
                hanging_up = next(e for e in client.pool.endpoints.values() if e.url.startswith(base))
                assert posts and hanging_up.up, "a server that answered the connection is not marked down"


async def test_a_refusal_of_a_call_sent_without_a_key_says_the_server_wants_one(monkeypatch, clean_proxy_env):
    """With model_gateway.api_key_required false and no key set, a 403 said "check that VAR holds a valid key"."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    with start_sim(faults={"*": Fault(status=403)}) as server:
        err = await stream_error(gateway_config(server.base_url, max_retries=0))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED
    assert "sent without a key" in str(err) and f"export {KEY_ENV}=<its key>" in str(err)


async def test_a_body_cut_short_is_named_without_the_parsers_own_400(clean_proxy_env):
    """A server killed mid-stream: aiohttp's message quoted its parser's error with the parser's code 400
    ("<TransferEncodingError: 400, message=...>"), which read as an HTTP 400 no server sent."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()
        writer.close()  # no terminating chunk: the body ends before it did

    async with tcp_upstream(handle) as base:
        err = await stream_error(gateway_config(base, fallback_model="", max_retries=0))
    assert err.code == grpc.StatusCode.UNAVAILABLE and "closed mid-response" in str(err), str(err)
    assert "the response ended before its body did (TransferEncodingError: Not enough data" in str(err), str(err)
    assert "400" not in str(err).replace(base, "URL")  # the server's port may hold the digits (40003)


@contextlib.asynccontextmanager
async def chatless_server(lists_models: bool):
    """An HTTP server on 127.0.0.1 that answers every POST (chat completions) 404 ``{"detail": "Not Found"}``, as a
    server with no such route does, and ``GET /v1/models`` with model ``m`` listed (``lists_models``) or 404 too;
    yields its base URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        if head.startswith(b"GET ") and lists_models:
            status, body = "200 OK", {"object": "list", "data": [{"id": "m", "object": "model"}]}
        else:
            status, body = "404 Not Found", {"detail": "Not Found"}
        await answer_json(writer, status, body)

    async with tcp_upstream(answer) as base:
        yield base


async def test_a_404_for_chat_completions_names_what_the_server_said_and_whether_its_root_is_right(clean_proxy_env):
    """A server that lists the model at the root but has no chat completions route read 'although model 'm' is
    listed; ... must be the OpenAI-compatible root ending in /v1', a root ending in /v1 already, and the server's
    own words left out; where /models failed too it said 'is listed' all the same."""
    async with chatless_server(lists_models=True) as base:
        err = await stream_error(gateway_config(base, max_retries=0, fallback_model=""), ask("m"))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert f"upstream 404 for {base}/chat/completions (upstream said 'Not Found')" in str(err), err
    assert f"although {base}/models lists model 'm': the server there serves no chat completions for it" in str(err)
    async with chatless_server(lists_models=False) as base:
        err = await stream_error(gateway_config(base, max_retries=0, fallback_model=""), ask("m"))
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert "is listed" not in str(err) and f"{base}/models could not be read either" in str(err), err
    # its root ends in /v1 already: it was told to end it in /v1
    assert "ends in /v1 already, but the server there serves no OpenAI-compatible API under it" in str(err), err


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_a_base_url_at_a_grpc_port_is_named_as_no_http_server_not_a_cut_stream(clean_proxy_env, transport):
    """A base URL at a gRPC port (a Switchyard service's) read 'connection ... closed mid-response (RemoteProtocolError:
    illegal request line); the upstream or a proxy cut it' at every call, as switchyard doctor no longer says."""
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        err = await stream_error(gateway_config(f"http://127.0.0.1:{port}/v1", max_retries=0, fallback_model="",
                                                http_transport=transport), ask("m"))
    finally:
        await server.stop(None)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert f"upstream at http://127.0.0.1:{port}/v1/chat/completions answered, not in HTTP/1.1" in str(err), err
    assert "a gRPC port" in str(err) and "closed mid-response" not in str(err)
