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


@pytest.mark.parametrize("variable", ["SWITCHYARD_TLS_DIR", "SWITCHYARD_AUTH_TOKENS_FILE"])
def test_a_file_a_variable_named_that_cannot_be_read_names_the_variable(tmp_path, monkeypatch, variable):
    """SWITCHYARD_TLS_DIR (or SWITCHYARD_AUTH_TOKENS_FILE) naming a Secret that was not mounted stopped the service
    with "tls.cert_file /x/tls.crt: No such file or directory" (or "auth.tokens_file /x: ..."): a key the operator
    never wrote in a file, and no word of the variable that set it, as a value refused at load names it."""
    from switchyard.common.auth import AuthConfigError, load_tokens
    from switchyard.common.config import load_config

    missing = tmp_path / "not-mounted"
    monkeypatch.setenv(variable, str(missing))
    config = load_config("config", service="orchestrator")
    if variable == "SWITCHYARD_TLS_DIR":
        with pytest.raises(ConfigError) as refused:
            config.server.tls.read()
        assert str(refused.value) == (
            f"tls.cert_file {missing}/tls.crt (set by environment variable SWITCHYARD_TLS_DIR={str(missing)!r}): "
            "No such file or directory; expected a PEM file this user can read")
    else:
        with pytest.raises(AuthConfigError) as refused:
            load_tokens(config.orchestrator.auth)
        assert str(refused.value) == (
            f"auth.tokens_file {missing} (set by environment variable SWITCHYARD_AUTH_TOKENS_FILE={str(missing)!r}): "
            "No such file or directory; expected a file this user can read, a token a line")
    monkeypatch.delenv(variable)  # set in the file, not by a variable: nothing said of one
    with pytest.raises(ConfigError, match=r"^tls.cert_file [^(]*nope.pem: No such file"):
        TlsConfig(enabled=True, cert_file=str(tmp_path / "nope.pem"), key_file="k", ca_file="c").read()


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


# --------------------------------------------------------------------------- TLS failures say what they were


@pytest.fixture(scope="module")
def named_pki(pki):
    """Besides ``pki``: a certificate of the same CA for localhost only (dialling 127.0.0.1 does not match)."""
    ca = trustme.CA(organization_name="Switchyard test CA")
    leaf = ca.issue_cert("localhost")
    folder = pki / "named"
    folder.mkdir(exist_ok=True)
    leaf.private_key_pem.write_to_path(folder / "key.pem")
    leaf.cert_chain_pems[0].write_to_path(folder / "cert.pem")
    ca.cert_pem.write_to_path(folder / "ca.pem")
    return folder


async def test_a_hostname_mismatch_names_the_dialled_name_the_certificates_names_and_issuer(named_pki):
    from switchyard.orchestrator.clients import RetrievalClient
    from switchyard.common.errors import ServiceUnavailable

    config = tls(named_pki)
    async with running([Downstream()], config) as srv:
        client = RetrievalClient(f"127.0.0.1:{srv.port}", config, timeout_s=10, max_query_chars=10_000)
        try:
            with pytest.raises(ServiceUnavailable) as caught:
                await client.retrieve("q")
        finally:
            await client.close()
        message = str(caught.value)
        assert "dialled name '127.0.0.1'" in message
        assert "the certificate's names (SANs): DNS:localhost" in message
        assert "issuer" in message and "Switchyard test CA" in message
        assert "'127.0.0.1' is not among the certificate's names" in message and "server.tls.server_name" in message
        # the same server dialled by a name it holds serves
        named = tls(named_pki, server_name="localhost")
        assert await check(f"127.0.0.1:{srv.port}", named) == health_pb2.HealthCheckResponse.SERVING


async def test_a_certificate_from_another_ca_names_its_issuer_and_the_ca_file(pki):
    from switchyard.common import tls_check

    async with running([Downstream()], tls(pki)) as srv:
        result = await tls_check.check_certificate(f"127.0.0.1:{srv.port}", tls(pki, ca_file=str(pki / "stranger.pem")).tls)
    assert not result.ok and not result.unreachable
    assert "does not verify against server.tls.ca_file" in result.problem and "stranger.pem" in result.problem
    assert result.names == ["DNS:localhost", "IP:127.0.0.1"] or set(result.names) == {"DNS:localhost", "IP:127.0.0.1"}
    assert result.issuer


