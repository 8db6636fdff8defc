"""What a tenant reads of an error names no internal address; the operator's log and span keep it whole.

A real stack on 127.0.0.1 (orchestrator with its HTTP face, a dispatcher on the ``openai`` engine) in front of
sim-openai answering 400 or 503 with words that name an address of their own: every exit of the edge (RunTask's
gRPC status, the HTTP face's SSE ``error`` event and JSON error, GetTaskStatus's stored error on both faces)
hides the model server's address, and shows it with ``orchestrator.show_addresses_to_callers``. (A react_loop
tool's error result: test_orchestrator.py, retrieval down.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import httpx
import pytest
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401
from httpx_sse import aconnect_sse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import telemetry
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig, load_config
from switchyard.common.server import running, start_server
from switchyard.dispatcher.engines import make_engine
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator.addresses import ERROR_EVENT, HIDDEN, EdgeText
from switchyard.orchestrator.http_face import HttpFace
from switchyard.orchestrator.service import OrchestratorService
from switchyard.orchestrator.taskstore.sqlite_store import SqliteTaskStore
from switchyard_harness.faults import Fault

MODEL = "acme/served-8b"
ROUTER = "http://10.9.8.7:9000/route"
SAID = f"bad request: the router at {ROUTER} refused it"
"""The server's own words, naming an address of its own (as a proxy in front of a model server does)."""
BODY = {"agent_id": "a1", "payload": "hi", "task_type": "chat"}


def config_for(base_url: str, store: Path, **overrides: Any) -> SwitchyardConfig:
    return load_config("config").with_overrides(**{
        "dispatcher.engine": "openai", "upstream.base_url": base_url, "upstream.default_model": MODEL,
        "upstream.fallback_model": "", "upstream.api_key_required": False, "upstream.max_retries": 0,
        "orchestrator.cpu_executor": "loop", "orchestrator.task_store.sqlite_path": str(store / "tasks.sqlite3"),
        **overrides})


class Stack:
    """The stack's two faces and the orchestrator's spans."""

    def __init__(self, stub: agent_pb2_grpc.AgentServiceStub, client: httpx.AsyncClient,
                 exporter: InMemorySpanExporter) -> None:
        self.stub, self.client, self.exporter = stub, client, exporter

    async def run_error(self) -> grpc.aio.AioRpcError:
        """RunTask's status: the stream ends with an error."""
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in self.stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", agent_id="a1")):
                pass
        return caught.value

    async def sse_error(self) -> dict[str, str]:
        """The HTTP face's run: accepted, then the ``error`` event that ends the stream."""
        async with aconnect_sse(self.client, "POST", "/api/v1/agent/run", json=BODY) as source:
            events = [(event.event, event.json()) async for event in source.aiter_sse()]
        assert [kind for kind, _ in events][0] == "accepted" and events[-1][0] == "error", events
        return events[-1][1]["error"]

    async def stored_errors(self) -> tuple[str, str]:
        """A submitted task's error once FAILED, as GetTaskStatus answers it on gRPC and on HTTP."""
        accepted = await self.stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", agent_id="a1"))
        for _ in range(500):
            status = await self.stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=accepted.task_id))
            if status.state == agent_pb2.FAILED:
                break
            await asyncio.sleep(0.02)
        assert status.state == agent_pb2.FAILED, status
        reply = await self.client.get(f"/api/v1/tasks/{accepted.task_id}")
        assert reply.status_code == 200, reply.text
        return status.error, reply.json()["error"]

    def run_task_spans(self) -> list[Any]:
        return [s for s in self.exporter.get_finished_spans()
                if s.name == "agent.AgentService/RunTask" and s.kind.name == "SERVER"]


