"""Every server has health checking and reflection on (what grpcurl and ghz rely on)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from switchyard.common.config import SwitchyardConfig, load_config
from switchyard.common.errors import ORIGIN_KEY
from switchyard.common.server import GRPC_SERVICES, running
from switchyard.orchestrator.service import OrchestratorService
from switchyard.common.channels import open_channel, open_sync_channel


def shipped_config() -> SwitchyardConfig:
    """The shipped config, the orchestrator's CPU work on its event loop: a spawn pool costs seconds per
    orchestrator, and these tests are of the servers' bootstrap (test_orchestrator tests the pool's)."""
    return load_config("config").with_overrides(**{"orchestrator.cpu_executor": "loop"})


async def test_health_and_reflection_describe_run_task():
    cfg = shipped_config().with_overrides(**{  # nothing listens on port 1: no downstream service is up
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.dispatcher_addr": "127.0.0.1:1"})
    async with running([OrchestratorService(cfg)], cfg.server) as srv:
        address = f"127.0.0.1:{srv.port}"
        async with open_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            alive = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            assert alive.status == health_pb2.HealthCheckResponse.SERVING  # liveness: the server answers
            ready = await stub.Check(health_pb2.HealthCheckRequest(service="agent.AgentService"))
            assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING  # readiness: no dispatcher
        method = await asyncio.to_thread(_describe_run_task, address)  # the reflection client is synchronous
        assert method.input_type.full_name == "agent.RunTaskRequest"
        assert method.server_streaming
        assert {"task_id", "payload"} <= set(method.input_type.fields_by_name)


def _describe_run_task(address: str):
    with open_sync_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "agent.AgentService" in set(db.get_services())
        return DescriptorPool(db).FindServiceByName("agent.AgentService").methods_by_name["RunTask"]

def _reflect(address: str, path: str, *requests: reflection_pb2.ServerReflectionRequest):
    """The answers of one reflection stream at ``path`` (v1 and v1alpha share their messages' bytes)."""
    with open_sync_channel(address) as channel:
        call = channel.stream_stream(path, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return list(call(iter(requests), timeout=10))


@pytest.mark.parametrize("name", ["orchestrator", "dispatcher"])  # retrieval's server is start_server's too
async def test_reflection_answers_v1_as_newer_tools_ask_and_v1alpha_as_older_ones_do(name):
    """grpcurl 1.9 and later ask grpc.reflection.v1.ServerReflection first; every server answered only v1alpha
    (UNIMPLEMENTED to v1). Both list the same services, both reflection names among them, and v1 describes
    itself and the service's own methods."""
    from switchyard.common.reflection import SERVICE_NAMES

    service = {"orchestrator": OrchestratorService, "dispatcher": _dispatcher_service}[name]
    cfg = shipped_config().with_overrides(**{
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.dispatcher_addr": "127.0.0.1:1"})
    own = GRPC_SERVICES[name]
    async with running([service(cfg)], cfg.server) as srv:
        address = f"127.0.0.1:{srv.port}"
        listed = {}
        for version in ("v1", "v1alpha"):
            (answer,) = await asyncio.to_thread(
                _reflect, address, f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                reflection_pb2.ServerReflectionRequest(list_services=""))
            listed[version] = {s.name for s in answer.list_services_response.service}
        assert listed["v1"] == listed["v1alpha"]
        assert {own, "grpc.health.v1.Health", *SERVICE_NAMES} <= listed["v1"], listed
        described = await asyncio.to_thread(
            _reflect, address, "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            *(reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
              for symbol in (own, "grpc.reflection.v1.ServerReflection")))
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for answer in described for raw in answer.file_descriptor_response.file_descriptor_proto]
        services = {f"{f.package}.{s.name}": [m.name for m in s.method] for f in files for s in f.service}
        assert services["grpc.reflection.v1.ServerReflection"] == ["ServerReflectionInfo"], services
        assert services[own], services
        assert {f.name for f in files} >= {"grpc/reflection/v1/reflection.proto", "agent.proto"}


def _dispatcher_service(cfg: SwitchyardConfig):
    from switchyard.dispatcher.service import DispatcherService

    return DispatcherService(cfg)


async def test_a_port_in_use_is_a_named_error():
    """A taken port names the address and the way out, not grpcio's "set GRPC_VERBOSITY=debug"."""
    import socket

    import pytest

    cfg = shipped_config().with_overrides(**{
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.dispatcher_addr": "127.0.0.1:1"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"could not bind 127.0.0.1:{port}: is another process using it\? "
                                               r".*--free-ports"):
            async with running([OrchestratorService(cfg)], cfg.server, port=port):
                pass


async def test_a_host_that_does_not_resolve_is_a_named_error_not_a_port_in_use():
    """SWITCHYARD_HOST=not_a_host said "could not bind not_a_host:0: is another process using it?"; the cause is
    the name lookup, and the way out is the host setting."""
    import pytest

    cfg = shipped_config().with_overrides(**{
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.dispatcher_addr": "127.0.0.1:1"})
    with pytest.raises(RuntimeError) as caught:
        async with running([OrchestratorService(cfg)], cfg.server, host="not-a-host.invalid", port=0):
            pass
    said = str(caught.value)
    assert said.startswith("could not bind not-a-host.invalid:0: the host name 'not-a-host.invalid' does not resolve")
    assert "server.host" in said and "SWITCHYARD_HOST" in said and "another process" not in said


async def test_graceful_stop_flips_health_to_not_serving():
    cfg = shipped_config()
    async with running([OrchestratorService(cfg)], cfg.server) as srv:
        await srv.health.enter_graceful_shutdown()
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="agent.AgentService"))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_connection_age_makes_clients_reconnect():
    """After max_connection_age_s the server sends GOAWAY: the client's next call opens a new connection
    (and re-resolves its target, which is how dns:/// of a headless Service finds new pods)."""
    from switchyard.common.config import ServerConfig
    from switchyard.common.server import start_server

    peers: list[str] = []

    class Echo:
        name = "echo"
        grpc_service_names = ("test.Echo",)

        def register(self, server):
            async def peer(request: bytes, context) -> bytes:
                peers.append(context.peer())
                return b""

            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "test.Echo", {"Peer": grpc.unary_unary_rpc_method_handler(peer)})])

        async def start(self):
            pass

        async def stop(self):
            pass

    config = ServerConfig(max_connection_age_s=1, max_connection_age_grace_s=0)
    srv = await start_server([Echo()], "127.0.0.1", 0, config)
    try:
        async with open_channel(f"127.0.0.1:{srv.port}", config) as channel:
            call = channel.unary_unary("/test.Echo/Peer")
            await call(b"", timeout=10)
            await call(b"", timeout=10)
            assert peers[0] == peers[1], "one connection while it is young"
            # until the GOAWAY for the age (1 s, +10 % jitter) has taken the connection out of READY (the bound,
            # 10 s, is on a hang, not a speed)
            while (state := channel.get_state()) == grpc.ChannelConnectivity.READY:
                await asyncio.wait_for(channel.wait_for_state_change(state), 10)
            await call(b"", timeout=10)
            assert peers[2] != peers[0], "the aged connection was replaced"
    finally:
        await srv.stop(0)


