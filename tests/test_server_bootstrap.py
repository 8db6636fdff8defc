"""Every server has health checking and reflection on (what grpcurl and ghz rely on)."""

from __future__ import annotations

import asyncio

from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.orchestrator.service import OrchestratorService
from switchyard.common.channels import open_channel, open_sync_channel


async def test_health_and_reflection_describe_run_task():
    cfg = load_config("config").with_overrides(**{  # nothing listens on port 1: no downstream service is up
        "service.orchestrator.retrieval_addr": "127.0.0.1:1", "service.orchestrator.dispatcher_addr": "127.0.0.1:1"})
    async with running([OrchestratorService(cfg)], cfg.service.server) as srv:
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

async def test_graceful_stop_flips_health_to_not_serving():
    cfg = load_config("config")
    async with running([OrchestratorService(cfg)], cfg.service.server) as srv:
        await srv.health.enter_graceful_shutdown()
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="agent.AgentService"))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