@contextlib.asynccontextmanager
async def stack(cfg: SwitchyardConfig) -> AsyncIterator[Stack]:
    """An orchestrator (traced into an in-memory exporter) and its HTTP face before a dispatcher of ``cfg``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as disp:
        orch_cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}"})
        orch = OrchestratorService(orch_cfg)
        face = HttpFace(orch, orch_cfg, port=0)
        srv = await start_server([orch, face], "127.0.0.1", 0, cfg.server, telemetry.server_interceptors(provider))
        try:
            async with open_channel(f"127.0.0.1:{srv.port}") as channel, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
                yield Stack(agent_pb2_grpc.AgentServiceStub(channel), client, exporter)
        finally:
            await srv.stop(1.0)


def address_of(base_url: str) -> str:
    """``127.0.0.1:PORT`` of a base URL."""
    return base_url.split("://", 1)[1].split("/", 1)[0]


async def test_a_tenant_reads_the_upstreams_error_without_its_address_the_operator_whole(
        clean_proxy_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="switchyard.orchestrator.service")
    with start_sim(models=[MODEL], faults={"*": Fault(status=400, said=SAID)}) as sim:
        address = address_of(sim.base_url)
        async with stack(config_for(sim.base_url, tmp_path)) as s:
            run = await s.run_error()
            sse = await s.sse_error()
            stored_grpc, stored_http = await s.stored_errors()
            spans = s.run_task_spans()
    assert run.code() == grpc.StatusCode.INVALID_ARGUMENT
    for text in (run.details(), sse["message"], stored_grpc, stored_http):
        assert address not in text and "10.9.8.7" not in text and "://" not in text, text
        # the endpoint named without its address; the status, the server's words and the fix kept
        assert "upstream 400 from the model server (upstream said 'bad request: the router at the model server " \
               f"refused it'): the request for model {MODEL!r} was rejected, not retried" in text, text
    assert sse["code"] == "INVALID_ARGUMENT" and sse["origin"] == "upstream model"
    assert stored_grpc.startswith(f"INVALID_ARGUMENT: upstream model (via dispatcher at {HIDDEN}): upstream 400 from "
                                  "the model server")
    # the operator's view: the whole message in the orchestrator's log and on the RunTask span
    assert f"upstream 400 from {sim.base_url}/chat/completions" in caplog.text and ROUTER in caplog.text
    assert spans and all(address not in (span.status.description or "") for span in spans)
    whole = [event.attributes["switchyard.error.message"] for span in spans for event in span.events
             if event.name == ERROR_EVENT]
    assert whole and f"upstream 400 from {sim.base_url}/chat/completions" in whole[0] and ROUTER in whole[0]


async def test_with_the_opt_in_a_tenant_reads_the_address(clean_proxy_env, tmp_path):
    with start_sim(models=[MODEL], faults={"*": Fault(status=400, said=SAID)}) as sim:
        cfg = config_for(sim.base_url, tmp_path, **{"orchestrator.show_addresses_to_callers": True})
        async with stack(cfg) as s:
            run = await s.run_error()
            sse = await s.sse_error()
            stored = await s.stored_errors()
    for text in (run.details(), sse["message"], *stored):
        assert f"upstream 400 from {sim.base_url}/chat/completions (upstream said 'bad request: the router at " \
               f"{ROUTER} refused it')" in text, text


async def test_an_overloaded_servers_503_names_the_model_server_and_keeps_its_words(clean_proxy_env, tmp_path):
    with start_sim(models=[MODEL], faults={"*": Fault(status=503)}) as sim:
        address = address_of(sim.base_url)
        async with stack(config_for(sim.base_url, tmp_path)) as s:
            run = await s.run_error()
            sse = await s.sse_error()
    assert run.code() == grpc.StatusCode.UNAVAILABLE
    for text in (run.details(), sse["message"]):
        assert address not in text, text
        assert ("upstream 503 from the model server (upstream said 'upstream failure 503 (injected)'): the model "
                f"server failed for model {MODEL!r}; retry later or check its logs") in text, text


async def test_a_model_server_not_listening_is_named_without_its_host_or_port(clean_proxy_env, tmp_path):
    """Nothing listens at the base URL (the server stopped): aiohttp's words name the socket address as Python
    prints it, "Connect call failed ('127.0.0.1', 38281)"; a caller read "('[address hidden]', 38281)", the
    model server's port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    base_url = f"http://127.0.0.1:{port}/v1"
    async with stack(config_for(base_url, tmp_path, **{"upstream.http_transport": "aiohttp"})) as s:
        run = await s.run_error()
        sse = await s.sse_error()
    assert run.code() == grpc.StatusCode.UNAVAILABLE
    for text in (run.details(), sse["message"]):
        assert str(port) not in text and "127.0.0.1" not in text, text
        assert "model gateway upstream unavailable at the model server" in text, text


async def test_a_pools_replicas_are_named_without_their_addresses(clean_proxy_env, tmp_path):
    """``model_gateway.pool.endpoints``: two replicas, each answering 503; the caller reads neither address."""
    with start_sim(models=[MODEL], faults={"*": Fault(status=503)}) as first, \
            start_sim(models=[MODEL], faults={"*": Fault(status=503)}) as second:
        cfg = config_for(first.base_url, tmp_path, **{"upstream.pool.endpoints": [first.base_url, second.base_url]})
        async with stack(cfg) as s:
            run = await s.run_error()
            sse = await s.sse_error()
    assert run.code() == grpc.StatusCode.UNAVAILABLE
    for text in (run.details(), sse["message"]):
        assert address_of(first.base_url) not in text and address_of(second.base_url) not in text, text
        assert "127.0.0.1" not in text and "upstream 503 from the model server (replica " in text, text


