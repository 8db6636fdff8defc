"""The orchestrator's HTTP face against the clients its users read it with: httpx with its timeouts, httpx-sse,
aiohttp's client, and a reconnecting EventSource-style consumer; real aiohttp server on 127.0.0.1 port 0 beside
the real gRPC server, the fixed downstream of test_orchestrator.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import pytest
from httpx_sse import aconnect_sse
from test_http_face import FIELD_BODY, http_stack

from switchyard.orchestrator.addresses import HIDDEN

pytestmark = pytest.mark.no_gpu

CHAT = {**FIELD_BODY, "task_type": "chat"}


async def _release_after(down, quiet_s: float) -> None:
    """Let the downstream's Generate answer ``quiet_s`` after the task reached it: the stream is quiet meanwhile."""
    while not down.requests:
        await asyncio.sleep(0.01)
    await asyncio.sleep(quiet_s)
    down.gate.set()


async def test_a_quiet_stream_is_kept_for_a_client_with_a_read_timeout():
    """A task that waits (a queue, a tool, a long prefill) sent nothing, and httpx's read timeout (5 s by default;
    nginx's proxy_read_timeout is 60 s) cut a stream whose task was still running: ReadTimeout, and the task
    cancelled. A comment line every orchestrator.http.sse_keepalive_s keeps it; SSE parsers skip it."""
    async with http_stack(**{"orchestrator.http.sse_keepalive_s": 0.05}) as (client, _, down):
        client.timeout = httpx.Timeout(30, read=1.0)
        down.gate = asyncio.Event()
        releasing = asyncio.create_task(_release_after(down, 2.0))  # two read timeouts of quiet
        async with aconnect_sse(client, "POST", "/api/v1/agent/run", json=CHAT) as source:
            kinds = [event.event async for event in source.aiter_sse()]
        await releasing
        assert kinds[0] == "accepted" and kinds[-1] == "final" and "token" in kinds, kinds
        assert down.cancelled == []

        down.gate = asyncio.Event()  # the same quiet, read as raw lines: comment lines, each its own event block
        releasing = asyncio.create_task(_release_after(down, 0.5))
        before = len(down.requests)
        down.requests.clear()
        async with client.stream("POST", "/api/v1/agent/run", json=CHAT) as reply:
            lines = [line async for line in reply.aiter_lines()]
        await releasing
        assert before and lines.count(":") >= 2 and lines[lines.index(":") + 1] == "", lines[:12]


async def test_aiohttps_client_reads_a_quiet_stream_within_its_read_timeout():
    async with http_stack(**{"orchestrator.http.sse_keepalive_s": 0.05}) as (client, _, down):
        down.gate = asyncio.Event()
        releasing = asyncio.create_task(_release_after(down, 2.0))
        timeout = aiohttp.ClientTimeout(total=None, sock_read=1.0)
        async with aiohttp.ClientSession(str(client.base_url), timeout=timeout) as session:
            async with session.post("/api/v1/agent/run", json=CHAT) as reply:
                assert reply.status == 200 and reply.content_type == "text/event-stream"
                kinds = [line.decode().split(": ", 1)[1].strip() async for line in reply.content
                         if line.startswith(b"event: ")]
        await releasing
        assert kinds[0] == "accepted" and kinds[-1] == "final", kinds


async def _event_source(client: httpx.AsyncClient, body: dict, stop_after: str | None = None,
                        reconnections: int = 3) -> tuple[list[tuple[str, str]], list[int]]:
    """An EventSource-style consumer (WHATWG HTML 9.2, as requests-sse and browsers' fetch-based EventSource
    libraries implement it) over httpx-sse: it reads events, keeps the last ``id``, and whenever the stream ends
    (read whole, or left after the ``stop_after`` event) connects again with ``Last-Event-ID``, re-sending its
    POST, until an answer other than 200 fails the connection. Returns the (event, id) pairs read and the
    statuses of the connections."""
    events: list[tuple[str, str]] = []
    statuses: list[int] = []
    last_id = ""
    for _ in range(1 + reconnections):
        headers = {"Last-Event-ID": last_id} if last_id else {}
        async with aconnect_sse(client, "POST", "/api/v1/agent/run", json=body, headers=headers) as source:
            statuses.append(source.response.status_code)
            if source.response.status_code != 200:
                return events, statuses  # WHATWG: any other status fails the connection; no reconnection
            async for event in source.aiter_sse():
                last_id = event.id or last_id
                events.append((event.event, event.id))
                if event.event == stop_after:
                    break
    return events, statuses


