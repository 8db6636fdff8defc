"""The committed generated code matches proto/ (run `make proto` when this fails)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "services" / "switchyard" / "api"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path):
    written = _generator().generate(tmp_path / "api")
    assert {p.name for p in written} >= {"agent_pb2.py", "agent_pb2.pyi", "agent_pb2_grpc.py"}
    for fresh in written:
        committed = COMMITTED / fresh.name
        assert committed.exists(), f"{committed} missing: run `make proto`"
        assert committed.read_text() == fresh.read_text(), f"{committed.name} is stale: run `make proto`"


def test_package_is_agent_so_ghz_call_name_works():
    from switchyard.api import agent_pb2

    service = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
    assert service.full_name == "agent.AgentService"
    assert service.methods_by_name["RunTask"].server_streaming


def test_ghz_json_parses_unchanged():
    from google.protobuf import json_format

    from switchyard.api import agent_pb2

    req = json_format.Parse('{"task_id":"bench-001","payload":"summarize this doc"}', agent_pb2.RunTaskRequest())
    assert req.task_id == "bench-001" and req.payload == "summarize this doc"
    assert req.priority == agent_pb2.PRIORITY_UNSPECIFIED


def test_each_service_serves_the_grpc_service_the_one_table_names():
    """common.server.GRPC_SERVICES names the proto's services, one per service; the servicers serve them, and
    switchyard up, the orchestrator's readiness and the HTTP face read them there (each kept its own copy)."""
    from switchyard.api import agent_pb2
    from switchyard.common.server import GRPC_SERVICES
    from switchyard.dispatcher.service import DispatcherService
    from switchyard.orchestrator import http_face, readiness
    from switchyard.orchestrator.service import OrchestratorService
    from switchyard.retrieval.service import RetrievalService

    assert sorted(GRPC_SERVICES.values()) == sorted(s.full_name for s in agent_pb2.DESCRIPTOR.services_by_name.values())
    for name, servicer in (("orchestrator", OrchestratorService), ("retrieval", RetrievalService),
                           ("dispatcher", DispatcherService)):
        assert servicer.name == name and servicer.grpc_service_names == (GRPC_SERVICES[name],)
    assert http_face.SERVICE == GRPC_SERVICES["orchestrator"]
    assert readiness.HEALTH_NAMES == {"dispatcher": GRPC_SERVICES["dispatcher"], "retrieval": GRPC_SERVICES["retrieval"]}