async def test_a_tenant_of_a_pool_reads_which_replica_answered_by_its_place_not_its_address(
        clean_proxy_env, tmp_path):
    """Every replica's error read "the model server": a tenant could not tell one failing replica from a pool
    failing. The replica is named by its place in model_gateway.pool.endpoints (from 1; an endpoint's own name is
    its host:port, an address), live and in a stored error alike."""
    said = {"1": "the first replica refused it", "2": "the second replica refused it"}
    with start_sim(models=[MODEL], faults={"*": Fault(status=400, said=said["1"])}) as first, \
            start_sim(models=[MODEL], faults={"*": Fault(status=400, said=said["2"])}) as second:
        cfg = config_for(first.base_url, tmp_path, **{"upstream.pool.endpoints": [first.base_url, second.base_url]})
        async with stack(cfg) as s:
            run = await s.run_error()
            sse = await s.sse_error()
            stored = await s.stored_errors()
    assert run.code() == grpc.StatusCode.INVALID_ARGUMENT
    for text in (run.details(), sse["message"], *stored):
        assert address_of(first.base_url) not in text and address_of(second.base_url) not in text, text
        replica = next(n for n, words in said.items() if words in text)  # the replica that answered, by its words
        assert f"upstream 400 from the model server (replica {replica}) (upstream said '{said[replica]}')" in text, text


@pytest.mark.parametrize("message, shown", [
    ("upstream 503 from http://10.0.3.7:8000/v1/chat/completions (upstream said 'x')",
     "upstream 503 from the model server (replica 2) (upstream said 'x')"),
    ("cut (from http://10.0.3.7:8000/v1/chat/completions).", "cut (from the model server (replica 2))."),
    ("model gateway upstream unavailable (ConnectError)",
     "model gateway upstream unavailable (ConnectError) (from replica 2)"),
])
def test_the_replica_goes_beside_the_endpoints_url_and_the_tenant_reads_it_there(message, shown):
    from switchyard.gateway.errors import GatewayError

    error = GatewayError(message).from_replica("http://10.0.3.7:8000/v1", "2").from_replica("x", "1")  # once
    assert error.replica == "2"
    assert EdgeText(show_addresses=False).text(str(error), "upstream model") == shown
    assert str(GatewayError(message).from_replica("http://10.0.3.7:8000/v1", "")) == message  # one endpoint


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_dispatcher_that_does_not_answer_is_named_without_its_address(tmp_path):
    """The orchestrator's own error (ServiceUnavailable) before a task is accepted: the gRPC status and the HTTP
    face's JSON error body."""
    dead = f"127.0.0.1:{free_port()}"
    cfg = load_config("config").with_overrides(**{
        "dispatcher.engine": "sim", "orchestrator.dispatcher_addr": dead, "orchestrator.cpu_executor": "loop",
        "orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3")})
    orch = OrchestratorService(cfg)
    face = HttpFace(orch, cfg, port=0)
    async with running([orch, face], cfg.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in agent_pb2_grpc.AgentServiceStub(channel).RunTask(
                        agent_pb2.RunTaskRequest(payload="hi", task_type="chat", agent_id="a1")):
                    pass
            reply = await client.post("/api/v1/agent/run", json=BODY)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reply.status_code == 503, reply.text
    for text in (caught.value.details(), reply.json()["error"]["message"]):
        assert dead not in text and "127.0.0.1" not in text, text
        assert f"dispatcher service unavailable at {HIDDEN}" in text, text
        assert text.count("hidden]") == text.count(HIDDEN), text  # gRPC's ipv4:127.0.0.1:PORT hidden whole


CALLER_IDS = ["run.20241207:0001", "crawler.internal", "api.example.com:443", "10.0.0.1"]
"""A caller's own ids that read as addresses to the patterns: its errors quote them, and it reads them back."""


async def test_a_callers_own_ids_in_its_errors_are_not_hidden(tmp_path):
    """GetTaskStatus and CancelTask of an unknown task_id or agent_id, on both faces: NOT_FOUND naming the id as
    the caller wrote it (it read '[address hidden]', the id it needs to tell which lookup failed)."""
    cfg = load_config("config").with_overrides(**{
        "dispatcher.engine": "sim", "orchestrator.dispatcher_addr": f"127.0.0.1:{free_port()}",
        "orchestrator.cpu_executor": "loop", "orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3")})
    orch = OrchestratorService(cfg)
    face = HttpFace(orch, cfg, port=0)
    async with running([orch, face], cfg.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            for caller_id in CALLER_IDS:
                answers = []
                for call in (stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=caller_id)),
                             stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(agent_id=caller_id)),
                             stub.CancelTask(agent_pb2.CancelTaskRequest(task_id=caller_id))):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call
                    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value
                    answers.append(caught.value.details())
                for reply in (await client.get(f"/api/v1/tasks/{caller_id}"),
                              await client.get(f"/api/v1/agent/{caller_id}/status"),
                              await client.post(f"/api/v1/tasks/{caller_id}/cancel")):
                    assert reply.status_code == 404, reply.text
                    answers.append(reply.json()["error"]["message"])
                for text in answers:
                    assert repr(caller_id) in text and HIDDEN not in text, text


