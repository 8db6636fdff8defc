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
    with pytest.raises(AuthConfigError, match=r"line 1: expected '<token> \[service/method ...\]'") as caught:
        BearerAuthInterceptor(AuthConfig(enabled=True, tokens_file=str(bad)))
    assert "tok-1" not in str(caught.value)
    with pytest.raises(AuthConfigError, match="auth.tokens_file .*missing"):
        BearerAuthInterceptor(AuthConfig(enabled=True, tokens_file=str(tmp_path / "missing")))


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