async def test_an_event_source_reconnecting_after_the_final_event_does_not_run_the_task_again():
    """requests-sse's EventSource (method="POST") reading 60 events ran the same task 4 times: a stream had no
    ids, so each reconnection after a final event was a new POST, run again every reconnection time without end.
    Each event now has an id; the reconnection's Last-Event-ID names the stream's last event, and 204 stops it."""
    async with http_stack() as (client, _, down):
        events, statuses = await _event_source(client, CHAT)
        assert statuses == [200, 204], statuses
        assert [kind for kind, _ in events].count("accepted") == 1 and events[-1][0] == "final"
        assert len(down.requests) == 1
        task_id = events[0][1].rsplit(":", 1)[0]
        assert [i for _, i in events] == [f"{task_id}:{n}" for n in range(len(events) - 1)] + [
            f"{task_id}:{len(events) - 1}:end"]


async def test_an_event_source_that_lost_its_stream_is_told_the_task_was_cancelled_not_given_a_second_run():
    async with http_stack() as (client, _, down):
        down.gate = asyncio.Event()  # the task is inside infer when the connection is lost
        events, statuses = await _event_source(client, CHAT, stop_after="accepted")
        down.gate.set()
        assert statuses == [200, 409] and [kind for kind, _ in events] == ["accepted"], (statuses, events)
        assert len(down.requests) <= 1  # not run again (the first may or may not have reached the model)
        reply = await client.post("/api/v1/agent/run", json=CHAT, headers={"Last-Event-ID": events[0][1]})
        error = reply.json()["error"]
        assert reply.status_code == 409 and error["code"] == "ABORTED" and "Last-Event-ID" in error["message"]


async def test_a_stream_that_fails_after_it_began_ends_with_an_error_event_marked_last():
    limits = {"chat": 0.5, "rag_answer": 180.0, "react_loop": 600.0}
    async with http_stack(**{"orchestrator.task_time_limit_s": limits}) as (client, _, down):
        down.gate = asyncio.Event()  # the model never answers: the task's time limit ends it after accepted
        async with aconnect_sse(client, "POST", "/api/v1/agent/run", json=CHAT) as source:
            events = [(event.event, event.id) async for event in source.aiter_sse()]
        down.gate.set()
        assert events[0][0] == "accepted" and events[-1][0] == "error", events
        assert events[-1][1].endswith(":end") and not any(i.endswith(":end") for _, i in events[:-1]), events
        assert len({i.rsplit(":", 2)[0] for _, i in events}) == 1  # one task's ids


async def test_a_client_that_leaves_a_quiet_stream_after_its_keepalives_cancels_its_task():
    """The keepalive writes while the task waits: a client that leaves then (between two keepalives, or with one
    being written) cancels the task and its Generate, as a cancelled gRPC RunTask does, and no gauge of work in
    flight stays above 0."""
    from prometheus_client import REGISTRY

    async with http_stack(**{"orchestrator.http.sse_keepalive_s": 0.02}) as (client, _, down):
        down.gate = asyncio.Event()
        async with client.stream("POST", "/api/v1/agent/run", json=CHAT) as reply:
            comments = 0
            async for line in reply.aiter_lines():
                comments += line == ":"
                if comments == 3:
                    break
        for _ in range(500):
            if down.cancelled and REGISTRY.get_sample_value("switchyard_agents_concurrent") == 0:
                break
            await asyncio.sleep(0.02)
        assert down.cancelled == [down.requests[0].request_id]
        assert REGISTRY.get_sample_value("switchyard_agents_concurrent") == 0
        down.gate.set()


