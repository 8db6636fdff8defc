"""TLS and mTLS on the hops between Switchyard's services, with certificates made by trustme."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import ConfigError, ServerConfig, SwitchyardConfig, TlsConfig
from switchyard.common.server import running
from switchyard.launcher import free_port, healthy
from test_orchestrator import Downstream


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a certificate for 127.0.0.1/localhost (servers and, under mTLS, clients), and a stranger CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.private_key_pem.write_to_path(folder / "key.pem")
    leaf.cert_chain_pems[0].write_to_path(folder / "cert.pem")
    ca.cert_pem.write_to_path(folder / "ca.pem")
    stranger.cert_pem.write_to_path(folder / "stranger.pem")
    return folder


def tls(pki, **values) -> ServerConfig:
    files = {"cert_file": str(pki / "cert.pem"), "key_file": str(pki / "key.pem"), "ca_file": str(pki / "ca.pem")}
    return ServerConfig(tls=TlsConfig(enabled=True, **{**files, **values}))


async def check(address: str, config: ServerConfig | None) -> int:
    async with open_channel(address, config) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
async def test_services_talk_over_tls(pki, mtls):
    config = tls(pki, require_client_auth=mtls)
    async with running([Downstream()], config) as srv:
        address = f"127.0.0.1:{srv.port}"
        assert await check(address, config) == health_pb2.HealthCheckResponse.SERVING
        async with open_channel(address, config) as channel:
            reply = await agent_pb2_grpc.RetrievalServiceStub(channel).Retrieve(agent_pb2.RetrieveRequest(query="q"))
        assert reply.passages
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await check(address, None)  # plain text against a TLS server
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_server_signed_by_another_ca_is_refused(pki):
    async with running([Downstream()], tls(pki)) as srv:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(f"127.0.0.1:{srv.port}", tls(pki, ca_file=str(pki / "stranger.pem")))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_refuses_a_client_without_a_certificate(pki):
    async with running([Downstream()], tls(pki, require_client_auth=True)) as srv:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await check(f"127.0.0.1:{srv.port}", tls(pki))  # TLS, but no client certificate
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_config_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="tls.enabled needs ca_file"):
        TlsConfig(enabled=True)
    with pytest.raises(ValueError, match="give cert_file and key_file together"):
        TlsConfig(enabled=True, ca_file="ca.pem", cert_file="c.pem")
    with pytest.raises(ValueError, match="require_client_auth needs cert_file and key_file"):
        TlsConfig(enabled=True, ca_file="ca.pem", require_client_auth=True)
    config = TlsConfig(enabled=True, cert_file=str(tmp_path / "nope.pem"), key_file="k", ca_file="c")
    with pytest.raises(ConfigError, match=r"tls.cert_file .*nope.pem"):
        config.read()


async def test_a_server_without_its_certificate_says_so(pki):
    config = ServerConfig(tls=TlsConfig(enabled=True, ca_file=str(pki / "ca.pem")))
    with pytest.raises(ConfigError, match="a server needs cert_file and key_file"):
        async with running([Downstream()], config):
            pass


# --------------------------------------------------------------------------- the plain-text health-only port
# kubelet's grpc probes speak plain text only: with TLS on, the probes ask a second port that serves
# grpc.health.v1 and nothing else.


async def plain_call(address: str, method: str, request: bytes = b"") -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            await channel.unary_unary(method)(request, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
async def test_the_health_port_answers_probes_in_plain_text_while_the_service_port_needs_tls(pki, mtls):
    config = tls(pki, require_client_auth=mtls)
    async with running([Downstream()], config, health_port=0) as srv:
        assert srv.health_port not in (None, 0, srv.port)
        probe = f"127.0.0.1:{srv.health_port}"
        assert await check(probe, None) == health_pb2.HealthCheckResponse.SERVING  # liveness: ""
        async with grpc.aio.insecure_channel(probe, options=[("grpc.enable_http_proxy", 0)]) as channel:
            named = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="agent.RetrievalService"), timeout=10)  # readiness
        assert named.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await check(f"127.0.0.1:{srv.port}", None)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await check(f"127.0.0.1:{srv.port}", config) == health_pb2.HealthCheckResponse.SERVING


async def test_the_health_port_serves_nothing_but_health(pki):
    async with running([Downstream()], tls(pki), health_port=0) as srv:
        probe = f"127.0.0.1:{srv.health_port}"
        retrieve = agent_pb2.RetrieveRequest(query="q").SerializeToString()
        assert await plain_call(probe, "/agent.RetrievalService/Retrieve", retrieve) == grpc.StatusCode.UNIMPLEMENTED
        assert await plain_call(probe, "/agent.InferenceService/Generate") == grpc.StatusCode.UNIMPLEMENTED
        reflection = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        async with grpc.aio.insecure_channel(probe, options=[("grpc.enable_http_proxy", 0)]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [reply async for reply in channel.stream_stream(reflection)(iter([b""]), timeout=10)]
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # ...while the service port, over TLS, has them
        async with open_channel(f"127.0.0.1:{srv.port}", tls(pki)) as channel:
            reply = await agent_pb2_grpc.RetrievalServiceStub(channel).Retrieve(agent_pb2.RetrieveRequest(query="q"))
        assert reply.passages


async def test_the_health_port_follows_the_service_statuses(pki):
    async with running([Downstream()], tls(pki), health_port=0) as srv:
        probe = f"127.0.0.1:{srv.health_port}"
        await srv.health.set("agent.RetrievalService", health_pb2.HealthCheckResponse.NOT_SERVING)
        async with grpc.aio.insecure_channel(probe, options=[("grpc.enable_http_proxy", 0)]) as channel:
            named = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="agent.RetrievalService"), timeout=10)
            assert named.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await srv.health.enter_graceful_shutdown()  # what stop() does first: probes see the drain
            assert await check(probe, None) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_the_health_port_is_off_by_default(pki):
    async with running([Downstream()], tls(pki)) as srv:
        assert srv.health_port is None and srv.health_server is None
    service = SwitchyardConfig()
    assert [getattr(service, name).health_port for name in ("orchestrator", "retrieval", "dispatcher")] == [None] * 3


async def test_a_health_port_in_use_is_a_named_error(pki):
    async with running([Downstream()], tls(pki), health_port=0) as first:
        with pytest.raises(RuntimeError, match=rf"could not bind the health port 127.0.0.1:{first.health_port}"):
            async with running([Downstream()], tls(pki), health_port=first.health_port):
                pass


def test_health_port_config_names_the_field():
    with pytest.raises(ConfigError, match=r"dispatcher.health_port.*less than or equal to 65535"):
        SwitchyardConfig().with_overrides(**{"dispatcher.health_port": 70_000})


@pytest.mark.slow
async def test_a_served_dispatcher_answers_probes_on_its_health_port(pki, tmp_path):
    """`switchyard serve` (what a pod runs) with TLS, mTLS and a health port in its config files."""
    config_dir = tmp_path / "config"
    shutil.copytree(Path(__file__).resolve().parents[1] / "config", config_dir)
    port, metrics_port, health_port = (free_port("127.0.0.1") for _ in range(3))
    data = json.loads((config_dir / "switchyard.json").read_text(encoding="utf-8"))
    data["server"]["tls"] = {"enabled": True, "cert_file": str(pki / "cert.pem"), "key_file": str(pki / "key.pem"),
                             "ca_file": str(pki / "ca.pem"), "require_client_auth": True}
    data["dispatcher"]["health_port"] = health_port
    (config_dir / "switchyard.json").write_text(json.dumps(data), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard.cli", "serve", "dispatcher", "--config-dir", str(config_dir),
         "--port", str(port), "--metrics-port", str(metrics_port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        probe = f"127.0.0.1:{health_port}"
        for _ in range(1200):  # start-up (a hang guard of 120 s): kubelet's readiness probe, in plain text
            if await asyncio.to_thread(healthy, probe, "agent.InferenceService"):
                break
            assert proc.poll() is None, "the dispatcher exited during start-up"
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the dispatcher's health port never answered SERVING")
        assert await check(probe, None) == health_pb2.HealthCheckResponse.SERVING  # liveness
        generate = agent_pb2.GenerateRequest(prompt="hi", max_tokens=1).SerializeToString()
        assert await plain_call(probe, "/agent.InferenceService/Generate", generate) == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError):
            await check(f"127.0.0.1:{port}", None)
        assert await check(f"127.0.0.1:{port}", tls(pki, require_client_auth=True)) == (
            health_pb2.HealthCheckResponse.SERVING)
    finally:
        proc.terminate()
        proc.wait(60)