async def test_a_callers_task_id_in_submits_refusal_is_not_hidden(tmp_path):
    """SubmitTask's ALREADY_EXISTS (the same task_id, another request) names the task_id as the caller wrote it."""
    cfg = load_config("config").with_overrides(**{
        "dispatcher.engine": "sim", "orchestrator.cpu_executor": "loop",
        "orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3")})
    async with running([DispatcherService(cfg, engine=make_engine(cfg))], cfg.server) as disp:
        orch_cfg = cfg.with_overrides(**{"orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}"})
        async with running([OrchestratorService(orch_cfg)], cfg.server) as srv:
            async with open_channel(f"127.0.0.1:{srv.port}") as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                task_id = CALLER_IDS[0]
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="hi", task_type="chat",
                                                               agent_id="a1"))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id=task_id, payload="other",
                                                                   task_type="chat", agent_id="a1"))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert f"task_id: {task_id!r} already exists" in caught.value.details(), caught.value.details()


def test_a_callers_own_id_is_kept_where_quoted_only():
    """``keep`` leaves the caller's id where the message quotes it; an unquoted address equal to it is hidden."""
    edge = EdgeText(show_addresses=False, known=["10.0.0.5:50053"])
    assert edge.text("task_id: no task 'run.2024:0001' (x)", "orchestrator", keep=["run.2024:0001"]) == \
        "task_id: no task 'run.2024:0001' (x)"
    assert edge.text("task_id: no task 'run.2024:0001' (x)", "orchestrator") == f"task_id: no task '{HIDDEN}' (x)"
    assert edge.text("agent '10.0.0.5:50053': dispatcher service unavailable at 10.0.0.5:50053", "orchestrator",
                     keep=["10.0.0.5:50053"]) == f"agent '10.0.0.5:50053': dispatcher service unavailable at {HIDDEN}"