def test_the_certificate_file_is_checked_offline_against_the_dialled_names(pki, named_pki):
    from switchyard.common import tls_check

    assert tls_check.check_certificate_file(tls(pki).tls, "127.0.0.1").ok
    assert tls_check.check_certificate_file(tls(pki).tls, "localhost").ok
    wrong_name = tls_check.check_certificate_file(tls(named_pki).tls, "10.0.0.7")
    assert "'10.0.0.7' is not among the certificate's names" in wrong_name.problem
    wrong_ca = tls_check.check_certificate_file(tls(pki, ca_file=str(pki / "stranger.pem")).tls, "localhost")
    assert "did not sign it" in wrong_ca.problem
    assert tls_check.name_matches("api.example.com", ["DNS:*.example.com"])
    assert not tls_check.name_matches("a.b.example.com", ["DNS:*.example.com"])
    assert not tls_check.name_matches("127.0.0.1", ["DNS:127.0.0.1"])  # an IP matches IP names only


async def test_a_tls_server_logs_its_certificate_and_the_server_name_channels_check(pki, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="switchyard.common.server"):
        async with running([Downstream()], tls(pki, server_name="localhost")):
            pass
    line = next(r.getMessage() for r in caplog.records if "server.tls on" in r.getMessage())
    assert "server_name 'localhost' (server.tls.server_name)" in line
    assert "DNS:localhost" in line and "IP:127.0.0.1" in line and "issuer" in line


async def test_doctor_checks_the_certificates_of_the_addresses_it_will_dial(pki, named_pki):
    from switchyard.gateway import doctor

    async with running([Downstream()], tls(named_pki)) as srv:
        config = SwitchyardConfig().with_overrides(**{
            "server.tls": tls(named_pki).tls.model_dump(),
            "orchestrator.retrieval_addr": f"localhost:{srv.port}",  # a name the certificate holds
            "orchestrator.dispatcher_addr": f"127.0.0.1:{srv.port}",  # not one of its names
            "orchestrator.port": free_port("127.0.0.1"),  # nothing answers there yet
            "server.host": "localhost",
        })
        checks = {c.name: c for c in await doctor.certificate_checks(config, timeout_s=3)}
    assert checks["tls retrieval"].ok and "the certificate fits" in checks["tls retrieval"].detail
    assert not checks["tls dispatcher"].ok
    assert "dialled name '127.0.0.1'" in checks["tls dispatcher"].detail
    assert "DNS:localhost" in checks["tls dispatcher"].detail and "server_name" in checks["tls dispatcher"].fix
    assert checks["tls orchestrator"].ok and "nothing answers" in checks["tls orchestrator"].detail
    assert await doctor.certificate_checks(SwitchyardConfig()) == []  # TLS off: nothing to check


# --------------------------------------------------------------------------- clients from outside the repository


async def test_switchyard_run_outside_the_repository_reaches_a_tls_stack_by_switchyard_tls_dir(
        pki, tmp_path, monkeypatch, capsys):
    """`switchyard run --addr` where no config/ is took the bare built-in defaults: SWITCHYARD_TLS_DIR (the
    documented way to give TLS from a mounted Secret) was not read, it dialled plain text and read grpc's "Socket
    closed", and it said "nothing answers at ...: is the stack running?" of a running TLS orchestrator. It reads
    the environment's TLS now, and one that sends plain text to a TLS server is told so."""
    from switchyard import client
    from switchyard.common.config import load_config
    from switchyard.orchestrator.service import OrchestratorService

    secret = tmp_path / "tls"  # the layout of a kubernetes.io/tls Secret plus its CA
    secret.mkdir()
    for source, name in (("cert.pem", "tls.crt"), ("key.pem", "tls.key"), ("ca.pem", "ca.crt")):
        shutil.copy(pki / source, secret / name)
    served = tls(pki)
    async with running([Downstream()], served) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        cfg = load_config("config", service="orchestrator").with_overrides(**{
            "orchestrator.retrieval_addr": addr, "orchestrator.dispatcher_addr": addr,
            "orchestrator.cpu_executor": "loop", "server.tls.enabled": True,
            "server.tls.cert_file": served.tls.cert_file, "server.tls.key_file": served.tls.key_file,
            "server.tls.ca_file": served.tls.ca_file})
        async with running([OrchestratorService(cfg)], cfg.server) as orchestrator:
            outside = tmp_path / "elsewhere"
            outside.mkdir()
            monkeypatch.chdir(outside)
            monkeypatch.delenv("SWITCHYARD_CONFIG_DIR", raising=False)
            monkeypatch.delenv("SWITCHYARD_TLS_DIR", raising=False)
            argv = ["--addr", f"127.0.0.1:{orchestrator.port}", "--task-type", "chat", "--timeout", "20", "hello"]
            assert await asyncio.to_thread(client.main, argv) == 1  # plain text to a TLS server
            err = capsys.readouterr().err
            assert (f"127.0.0.1:{orchestrator.port} serves TLS and this client sent plain text: set "
                    "SWITCHYARD_TLS_DIR") in err, err
            assert "nothing answers" not in err, err
            monkeypatch.setenv("SWITCHYARD_TLS_DIR", str(secret))
            assert await asyncio.to_thread(client.main, argv) == 0
            out = capsys.readouterr()
            assert "over TLS from the environment (SWITCHYARD_TLS_DIR)" in out.err, out.err
            assert "error" not in out.err, out.err


