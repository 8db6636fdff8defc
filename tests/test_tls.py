"""TLS and mTLS on the hops between Switchyard's services, with certificates made by trustme."""

from __future__ import annotations

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import ConfigError, ServerConfig, TlsConfig
from switchyard.common.server import running
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