HIDE = [
    # the gateway's rows: the URL it called, a pool's endpoints, its cooldown
    ("upstream 503 from http://10.0.3.7:8000/v1/chat/completions (upstream said 'x')", "upstream model",
     "upstream 503 from the model server (upstream said 'x')"),
    ("model gateway upstream unavailable at https://vllm.serving.svc.cluster.local/v1 (ConnectError); start it",
     "upstream model", "model gateway upstream unavailable at the model server (ConnectError); start it"),
    ("every endpoint of model_gateway.pool is down (3: 10.0.3.7:8000, [fd00::7]:8000, vllm-a:8000); calls resume",
     "upstream model", f"every endpoint of model_gateway.pool is down (3: {HIDDEN}, {HIDDEN}, {HIDDEN}); calls resume"),
    ("model 'llama3:8000' not found upstream", "upstream model", "model 'llama3:8000' not found upstream"),
    ("no endpoint in the pool yet (http://vllm-headless:8000/v1 resolved to none)", "upstream model",
     "no endpoint in the pool yet (the model server resolved to none)"),
    # a socket address as an OS error prints it (aiohttp's, asyncio's): host and port hidden together; the port
    # was left beside a hidden host ("('[address hidden]', 38281)"), an IPv6 host not hidden at all
    ("model gateway upstream unavailable at http://127.0.0.1:38281/v1/chat/completions (ConnectError: "
     "ClientConnectorError: Cannot connect to host 127.0.0.1:38281 ssl:default [Connect call failed "
     "('127.0.0.1', 38281)])", "upstream model",
     f"model gateway upstream unavailable at the model server (ConnectError: ClientConnectorError: Cannot connect "
     f"to host {HIDDEN} ssl:default [Connect call failed ({HIDDEN})])"),
    ("Multiple exceptions: [Errno 111] Connect call failed ('::1', 8000, 0, 0), [Errno 111] Connect call failed "
     "('10.0.3.7', 8000)", "upstream model",
     f"Multiple exceptions: [Errno 111] Connect call failed ({HIDDEN}), [Errno 111] Connect call failed ({HIDDEN})"),
    ("connect to (\"model-a.serving.svc\", 8000) failed; a caller's ('a', 1) is no address", "dispatcher",
     f"connect to ({HIDDEN}) failed; a caller's ('a', 1) is no address"),
    # a proxy's error names the proxy and the model server it was calling
    ("local proxy failed: HTTPS_PROXY=http://proxy.corp:3128 did not answer (ConnectError) while calling "
     "http://10.0.3.7:8000/v1/chat/completions; start the proxy", "proxy",
     "local proxy failed: HTTPS_PROXY=the proxy did not answer (ConnectError) while calling the model server; "
     "start the proxy"),
    # credentials in a URL, inside the server's words: the whole URL goes
    ("upstream 400 from http://h:8000/v1/chat/completions (upstream said 'see https://user:sk-pw@10.1.1.1/a?key=k')",
     "upstream model", "upstream 400 from the model server (upstream said 'see the model server')"),
    # the orchestrator's own: a downstream service's address, gRPC's resolved address, a private host name
    ("dispatcher service unavailable at dispatcher.ns.svc:50053: failed to connect to all addresses; last error: "
     "UNKNOWN: ipv4:10.0.0.5:50053: Connection refused; is it running?", "orchestrator",
     f"dispatcher service unavailable at {HIDDEN}: failed to connect to all addresses; last error: UNKNOWN: "
     f"{HIDDEN}: Connection refused; is it running?"),
    ("task t ran out of time after 10 s waiting for the model server at http://model:8000/v1 (model m) for 4 s.",
     "orchestrator", f"task t ran out of time after 10 s waiting for the model server at {HIDDEN} (model m) for 4 s."),
    ("resolving ip-10-0-3-7.ec2.internal failed", "dispatcher", f"resolving {HIDDEN} failed"),
    # an orchestrator instance's id (hostname:pid:tag): its tag alone, host and pid internal
    ("task_id: task 't' is held by orchestrator orch-7.ns.svc:4242:3f2a9c1d, which was asked to cancel it",
     "orchestrator", "task_id: task 't' is held by orchestrator instance 3f2a9c1d, which was asked to cancel it"),
    ("UNAVAILABLE: orchestrator web_2:17:0badc0de stopped while the task was RUNNING (its lease ran out)", "",
     "UNAVAILABLE: orchestrator instance 0badc0de stopped while the task was RUNNING (its lease ran out)"),
    # no address: left as it is (a time, a caller's own id, a setting's name and value)
    ("task '10.0.0.1-report' (build-10.0.0.1, release-1.2.3.4) not found", "orchestrator",
     "task '10.0.0.1-report' (build-10.0.0.1, release-1.2.3.4) not found"),
    # a model id quoted as servers quote it, in an upstream's words: Ollama's "m:tag", vLLM's `m:tag`
    ('upstream 404 (upstream said \'model "tuned:1234" not found\')', "upstream model",
     'upstream 404 (upstream said \'model "tuned:1234" not found\')'),
    ("upstream 404 (upstream said 'The model `tuned:0612` does not exist.')", "upstream model",
     "upstream 404 (upstream said 'The model `tuned:0612` does not exist.')"),
    ("agent_id: agent 'user:12345' submitted no task (job:1234, max_tokens:4096) at 12:30; "
     "orchestrator.task_time_limit_s.chat = 600 (limits.max_tokens 4096, v1.2.3)", "orchestrator",
     "agent_id: agent 'user:12345' submitted no task (job:1234, max_tokens:4096) at 12:30; "
     "orchestrator.task_time_limit_s.chat = 600 (limits.max_tokens 4096, v1.2.3)"),
]


@pytest.mark.parametrize("message, hop, shown", HIDE)
def test_each_kind_of_address_is_hidden_and_the_words_around_it_kept(message, hop, shown):
    assert EdgeText(show_addresses=False).text(message, hop) == shown


def _raised(make) -> str:
    try:
        make()
    except Exception as exc:  # noqa: BLE001 - the message is what is read
        return str(exc)
    raise AssertionError("expected an error")


UPSTREAM_URL = "http://10.0.3.7:8000/v1/chat/completions"


def _gateway_errors() -> dict[str, str]:
    """The gateway's own messages that name the model server's URL inside a sentence, built by the functions that
    word them."""
    from switchyard.gateway.classify import error_for_status
    from switchyard.gateway.decode import finish_reason_of
    from switchyard.gateway.keys import ApiKey

    key = ApiKey("K", None)
    body = '{"error": {"message": "KV cache lost"}}'
    return {
        "in the stream": str(error_for_status(500, body, {}, url=UPSTREAM_URL, model="m", key=key, in_stream=True)),
        "in the stream, no status": str(error_for_status(None, body, {}, url=UPSTREAM_URL, model="m", key=key,
                                                          in_stream=True)),
        "408": str(error_for_status(408, body, {}, url=UPSTREAM_URL, model="m", key=key)),
        "finish_reason abort": _raised(lambda: finish_reason_of("abort", url=UPSTREAM_URL)),
        "finish_reason unknown": _raised(lambda: finish_reason_of("banana", url=UPSTREAM_URL)),
    }