async def test_a_grpc_client_given_the_http_port_is_told_505_not_a_malformed_request():
    """HTTP/2 with prior knowledge (a gRPC client or grpcurl given the HTTP face's port, curl
    --http2-prior-knowledge) was answered 400 'not a well-formed HTTP/1.1 request (Pause on PRI/Upgrade ...)':
    the parser's words for the HTTP/2 preface. It is 505, the version the face does not speak, as the OpenAPI
    document says of every other version."""
    import grpc

    from switchyard.api import agent_pb2, agent_pb2_grpc

    async with http_stack() as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))  # + empty SETTINGS
        answer = await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 505 "), answer[:300]
        assert "HTTP/2" in json.loads(body)["error"]["message"] and "gRPC" in json.loads(body)["error"]["message"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent_pb2_grpc.AgentServiceStub(channel).SubmitTask(
                    agent_pb2.RunTaskRequest(task_type="chat", agent_id="a"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "HTTP status 505" in refused.value.details()
        assert down.requests == []


def test_every_id_the_documents_pattern_refuses_the_servers_rule_refuses_too():
    """The pattern is the id rule (untrusted.check_id_chars) as far as a regular expression says it: it may let
    through what the rule refuses (rarer format characters, NFC), never refuse what the rule takes."""
    import re

    from switchyard.common.errors import InvalidArgument
    from switchyard.common.untrusted import ID_PATTERN, check_id_chars

    pattern = re.compile(ID_PATTERN)
    refused = 0
    for code in [*range(0xD800), *range(0xE000, 0x10000), *range(0x10000, 0x110000, 97), 0xE0001, 0xE007F]:
        value = "a" + chr(code) + "b"
        if pattern.search(value) is None:
            refused += 1
            with pytest.raises(InvalidArgument):
                check_id_chars(value, "id")
    assert refused > 60 and pattern.search("   ") is None and pattern.search("") is not None
    with pytest.raises(InvalidArgument):
        check_id_chars("   ", "id")


@pytest.mark.parametrize("sent", [" t1", "t1 ", " t1 ", "t1  "])
async def test_an_id_with_a_space_at_its_start_or_end_is_refused_naming_the_field_at_every_edge(sent):
    """A body's task_id or agent_id ' t1 ' was taken as it was, over HTTP and gRPC, while the same in a header
    reached the task as 't1' (HTTP and gRPC strip a header value's surrounding whitespace): two ids for one name.
    Every id field refuses it now, INVALID_ARGUMENT (HTTP 400) naming the field, and the OpenAPI document's id
    pattern says so; an id with a space inside is still an id, and a header's framing whitespace is still not
    part of its value."""
    import re

    import grpc
    import jsonschema

    from switchyard.api import agent_pb2
    from switchyard.common.errors import InvalidArgument
    from switchyard.common.untrusted import ID_PATTERN, check_id_chars

    assert re.search(ID_PATTERN, sent) is None and re.search(ID_PATTERN, "t 1") is not None
    with pytest.raises(InvalidArgument):
        check_id_chars(sent, "id")
    async with http_stack() as (client, stub, down):
        for field in ("task_id", "agent_id"):
            body = {**FIELD_BODY, "agent_id": "a1", field: sent}
            reply = await client.post("/api/v1/agent/submit", json=body)
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]["message"]
            assert message.startswith(f"{field}: expected an id of printable characters with no space at its start "
                                      "or end"), message
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat",
                                                               **{"agent_id": "a1", field: sent}))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(f"{field}: expected an id of printable characters with no "
                                                      "space"), refused.value.details()
        lookup = await client.get(f"/api/v1/tasks/{sent.replace(' ', '%20')}")
        assert lookup.status_code == 400 and "task_id" in lookup.text, lookup.text
        # a header's surrounding whitespace is framing, not the id's: the task's agent is 'a1'
        accepted = await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                                         metadata=(("x-agent-id", f" a1{sent.strip()} "),))
        status = await client.get(f"/api/v1/agent/a1{sent.strip()}/status")
        assert status.status_code == 200 and status.json()["task_id"] == accepted.task_id, status.text
        schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]["TaskRequest"]["properties"]
        for field in ("task_id", "agent_id"):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(sent, schemas[field])