async def test_health_list_reports_every_service_and_follows_shutdown():
    cfg = shipped_config()
    async with running([OrchestratorService(cfg)], cfg.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            listed = (await stub.List(health_pb2.HealthListRequest())).statuses
            assert {"", "agent.AgentService"} <= set(listed)
            for name, status in listed.items():  # the same answer Check gives, service by service
                checked = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert status.status == checked.status, name
            await srv.health.enter_graceful_shutdown()
            listed = (await stub.List(health_pb2.HealthListRequest())).statuses
            assert {s.status for s in listed.values()} == {health_pb2.HealthCheckResponse.NOT_SERVING}


CORRUPT = b"\xff\xff\xff\xff\x0f"  # a field number past the wire format's range
NOT_UTF8 = b"\x12\x02\xff\xfe"  # RunTaskRequest.payload (field 2) holding bytes that are not UTF-8


async def test_a_request_that_does_not_parse_is_invalid_argument_naming_its_message_on_every_kind_of_call():
    """grpc parses a request before any servicer code runs and answered UNKNOWN "Unexpected <class
    'DecodeError'>" to one that does not parse; each kind of call (unary, server streaming, bidirectional) now
    answers INVALID_ARGUMENT naming the message, with the origin trailer, and a well-formed call still works."""
    from switchyard.dispatcher.service import DispatcherService

    cfg = shipped_config().with_overrides(**{
        "orchestrator.retrieval_addr": "127.0.0.1:1", "orchestrator.dispatcher_addr": "127.0.0.1:1"})
    async with running([OrchestratorService(cfg)], cfg.server) as orch, \
            running([DispatcherService(cfg)], cfg.server) as disp:
        calls = [
            (orch.port, "unary_unary", "/agent.AgentService/SubmitTask", CORRUPT, "agent.RunTaskRequest"),
            (orch.port, "unary_unary", "/agent.AgentService/SubmitTask", NOT_UTF8, "agent.RunTaskRequest"),
            (orch.port, "unary_stream", "/agent.AgentService/RunTask", CORRUPT, "agent.RunTaskRequest"),
            (orch.port, "unary_unary", "/agent.AgentService/GetTaskStatus", b"\x0a\x80", "agent.GetTaskStatusRequest"),
            (disp.port, "unary_stream", "/agent.InferenceService/Generate", b"\x0a\x05hello\x12\xff",
             "agent.GenerateRequest"),
            (disp.port, "stream_stream", "/agent.InferenceService/GenerateStream", CORRUPT,
             "agent.GenerateStreamRequest"),
        ]
        for port, kind, method, raw, message in calls:
            async with open_channel(f"127.0.0.1:{port}") as channel:
                call = getattr(channel, kind)(method, request_serializer=lambda b: b, response_deserializer=bytes)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    if kind == "unary_unary":
                        await call(raw, timeout=5)
                    elif kind == "unary_stream":
                        async for _ in call(raw, timeout=5):
                            pass
                    else:
                        async for _ in call(iter([raw]), timeout=5):
                            pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, caught.value)
            assert caught.value.details().startswith(f"request: expected a well-formed {message} message"), method
            origin = dict(caught.value.trailing_metadata() or ()).get(ORIGIN_KEY)
            assert origin == ("orchestrator" if port == orch.port else "dispatcher"), method
        async with open_channel(f"127.0.0.1:{orch.port}") as channel:  # a well-formed call parses as before
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_an_ipv6_address_in_brackets_is_looked_up_bare():
    """[::1] with a port in use was said not to resolve (getaddrinfo takes no brackets)."""
    import socket

    from switchyard.common.server import bind_failure

    import pytest

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as taken:
        try:
            taken.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
        taken.listen()
        port = taken.getsockname()[1]
        assert "is another process using it?" in bind_failure("[::1]", port)
