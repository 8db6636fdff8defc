"""Bearer-token authentication at the orchestrator edge, on a real gRPC server."""

from __future__ import annotations

import logging

import grpc
import pytest

from switchyard.api import agent_pb2
from switchyard.common.auth import AUTH_FAILURES, AuthConfigError, BearerAuthInterceptor
from switchyard.common.config import AuthConfig
from test_orchestrator import stack

TOKEN, READER = "tok-3f9a1c0e7b", "tok-readonly-55e1"


@pytest.fixture
def tokens(tmp_path, monkeypatch):
    path = tmp_path / "tokens"
    path.write_text(f"# tokens\n{TOKEN}\n{READER} agent.AgentService/GetTaskStatus\n")
    monkeypatch.setenv("SWITCHYARD_TEST_TOKENS", "tok-from-env-1,tok-from-env-2")
    return {"orchestrator.auth": {"enabled": True, "tokens_file": str(path),
                                          "tokens_env": "SWITCHYARD_TEST_TOKENS"}}


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


async def run(stub, metadata=None):
    return [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"), metadata=metadata)]


def failures(reason: str) -> float:
    return AUTH_FAILURES.labels(reason)._value.get()


async def test_a_known_token_runs_tasks_and_one_from_the_environment_too(tokens):
    async with stack(**tokens) as (stub, _):
        assert (await run(stub, bearer(TOKEN)))[-1].HasField("final")
        assert (await run(stub, bearer("tok-from-env-2")))[-1].HasField("final")


@pytest.mark.parametrize(("metadata", "code", "reason", "says"), [
    (None, grpc.StatusCode.UNAUTHENTICATED, "missing", "missing 'authorization' metadata"),
    ((("authorization", f"Basic {TOKEN}"),), grpc.StatusCode.UNAUTHENTICATED, "malformed", "Bearer <token>"),
    ((("authorization", "Bearer "),), grpc.StatusCode.UNAUTHENTICATED, "malformed", "Bearer <token>"),
    (bearer("tok-3f9a1c0e7c"), grpc.StatusCode.UNAUTHENTICATED, "unknown_token", "not valid"),
    (bearer(READER), grpc.StatusCode.PERMISSION_DENIED, "forbidden", "may not call agent.AgentService/RunTask"),
])
async def test_refusals_name_the_problem_never_the_token(tokens, caplog, metadata, code, reason, says):
    before = failures(reason)
    with caplog.at_level(logging.DEBUG):
        async with stack(**tokens) as (stub, down):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await run(stub, metadata)
    assert caught.value.code() == code and says in caught.value.details()
    assert failures(reason) == before + 1
    assert down.requests == []  # refused before any work
    presented = dict(metadata or ()).get("authorization", "")
    for secret in {TOKEN, READER, "tok-3f9a1c0e7c"} & set(presented.split()):
        assert secret not in caught.value.details() and secret not in caplog.text


async def test_a_restricted_token_calls_its_methods(tokens):
    async with stack(**tokens) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="nope"), metadata=bearer(READER))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # past auth, to the servicer


def test_no_token_configured_is_a_clear_start_up_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SWITCHYARD_AUTH_TOKENS", raising=False)
    with pytest.raises(AuthConfigError, match="no token is configured"):
        BearerAuthInterceptor(AuthConfig(enabled=True))
    bad = tmp_path / "tokens"
    bad.write_text("tok-1 RunTask\n")
    with pytest.raises(AuthConfigError, match=r"line 1: expected '<token> \[tenant=<id>\] \[service/method ...\]'") as caught:
        BearerAuthInterceptor(AuthConfig(enabled=True, tokens_file=str(bad)))
    assert "tok-1" not in str(caught.value)
    with pytest.raises(AuthConfigError, match="auth.tokens_file .*missing"):
        BearerAuthInterceptor(AuthConfig(enabled=True, tokens_file=str(tmp_path / "missing")))