async def test_speaks_tls_tells_a_tls_server_from_a_plain_one_and_from_nothing(pki):
    from switchyard.common.tls_check import speaks_tls

    async with running([Downstream()], tls(pki)) as secure, running([Downstream()], ServerConfig()) as plain:
        assert await speaks_tls(f"127.0.0.1:{secure.port}")
        assert not await speaks_tls(f"127.0.0.1:{plain.port}")
    assert not await speaks_tls(f"127.0.0.1:{free_port('127.0.0.1')}")  # nothing listens


@pytest.mark.parametrize("window", ["expired", "not yet valid"])
async def test_a_server_whose_certificate_is_not_valid_now_refuses_to_start_naming_it(tmp_path, window):
    """A server presenting an expired certificate started, logged it as served, and every peer's handshake failed
    ("certificate has expired", thousands of grpc lines) while `switchyard up` waited out --ready-timeout (180 s)
    and then suggested raising it. It refuses to start now, naming the file, its validity and the time."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    ca = trustme.CA()
    if window == "expired":
        leaf = ca.issue_cert("127.0.0.1", not_before=now - datetime.timedelta(days=10),
                             not_after=now - datetime.timedelta(days=1))
    else:
        leaf = ca.issue_cert("127.0.0.1", not_before=now + datetime.timedelta(days=1),
                             not_after=now + datetime.timedelta(days=10))
    leaf.private_key_pem.write_to_path(tmp_path / "key.pem")
    leaf.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    config = ServerConfig(tls=TlsConfig(enabled=True, cert_file=str(tmp_path / "cert.pem"),
                                        key_file=str(tmp_path / "key.pem"), ca_file=str(tmp_path / "ca.pem")))
    with pytest.raises(ConfigError) as refused:
        async with running([Downstream()], config):
            pass
    message = str(refused.value)
    what = "it expired" if window == "expired" else "it is not valid yet"
    assert message.startswith(f"server.tls.cert_file {tmp_path / 'cert.pem'}: {what}: valid "), message
    assert ", now " in message and "install a certificate valid now" in message, message


def _write_pki(folder: Path, ca_days: tuple[int, int], intermediate_days: tuple[int, int] | None,
               renewed_ca: str = "") -> ServerConfig:
    """A CA valid from ca_days[0] to ca_days[1] days from now, an intermediate (where given) valid likewise, a leaf
    for 127.0.0.1 valid now signed by the last; cert.pem holds the leaf and the intermediate, ca.pem the CA, and a
    renewed CA of the same name and key, valid now, ``renewed_ca`` ("before" or "after") it."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def authority(subject: str, key, issuer: str, signer, days: tuple[int, int]) -> x509.Certificate:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now + datetime.timedelta(days=days[0]))
                .not_valid_after(now + datetime.timedelta(days=days[1]))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(signer, hashes.SHA256()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = authority("test ca", ca_key, "test ca", ca_key, ca_days)
    renewed = [authority("test ca", ca_key, "test ca", ca_key, (-1, 30))] if renewed_ca else []
    authorities = renewed + [ca] if renewed_ca == "before" else [ca] + renewed
    signer_key, signer_name, chain = ca_key, "test ca", []
    if intermediate_days is not None:
        key = ec.generate_private_key(ec.SECP256R1())
        chain.append(authority("test intermediate", key, "test ca", ca_key, intermediate_days))
        signer_key, signer_name = key, "test intermediate"
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(name("svc")).issuer_name(name(signer_name))
            .public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(signer_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (folder / "cert.pem").write_bytes(b"".join(c.public_bytes(pem) for c in [leaf, *chain]))
    (folder / "ca.pem").write_bytes(b"".join(c.public_bytes(pem) for c in authorities))
    (folder / "key.pem").write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    return ServerConfig(tls=TlsConfig(enabled=True, cert_file=str(folder / "cert.pem"),
                                      key_file=str(folder / "key.pem"), ca_file=str(folder / "ca.pem")))


@pytest.mark.parametrize("case", ["expired ca", "ca not yet valid", "expired intermediate"])
async def test_a_server_whose_ca_or_intermediate_is_not_valid_now_refuses_to_start_naming_it(tmp_path, case):
    """The leaf was the only certificate checked at start: with the CA of server.tls.ca_file expired (or an
    intermediate of cert_file) every service started, every handshake failed "certificate has expired", and
    `switchyard up` said the certificate, valid itself, did not verify against ca_file. The service refuses to
    start naming the file, the certificate's subject, its validity and the time."""
    config = _write_pki(tmp_path, {"expired ca": (-30, -1), "ca not yet valid": (1, 30)}.get(case, (-30, 30)),
                        (-30, -1) if case == "expired intermediate" else None)
    with pytest.raises(ConfigError) as refused:
        async with running([Downstream()], config):
            pass
    message = str(refused.value)
    what = "it is not valid yet" if case == "ca not yet valid" else "it expired"
    if case == "expired intermediate":
        assert message.startswith(f"server.tls.cert_file {tmp_path / 'cert.pem'}: its certificate 2 (an "
                                  f"intermediate, subject CN=test intermediate): {what}: valid "), message
    else:
        assert message.startswith(f"server.tls.ca_file {tmp_path / 'ca.pem'}: the authority that signed "
                                  f"server.tls.cert_file {tmp_path / 'cert.pem'} (subject CN=test ca, the first in the "
                                  f"file that did): {what}: "
                                  "valid "), message
    assert ", now " in message and "install a certificate valid now" in message, message


def test_the_offline_check_follows_intermediates_and_names_an_expired_ca(tmp_path):
    """doctor's offline check of server.tls.cert_file asked whether ca_file signed the leaf itself: a chain with an
    intermediate, which serves, read 'did not sign it'; and with the CA expired, which every service refuses, it
    read OK. It follows the chain to the authority and judges what a service judges at start."""
    from switchyard.common import tls_check

    for folder, ca_days, intermediate_days in (("good", (-30, 30), (-30, 30)), ("old", (-30, -1), (-30, 30))):
        (tmp_path / folder).mkdir()
        config = _write_pki(tmp_path / folder, ca_days, intermediate_days)
        check = tls_check.check_certificate_file(config.tls, "127.0.0.1")
        if folder == "good":
            assert check.ok and check.subject == "CN=svc", check.problem
        else:
            assert check.problem.startswith("server.tls.ca_file: the authority that signed server.tls.cert_file "
                                             "(subject CN=test ca, the first in the file that did): it expired"), (
                check.problem)


async def test_a_ca_bundle_holding_an_expired_ca_serves_with_its_renewal_first_and_refuses_it_after():
    """A CA renewed with its key kept: the bundle holds the old (expired) and the new certificate, both signers of
    the chain. grpc's handshake verifies against the first in the file: the renewal first, the service starts and
    answers; the expired one first, every handshake failed "certificate has expired", so the service refuses to
    start naming it."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        config = _write_pki(Path(folder), (-30, -1), None, renewed_ca="before")
        async with running([Downstream()], config) as srv:
            assert await check(f"127.0.0.1:{srv.port}", config) == health_pb2.HealthCheckResponse.SERVING
        config = _write_pki(Path(folder), (-30, -1), None, renewed_ca="after")
        with pytest.raises(ConfigError, match=r"server\.tls\.ca_file .*\(subject CN=test ca, the first in the file "
                                              r"that did\): it expired"):
            async with running([Downstream()], config):
                pass


def test_switchyard_up_names_a_tls_failure_of_its_health_checks_at_once(named_pki, tmp_path):
    """A certificate without the address the launcher dials (127.0.0.1): `switchyard up` waited --ready-timeout
    (180 s) on health checks that could never pass, then said to raise it; it stops at the first TLS failure,
    naming the dialled name and the certificate's names."""
    secret = tmp_path / "tls"
    secret.mkdir()
    for source, name in (("cert.pem", "tls.crt"), ("key.pem", "tls.key"), ("ca.pem", "ca.crt")):
        shutil.copy(named_pki / source, secret / name)
    config_dir = tmp_path / "config"
    shutil.copytree(Path(__file__).resolve().parents[1] / "config", config_dir)
    toml = config_dir / "memory_policy.toml"
    toml.write_text(toml.read_text().replace("embedded = true", "embedded = false"))  # no Redis needed here
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
    env.update(SWITCHYARD_TLS_DIR=str(secret), SWITCHYARD_UP_FILE=str(tmp_path / "up.json"))
    done = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "up", "--config-dir", str(config_dir), "--free-ports",
         "--data-dir", str(tmp_path / "data"), "--ready-timeout", "600"],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "health check at 127.0.0.1:" in done.stderr and "failed TLS" in done.stderr, done.stderr[-3000:]
    assert "dialled name '127.0.0.1'" in done.stderr and "DNS:localhost" in done.stderr, done.stderr[-3000:]
    assert "--ready-timeout" not in done.stderr.split("failed TLS", 1)[1], done.stderr[-3000:]


async def test_the_try_line_of_switchyard_up_runs_as_printed_against_a_stack_with_tls_and_tokens(
        pki, tmp_path, monkeypatch, capsys):
    """`switchyard up` printed `Try: switchyard run "..."` whatever the stack: with TLS from SWITCHYARD_TLS_DIR
    and bearer tokens on, that command, run in another shell, sent plain text and no token. The line carries
    the TLS variables, and a --token-file holding a token that may call RunTask (never the token itself)."""
    import shlex

    from switchyard import client
    from switchyard.common.config import load_config
    from switchyard.launcher import try_run_command
    from switchyard.orchestrator.service import OrchestratorService

    secret = tmp_path / "tls"
    secret.mkdir()
    for source, name in (("cert.pem", "tls.crt"), ("key.pem", "tls.key"), ("ca.pem", "ca.crt")):
        shutil.copy(pki / source, secret / name)
    monkeypatch.setenv("SWITCHYARD_TLS_DIR", str(secret))
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKENS", "status-only agent.AgentService/GetTaskStatus,runner-token")
    monkeypatch.delenv("SWITCHYARD_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SWITCHYARD_CONFIG_DIR", raising=False)
    async with running([Downstream()], tls(pki)) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        cfg = load_config("config", service="orchestrator").with_overrides(**{
            "orchestrator.retrieval_addr": addr, "orchestrator.dispatcher_addr": addr,
            "orchestrator.cpu_executor": "loop", "orchestrator.auth.enabled": True})
        assert cfg.server.tls.enabled
        async with running([OrchestratorService(cfg)], cfg.server) as orchestrator:
            private = tmp_path / "private"
            private.mkdir(mode=0o700)
            printed = try_run_command(cfg, None, f"127.0.0.1:{orchestrator.port}", private)
            assert "runner-token" not in printed and "status-only" not in printed, printed
            words = shlex.split(printed)
            run = words.index("run")
            variables = dict(w.split("=", 1) for w in words[:run - 1])
            assert variables == {"SWITCHYARD_TLS_DIR": str(secret)}, printed
            argv = words[run + 1:]
            assert (private / "run-token").read_text().strip() == "runner-token"
            assert (private / "run-token").stat().st_mode & 0o077 == 0  # this user's alone
            outside = tmp_path / "elsewhere"  # another shell: none of this one's variables, no config/ here
            outside.mkdir()
            monkeypatch.chdir(outside)
            monkeypatch.delenv("SWITCHYARD_TLS_DIR")
            monkeypatch.delenv("SWITCHYARD_AUTH_TOKENS")
            bare = ["--addr", f"127.0.0.1:{orchestrator.port}", argv[-1]]  # the line as it was printed before
            assert await asyncio.to_thread(client.main, bare) != 0
            capsys.readouterr()
            for name, value in variables.items():
                monkeypatch.setenv(name, value)
            at = argv.index("--token-file")
            assert await asyncio.to_thread(client.main, argv[:at] + argv[at + 2:]) != 0  # TLS, but no token
            assert "UNAUTHENTICATED" in capsys.readouterr().err
            assert await asyncio.to_thread(client.main, argv) == 0
            out = capsys.readouterr()
            assert "error" not in out.err, out.err