@pytest.mark.parametrize("case, shown", [
    ("in the stream", "upstream error inside the stream from the model server (status 500): 'KV cache lost'"),
    ("in the stream, no status", "upstream error inside the stream from the model server: 'KV cache lost'"),
    ("408", "upstream 408 from the model server (upstream said 'KV cache lost'): the server timed the request for "
            "model 'm' out; retried"),
    ("finish_reason abort", "upstream answer from the model server ended with finish_reason 'abort': "),
    ("finish_reason unknown", "upstream answer from the model server ended with finish_reason 'banana': "),
])
def test_the_gateways_errors_read_as_sentences_with_the_model_servers_url_hidden(case, shown):
    """A caller reads the model server's URL as "the model server": the messages that put the URL where a name
    goes read so too. Two read "upstream the model server sent an error inside the stream" and "upstream the model
    server ended the answer with finish_reason 'abort'", a 408 "upstream answered 408 for the model server"; the
    operator reads the URL in the same place."""
    message = _gateway_errors()[case]
    assert UPSTREAM_URL in message
    caller = EdgeText(show_addresses=False).text(message, "upstream model")
    assert caller.startswith(shown), caller
    assert "upstream the model server" not in caller and "for the model server" not in caller, caller


def test_the_orchestrators_own_addresses_are_hidden_whatever_their_form():
    """A host of one label with its port reads as an id (``user:12345``) and is left by the patterns; the
    orchestrator's own settings name its downstream services and Redis, which are hidden as written."""
    cfg = load_config("config").with_overrides(**{
        "orchestrator.dispatcher_addr": "ipv4:dispatcher-0:50053,dispatcher-1:50053",
        "orchestrator.retrieval_addr": "dns:///retrieval:50052", "memory.dram.host": "redis"})
    edge = EdgeText.for_config(cfg)
    assert edge.text("dispatcher service unavailable at dispatcher-1:50053; retrieval (retrieval:50052) too; "
                     "redis redis:6379 refused; user:12345 kept", "orchestrator") == \
        f"dispatcher service unavailable at {HIDDEN}; retrieval ({HIDDEN}) too; redis {HIDDEN} refused; " \
        "user:12345 kept"
    assert edge.text("dispatcher (ipv4:dispatcher-0:50053,dispatcher-1:50053): x; dns:///retrieval:50052 y") == \
        f"dispatcher ({HIDDEN}): x; {HIDDEN} y"


@pytest.mark.parametrize("dispatcher_addr, message, shown", [
    # what a caller read once a local dispatcher stopped (switchyard up, SIGTERM): gRPC's resolved address is the
    # orchestrator's own setting behind the scheme gRPC writes before it
    ("127.0.0.1:40107", "dispatcher service unavailable at 127.0.0.1:40107: connections to all backends failing; "
     "last error: UNKNOWN: ipv4:127.0.0.1:40107: Failed to connect to remote host: Connection refused",
     f"dispatcher service unavailable at {HIDDEN}: connections to all backends failing; last error: UNKNOWN: "
     f"{HIDDEN}: Failed to connect to remote host: Connection refused"),
    # its siblings: a host of one label in a static list, an IPv6 address, a unix socket
    ("ipv4:dispatcher-0:50053,dispatcher-1:50053", "last error: UNKNOWN: ipv4:dispatcher-1:50053: Connection refused",
     f"last error: UNKNOWN: {HIDDEN}: Connection refused"),
    ("[::1]:50053", "last error: UNKNOWN: ipv6:[::1]:50053: Connection refused",
     f"last error: UNKNOWN: {HIDDEN}: Connection refused"),
    ("unix:/run/dispatcher.sock", "last error: UNKNOWN: unix:/run/dispatcher.sock: No such file",
     f"last error: UNKNOWN: {HIDDEN}: No such file"),
])
def test_grpcs_resolved_form_of_an_own_address_is_hidden_whole(dispatcher_addr, message, shown):
    """gRPC names the address it failed to reach as ``ipv4:HOST:PORT``: the orchestrator's own address hidden
    as written left the ``ipv4:`` before it, which was then read as an address of its own (``[address hidden]
    hidden]``)."""
    cfg = load_config("config").with_overrides(**{"orchestrator.dispatcher_addr": dispatcher_addr})
    assert EdgeText.for_config(cfg).text(message, "orchestrator") == shown