async def test_an_id_the_openapi_document_calls_valid_is_not_refused_as_malformed():
    """schemathesis, run on /openapi.json, sent ids the document's ``{"type": "string"}`` took ('\\t),øü$Y',
    'Up÷Ñ£9B\\x8d\\x8c') and the face refused 400: a schema-driven client could not tell a valid id. The document
    now bounds every id (length, pattern); what it takes, the face does not refuse as malformed."""
    import jsonschema

    async with http_stack() as (client, _, _down):
        doc = (await client.get("/openapi.json")).json()
        paths, body = doc["paths"], doc["components"]["schemas"]["TaskRequest"]["properties"]
        schemas = {"agent": paths["/api/v1/agent/{agent_id}/status"]["get"]["parameters"][0]["schema"],
                   "task": paths["/api/v1/tasks/{task_id}"]["get"]["parameters"][0]["schema"],
                   "cancel": paths["/api/v1/tasks/{task_id}/cancel"]["post"]["parameters"][0]["schema"]}
        assert body["agent_id"]["maxLength"] == 256 and body["task_id"]["maxLength"] == 128
        for sent in ("\t),øü$Y", "ô\x13:6", "Up÷Ñ£9B\x8d\x8c", "a\u200bb", "   ", "x" * 300):
            for name, schema in schemas.items():
                with pytest.raises(jsonschema.ValidationError):
                    jsonschema.validate(sent, schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(sent, body["agent_id"])
        for valid in ("agent é 1", "t-1", "工作-7", "a" * 128):
            for name, schema in schemas.items():
                jsonschema.validate(valid, schema)
            path = {"agent": f"/api/v1/agent/{valid}/status", "task": f"/api/v1/tasks/{valid}"}
            for name, url in path.items():
                reply = await client.get(url)
                assert reply.status_code == 404, (valid, reply.text)  # not found, not malformed


async def test_each_event_of_a_stream_is_what_the_openapi_document_says_an_event_is():
    """schemathesis reads a text/event-stream schema as each event's (OpenAPI 3.2's itemSchema): the document's
    ``{"type": "string"}`` failed every event ('SSE event violates schema')."""
    import jsonschema

    async with http_stack() as (client, _, _down):
        doc = (await client.get("/openapi.json")).json()
        schema = doc["paths"]["/api/v1/agent/run"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        async with aconnect_sse(client, "POST", "/api/v1/agent/run", json=CHAT) as source:
            events = [{"event": e.event, "id": e.id, "data": e.data} async for e in source.aiter_sse()]
        assert events[-1]["event"] == "final"
        for event in events:
            jsonschema.validate(event, schema)
            assert isinstance(json.loads(event["data"]), dict)
        reply = await client.get("/api/v1/tasks/nope", headers={"X-Tenant-Id": ""})  # empty: the default tenant
        jsonschema.validate("", doc["paths"]["/api/v1/tasks/{task_id}"]["get"]["parameters"][1]["schema"])
        assert reply.status_code == 404, reply.text


async def test_an_http_load_balancer_reads_readiness_from_readyz_as_grpc_health_answers_it():
    """An HTTP load balancer or probe (an ALB or GCE target group, nginx's upstream check, a compose healthcheck
    with curl) cannot ask grpc.health.v1, and the HTTP face answered 404 on every path it might ask. /healthz
    answers liveness, /readyz readiness as the orchestrator's gRPC health name agent.AgentService does: 503
    naming the service that did not answer while the default workflow cannot run."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from test_orchestrator import Downstream

    from switchyard.common.channels import open_channel
    from switchyard.common.config import load_config
    from switchyard.common.server import running
    from switchyard.orchestrator.http_face import HttpFace
    from switchyard.orchestrator.service import OrchestratorService
    from orchestrator_fixtures import orchestrator_config

    base = load_config("config", service="orchestrator")
    down = Downstream()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base, **{"orchestrator.health_check_interval_s": 0.05}) as cfg:
            orch = OrchestratorService(cfg)
            face = HttpFace(orch, cfg, port=0)
            async with running([orch, face], cfg.server) as srv, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=10) as client:
                health = health_pb2_grpc.HealthStub(channel := open_channel(f"127.0.0.1:{srv.port}", cfg.server))

                async def grpc_says() -> int:
                    return (await health.Check(health_pb2.HealthCheckRequest(service="agent.AgentService"))).status

                async def settled(code: int, status: int) -> httpx.Response:
                    for _ in range(500):
                        reply = await client.get("/readyz")
                        if reply.status_code == code and await grpc_says() == status:
                            return reply
                        await asyncio.sleep(0.02)
                    raise AssertionError(f"/readyz never answered {code}: {reply.text}")

                assert (await client.get("/healthz")).json() == {"status": "serving"}
                assert (await settled(200, health_pb2.HealthCheckResponse.SERVING)).json() == {"status": "serving"}
                for name in down.grpc_service_names:  # the dispatcher and retrieval stop answering SERVING
                    await downstream.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
                refused = await settled(503, health_pb2.HealthCheckResponse.NOT_SERVING)
                error = refused.json()["error"]
                # the service named, its address hidden, as in every error a caller reads
                assert error["code"] == "UNAVAILABLE" and addr not in error["message"], error
                assert HIDDEN in error["message"], error
                assert refused.headers["Retry-After"] == "1"
                assert (await client.get("/healthz")).status_code == 200  # alive, not ready
                head = await client.head("/readyz")
                assert head.status_code == 503 and head.content == b""
                for name in down.grpc_service_names:
                    await downstream.health.set(name, health_pb2.HealthCheckResponse.SERVING)
                await settled(200, health_pb2.HealthCheckResponse.SERVING)
                await channel.close()


async def test_the_keepalive_timer_waits_a_period_while_a_write_waits_for_a_slow_reader():
    """A client that reads slower than the stream is written (the socket's buffers full: an event's write waits for
    the client to read) leaves the stream quiet past orchestrator.http.sse_keepalive_s while no keepalive may be
    written. The timer re-armed itself with no delay then, and ran on every turn of the event loop until the
    write went out: the orchestrator's loop spun for every such client. It checks again a period later."""
    from aiohttp import web

    from switchyard.orchestrator.http_face import _KeepAlive

    every_s, ticks = 0.02, 0
    measured: asyncio.Future[tuple[int, float, bool]] = asyncio.get_running_loop().create_future()

    class Counted(_KeepAlive):
        def _tick(self) -> None:
            nonlocal ticks
            ticks += 1
            super()._tick()

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal ticks
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        quiet = Counted(response, every_s)
        writing = asyncio.create_task(quiet.write(b"data: x\n\n" * 2_000_000))  # 18 MB: past every socket buffer
        try:
            await asyncio.sleep(5 * every_s)  # the stream is quiet past the period while the write waits
            loop = asyncio.get_running_loop()
            ticks, started = 0, loop.time()
            await asyncio.sleep(10 * every_s)
            measured.set_result((ticks, loop.time() - started, writing.done()))
        finally:
            writing.cancel()
            await quiet.stop()
        return response

    app = web.Application()
    app.router.add_post("/run", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")  # and never read the answer
        ticks_seen, elapsed_s, written = await asyncio.wait_for(measured, 30)
    finally:
        writer.close()
        await runner.cleanup()
    assert not written, "the write was not held back by the reader: nothing measured"
    assert ticks_seen <= elapsed_s / every_s + 3, f"{ticks_seen} timer runs in {elapsed_s:.2f} s"


@pytest.mark.parametrize("default_task_type", ["react_loop", "rag_answer", "chat"])
async def test_readyz_answers_what_grpc_health_answers_for_every_default_workflow(default_task_type):
    """/readyz and the gRPC health name agent.AgentService are one rule: with retrieval not answering SERVING, an
    orchestrator whose default workflow is react_loop was NOT_SERVING over gRPC (its readiness needs retrieval)
    and 200 on /readyz (which read the rule for refusing a task at once, which does not): an HTTP load balancer
    sent tasks to the replica a gRPC probe had taken out."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from test_orchestrator import Downstream

    from switchyard.common.channels import open_channel
    from switchyard.common.config import load_config
    from switchyard.common.server import running
    from switchyard.orchestrator.http_face import HttpFace
    from switchyard.orchestrator.service import OrchestratorService
    from orchestrator_fixtures import orchestrator_config

    base = load_config("config", service="orchestrator")
    down = Downstream()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        await downstream.health.set("agent.RetrievalService", health_pb2.HealthCheckResponse.NOT_SERVING)
        with orchestrator_config(addr, addr, base, **{"orchestrator.health_check_interval_s": 0.05,
                                                      "orchestrator.default_task_type": default_task_type}) as cfg:
            orch = OrchestratorService(cfg)
            face = HttpFace(orch, cfg, port=0)
            async with running([orch, face], cfg.server) as srv, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=10) as client:
                channel = open_channel(f"127.0.0.1:{srv.port}", cfg.server)
                try:
                    grpc_says = (await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="agent.AgentService"))).status
                    reply = await client.get("/readyz")
                finally:
                    await channel.close()
    serving = grpc_says == health_pb2.HealthCheckResponse.SERVING
    assert serving == (default_task_type == "chat")  # rag_answer and react_loop need retrieval (readiness.NEEDS)
    assert reply.status_code == (200 if serving else 503), (default_task_type, reply.text)
    if not serving:
        assert "retrieval" in reply.json()["error"]["message"], reply.text


async def test_readyz_is_not_ready_while_the_first_health_round_runs():
    """The HTTP face serves before the orchestrator's first round of downstream health checks has ended (a
    dispatcher that does not answer holds that round for orchestrator.health_check_timeout_s). Every gRPC health
    name is NOT_SERVING then; /readyz answered 200."""
    from test_orchestrator import Downstream

    from switchyard.common.config import load_config
    from switchyard.common.server import running
    from switchyard.orchestrator.http_face import HttpFace
    from switchyard.orchestrator.service import OrchestratorService
    from orchestrator_fixtures import orchestrator_config

    answered = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # a dispatcher that accepts and never answers (SIGSTOP'd), until /readyz has answered: then its
        # connection closes and the round ends at once, not at the timeout (which only bounds a failed run)
        await answered.wait()
        writer.close()

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    silent_addr = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    base = load_config("config", service="orchestrator")
    down = Downstream()
    async with running([down], base.server) as downstream:
        retrieval = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(retrieval, silent_addr, base, **{"orchestrator.default_task_type": "chat",
                                                                  "orchestrator.health_check_timeout_s": 30.0}) as cfg:
            orch = OrchestratorService(cfg)
            face = HttpFace(orch, cfg, port=0)
            serving = running([orch, face], cfg.server)
            starting = asyncio.create_task(serving.__aenter__())
            try:
                while face.port == 0 or orch.readiness is None:  # the face serves; the first round runs
                    assert not starting.done(), starting
                    await asyncio.sleep(0.01)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=10) as client:
                    reply = await client.get("/readyz")
                first_round_ran = not starting.done()
            finally:
                answered.set()
                await starting
                await serving.__aexit__(None, None, None)
    silent.close()
    assert first_round_ran, "the first round ended before /readyz was asked: nothing measured"
    assert reply.status_code == 503 and "starting" in reply.json()["error"]["message"], reply.text