def test_tokens_that_are_not_utf8_are_refused_naming_their_source_never_their_bytes(tmp_path, monkeypatch):
    """The orchestrator's start failed with "'utf-8' codec can't decode byte 0xff in position 11", naming neither
    the file nor the line; a variable's byte failed it with a UnicodeEncodeError when the token was encoded."""
    monkeypatch.delenv("SWITCHYARD_AUTH_TOKENS", raising=False)
    path = tmp_path / "tokens"
    path.write_bytes(b"tok-good-1\ntok-s\xffcret-2\n")
    with pytest.raises(AuthConfigError) as caught:
        BearerAuthInterceptor(AuthConfig(enabled=True, tokens_file=str(path)))
    assert str(caught.value) == f"auth.tokens_file {path} line 2: expected UTF-8 text (a byte there is not UTF-8)"
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS", "tok-s\udcffcret-2")  # a byte of the environment that is not UTF-8
    with pytest.raises(AuthConfigError) as caught:
        BearerAuthInterceptor(AuthConfig(enabled=True, tokens_env="SWITCHYARD_AUTH_TOKENS"))
    assert str(caught.value) == "the variable SWITCHYARD_AUTH_TOKENS: expected UTF-8 text (a byte of it is not UTF-8)"


async def test_health_checks_need_no_token(tokens):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from switchyard.common.channels import open_channel
    from switchyard.common.config import load_config
    from switchyard.common.server import running
    from switchyard.orchestrator.service import OrchestratorService

    cfg = load_config("config").with_overrides(**tokens, **{
        "orchestrator.cpu_executor": "loop",
        # nothing listens on port 1: the named service answers NOT_SERVING (readiness), but it answers
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.dispatcher_addr": "127.0.0.1:1",
    })
    async with running([OrchestratorService(cfg)], cfg.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            alive = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            ready = await stub.Check(health_pb2.HealthCheckRequest(service="agent.AgentService"))
    assert alive.status == health_pb2.HealthCheckResponse.SERVING
    assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING


# ---------------------------------------------------------------------------- every kind of call


async def _echo_server(tokens_file: str):
    """A real grpc.aio server behind the interceptor: reflection (bidirectional) and one method of each kind."""
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server(interceptors=[BearerAuthInterceptor(AuthConfig(enabled=True, tokens_file=tokens_file))])

    async def unary(request: bytes, context) -> bytes:
        return request

    async def server_stream(request: bytes, context):
        yield request

    async def client_stream(requests, context) -> bytes:
        return b"".join([r async for r in requests])

    async def bidi(requests, context):
        async for r in requests:
            yield r

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    })])
    reflection.enable_server_reflection(["test.Echo", reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _silent(channel: grpc.aio.Channel, kind: str, method: str, metadata=None):
    """Start a call of ``kind`` that never sends a message (streaming requests) and return its status."""
    if kind == "unary":
        call = channel.unary_unary(method)(b"x", metadata=metadata, timeout=30)
    elif kind == "server_stream":
        call = channel.unary_stream(method)(b"x", metadata=metadata, timeout=30)
    elif kind == "client_stream":
        call = channel.stream_unary(method)(metadata=metadata, timeout=30)
    else:
        call = channel.stream_stream(method)(metadata=metadata, timeout=30)
    return await call.code(), await call.details()


@pytest.mark.parametrize(("kind", "method"), [
    ("unary", "/test.Echo/Unary"),
    ("server_stream", "/test.Echo/ServerStream"),
    ("client_stream", "/test.Echo/ClientStream"),
    ("bidi", "/test.Echo/Bidi"),
    ("bidi", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
], ids=["unary", "server-stream", "client-stream", "bidi", "reflection"])
async def test_a_refused_call_of_any_kind_is_answered_at_once_without_a_message_from_the_caller(
        tmp_path, kind, method):
    """A silent client of a streaming-request method is refused, not left waiting until its deadline (30 s):
    before, the refusal was a unary handler, which grpc runs only after the first request message."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN} test.Echo/Unary\n")
    server, port = await _echo_server(str(path))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            code, details = await _silent(channel, kind, method)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing 'authorization'" in details
            code, details = await _silent(channel, kind, method, bearer(TOKEN))
            if method != "/test.Echo/Unary":
                assert code == grpc.StatusCode.PERMISSION_DENIED and "may not call" in details
            else:
                assert code == grpc.StatusCode.OK
    finally:
        await server.stop(0)


def test_exempt_methods_and_tokens_env_are_named_as_their_siblings_are(monkeypatch):
    """'/grpc.health.v1.Health/Check', gRPC's own spelling, loaded and exempted nothing (every probe refused
    UNAUTHENTICATED); 'service/*', which a token's methods take, exempted nothing either; a tokens_env that names
    no variable loaded (model_gateway.api_key_env's check refuses it)."""
    from pydantic import ValidationError

    from switchyard.common.auth import BearerTokens

    with pytest.raises(ValidationError, match=r"methods as service/method .* got \['/grpc.health.v1.Health/Check'\]"):
        AuthConfig(enabled=True, exempt_methods=["/grpc.health.v1.Health/Check"])
    with pytest.raises(ValidationError, match="an environment variable name such as SWITCHYARD_AUTH_TOKENS"):
        AuthConfig(enabled=True, tokens_env="$SWITCHYARD_AUTH_TOKENS")  # beside a tokens_file: its tokens left out
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS", "tok-1")
    known = BearerTokens(AuthConfig(enabled=True, exempt_methods=["grpc.health.v1.Health/*"]))
    assert known.check("/grpc.health.v1.Health/Watch", None) is None
    assert known.check("/agent.AgentService/RunTask", None) is not None


def test_a_tokens_file_saved_with_a_byte_order_mark_knows_its_first_token(tmp_path):
    """An editor's UTF-8 BOM before the first token made it '\\ufefftok-...': that token was refused 'not valid'."""
    from switchyard.common.auth import BearerTokens

    path = tmp_path / "tokens"
    path.write_bytes(b"\xef\xbb\xbf" + f"{TOKEN}\n{READER} agent.AgentService/GetTaskStatus\n".encode())
    known = BearerTokens(AuthConfig(enabled=True, tokens_file=str(path), tokens_env=""))
    assert known.check("/agent.AgentService/RunTask", f"Bearer {TOKEN}") is None
    assert known.check("/agent.AgentService/GetTaskStatus", f"Bearer {READER}") is None


@pytest.mark.parametrize("token, says", [
    ("tök", "ASCII characters"),  # grpc refused it as INTERNAL "Invalid metadata"
    ("t\udcf6k", "byte 0xF6 is not UTF-8"),  # a non-UTF-8 byte: a traceback before
    ("two words", "no spaces"),
])
def test_switchyard_run_refuses_a_token_no_call_can_carry_naming_the_variable(monkeypatch, capsys, token, says):
    from switchyard.client import main as run_main

    monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", token)
    code = run_main(["--addr", "127.0.0.1:1", "hello"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--token-env: variable SWITCHYARD_AUTH_TOKEN" in err and says in err and token not in err


def test_switchyard_run_names_a_token_file_that_is_not_utf8_never_its_bytes(tmp_path, capsys):
    """It said 'cannot read it (UnicodeDecodeError)', as if the file were missing or unreadable."""
    from switchyard.client import main as run_main

    (tmp_path / "token").write_bytes(b"t\xf6k\n")
    assert run_main(["--addr", "127.0.0.1:1", "--token-file", str(tmp_path / "token"), "hello"]) == 2
    assert f"--token-file {tmp_path / 'token'}: expected UTF-8 text (a byte of it is not UTF-8)" \
        in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_switchyard_run_refuses_a_timeout_that_is_not_a_finite_positive_number(capsys, value):
    from switchyard.client import main as run_main

    with pytest.raises(SystemExit) as exited:
        run_main(["--addr", "127.0.0.1:1", "--timeout", value, "hello"])
    assert exited.value.code == 2
    assert f"--timeout: expected seconds > 0, at most 1e+09 (gRPC's deadline overflows past it), got {float(value):g}" \
        in capsys.readouterr().err