def test_a_known_address_inside_grpcs_resolved_address_is_hidden_whole():
    """The default dispatcher_addr (127.0.0.1:50053) is a known address, and gRPC names it ipv4:127.0.0.1:50053
    when it does not answer: hidden once, not read as ``[address hidden] hidden]``."""
    edge = EdgeText.for_config(load_config("config").with_overrides(**{
        "orchestrator.dispatcher_addr": "10.0.0.5:50053", "orchestrator.retrieval_addr": "ipv4:10.0.0.6:50052"}))
    assert edge.text("dispatcher service unavailable at 10.0.0.5:50053: failed to connect to all addresses; last "
                     "error: UNKNOWN: ipv4:10.0.0.5:50053: Connection refused; retrieval ipv4:10.0.0.6:50052 too",
                     "orchestrator") == \
        f"dispatcher service unavailable at {HIDDEN}: failed to connect to all addresses; last error: UNKNOWN: " \
        f"{HIDDEN}: Connection refused; retrieval {HIDDEN} too"


def test_the_opt_in_shows_addresses_but_never_a_urls_credentials():
    edge = EdgeText(show_addresses=True)
    message = "upstream 401 from http://u:secret@10.0.3.7:8000/v1/chat/completions?api-key=k2 (upstream said 'no')"
    assert edge.text(message, "upstream model") == \
        "upstream 401 from http://10.0.3.7:8000/v1/chat/completions (upstream said 'no')"
    assert edge.text("dispatcher service unavailable at 10.0.0.5:50053", "orchestrator") == \
        "dispatcher service unavailable at 10.0.0.5:50053"
    held = "task 't' is held by orchestrator orch-7:4242:3f2a9c1d, which was asked to cancel it"
    assert edge.text(held, "orchestrator") == held


def test_a_stored_error_is_answered_hidden_and_kept_whole():
    edge = EdgeText(show_addresses=False)
    status = agent_pb2.TaskStatus(task_id="t", state=agent_pb2.FAILED, error=(
        "UNAVAILABLE: upstream model (via dispatcher at 10.0.0.5:50053): upstream 503 from "
        "http://10.0.3.7:8000/v1/chat/completions (x)"))
    shown = edge.status(status)
    assert shown.error == f"UNAVAILABLE: upstream model (via dispatcher at {HIDDEN}): upstream 503 from the model " \
                          "server (x)" and shown.task_id == "t"
    assert "10.0.3.7" in status.error  # the record itself keeps it whole
    proxy = agent_pb2.TaskStatus(error="UNAVAILABLE: proxy (via dispatcher at 10.0.0.5:50053): local proxy failed: "
                                       "HTTPS_PROXY=http://p:3128 did not answer")
    assert edge.status(proxy).error == f"UNAVAILABLE: proxy (via dispatcher at {HIDDEN}): local proxy failed: " \
                                       "HTTPS_PROXY=the proxy did not answer"
    own = agent_pb2.TaskStatus(error="DEADLINE_EXCEEDED: task t ran out of time waiting for the model server at "
                                     "http://10.0.3.7:8000/v1 (model m)")
    assert edge.status(own).error == f"DEADLINE_EXCEEDED: task t ran out of time waiting for the model server at " \
                                     f"{HIDDEN} (model m)"


async def test_an_orphaned_tasks_error_names_its_orchestrator_by_tag_not_host_and_pid(tmp_path):
    """A task whose orchestrator went (its lease gone) is failed naming that orchestrator's instance id,
    hostname:pid:tag; GetTaskStatus answered it whole on both faces. The caller reads the tag; the record keeps
    the whole id for the operator."""
    cfg = load_config("config").with_overrides(**{
        "dispatcher.engine": "sim", "orchestrator.cpu_executor": "loop",
        "orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3")})
    gone = SqliteTaskStore(cfg.orchestrator.task_store)  # another orchestrator's store: it records a task, then goes
    await gone.open()
    await gone.create("orphan-1", "fp", "")
    await gone.close()  # its lease released: the task is an orphan
    host, pid, tag = gone.owner.split(":")
    orch = OrchestratorService(cfg)
    face = HttpFace(orch, cfg, port=0)
    async with running([orch, face], cfg.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
            status = await agent_pb2_grpc.AgentServiceStub(channel).GetTaskStatus(
                agent_pb2.GetTaskStatusRequest(task_id="orphan-1"))
            reply = await client.get("/api/v1/tasks/orphan-1")
        record = await orch.tasks.get("orphan-1")
    assert status.state == agent_pb2.FAILED and reply.status_code == 200, reply.text
    for text in (status.error, reply.json()["error"]):
        assert text.startswith(f"UNAVAILABLE: orchestrator instance {tag} stopped while the task was QUEUED"), text
        assert f"{host}:{pid}" not in text and f":{pid}:" not in text, text
    assert f"orchestrator {gone.owner} stopped" in record.error  # the store keeps it whole


@pytest.mark.parametrize("address, hop", [
    ("http://10.0.3.7:8000/v1/chat/completions", "upstream model"),
    ("10.0.0.5:50053", "orchestrator"),
    ("ip-10-0-3-7.ec2.internal", "dispatcher"),
])
def test_a_message_cut_to_the_status_bound_shows_no_part_of_an_address(address, hop):
    """Status details are cut to ``MAX_DETAILS_CHARS`` (gRPC's trailer limit); the HTTP face and the stored
    errors GetTaskStatus reads back cut before the edge hides addresses. Wherever the bound falls in the address,
    no part of it reaches the tenant: the cut leaves the word out whole."""
    from switchyard.common.errors import MAX_DETAILS_CHARS, bounded
    edge = EdgeText(show_addresses=False)
    for inside in range(len(address) + 1):
        lead = "x " * ((MAX_DETAILS_CHARS - inside) // 2) + "y" * ((MAX_DETAILS_CHARS - inside) % 2)
        message = f"{lead}{address} " + "and then more words after it " * 10
        cut = bounded(message)
        assert len(cut) < len(message) and cut.endswith(f"(cut from {len(message)} characters)")
        shown = edge.text(cut, hop)
        for part in ("10.0.3.7", "10.0.0.5", "ip-10-0", ":8000", ":50053", "10.0", "ec2"):
            assert part not in shown, (inside, shown[-80:])


def test_a_tenants_task_id_that_reads_like_an_address_comes_back_in_its_deadline_errors():
    """A task id such as ``run.2024:0001`` reads as a host and port to the patterns. The errors of a task that ran
    out of time or was refused early quote it, and the tenant reads it back whole, from RunTask's status (its
    ids kept) and from the stored error GetTaskStatus reads; the model server's address beside it is hidden."""
    from switchyard.common.errors import TaskDeadlineExceeded, TaskRefusedEarly
    edge = EdgeText(show_addresses=False)
    task_id = "run.2024:0001"
    late = TaskDeadlineExceeded(task_id, 10, "orchestrator.task_time_limit_s.chat = 10",
                                "the model server at http://10.0.3.7:8000/v1 (model m) for 4 s")
    early = TaskRefusedEarly(task_id, 0.5, 2.0, 1, 0.1)
    for exc in (late, early):
        stored = agent_pb2.TaskStatus(task_id=task_id, error=f"DEADLINE_EXCEEDED: {exc}")
        read = edge.status(stored).error
        assert f"task '{task_id}' " in read and "10.0.3.7" not in read, read
        assert f"task '{task_id}' " in edge.text(str(exc), "orchestrator", keep=[task_id])


def test_a_tenants_task_id_that_reads_like_an_address_comes_back_in_its_model_calls_deadline_errors():
    """The dispatcher's deadline errors name the request, ``<task_id>:<turn>``: ``run.2024:12`` (its twelfth turn)
    and ``crawler.internal:2`` read as addresses, and the task's caller read 'request [address hidden] cannot meet
    its task's deadline' (RunTask's error, the stored one GetTaskStatus reads). They quote it, and the edge keeps
    the quoted request ids of the caller's task id; another task's, and an address beside it, are still hidden."""
    from switchyard.common.errors import RequestDeadlineExceeded
    from switchyard.dispatcher.scheduler.slack import CannotMeetDeadline
    edge = EdgeText(show_addresses=False)
    for task_id, turn in (("run.2024", "12"), ("crawler.internal", "2"), ("crawler.internal", "prefill"),
                          ("run.2024", "12~1")):
        request_id = f"{task_id}:{turn}"
        refused = CannotMeetDeadline(request_id, -1.0, 1.0, 1.5, 0.5, "orchestrator.task_time_limit_s.chat = 5")
        late = RequestDeadlineExceeded(request_id, 5.0, "waiting for admission at 10.0.3.7:50053")
        for exc in (refused, late):
            stored = agent_pb2.TaskStatus(task_id=task_id, error=f"DEADLINE_EXCEEDED: dispatcher: {exc}")
            read = edge.status(stored).error
            assert f"request '{request_id}' " in read and "10.0.3.7" not in read, read
            assert f"request '{request_id}' " in edge.text(str(exc), "dispatcher", keep=[task_id])
    other = CannotMeetDeadline("vllm.internal:2", -1.0, 1.0, 1.5, 0.5)
    assert "vllm.internal" not in edge.text(str(other), "dispatcher", keep=["crawler.internal"])
