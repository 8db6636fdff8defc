"""Clients that stop reading without closing: a RunTask stream's writes wait for them, and were not bounded. Over
HTTP (a raw socket that reads the first bytes of an SSE stream, then nothing) and over gRPC (a stub that reads the
first event, then nothing), against the real servers on 127.0.0.1 port 0 and the fixed downstream of
test_orchestrator.py, its answer long enough to fill the sockets' buffers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl

import grpc
import pytest
from prometheus_client import REGISTRY
from test_http_face import FIELD_BODY, http_stack, pki  # noqa: F401 - pki: a fixture

from switchyard.api import agent_pb2

pytestmark = pytest.mark.no_gpu

LONG_ANSWER = ["x" * 32768] * 3000
"""96 MiB of tokens: past every buffer between the orchestrator and its client (a socket's send buffer grows to
4 MiB), and far longer than the tests run, so the task is still running when its writes stall."""


def _write_timeouts(edge: str) -> float:
    return REGISTRY.get_sample_value("switchyard_client_write_timeouts_total", {"edge": edge}) or 0.0


def _tasks_ended(code: str) -> float:
    return REGISTRY.get_sample_value("switchyard_tasks_total", {"task_type": "chat", "code": code}) or 0.0


async def _until(condition, what: str) -> None:
    for _ in range(1200):  # a bound on the wait only, never on how soon: 60 s
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def test_an_sse_client_that_stops_reading_is_cut_and_its_task_cancelled():
    """A client of POST /api/v1/agent/run that read the first bytes and then nothing (its socket open) held the
    handler, the stream and the task: once the buffers filled, the write waited without end, and so did every
    keepalive. Each write now waits orchestrator.http.write_timeout_s at most; then the connection is aborted and
    the task cancelled, as when a client leaves."""
    async with http_stack(**{"orchestrator.http.write_timeout_s": 0.5}) as (client, _, down):
        down.words, down.token_gap_s = LONG_ANSWER, 0.002
        cut, cancelled = _write_timeouts("http"), _tasks_ended("CANCELLED")
        loop = asyncio.get_running_loop()
        body = json.dumps({**FIELD_BODY, "task_type": "chat"}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the stall comes sooner
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", client.base_url.port))
            await loop.sock_sendall(sock, b"POST /api/v1/agent/run HTTP/1.1\r\nHost: face\r\nContent-Type: "
                                          b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            head = await loop.sock_recv(sock, 1024)  # the answer's first bytes; then the client reads no more
            assert head.startswith(b"HTTP/1.1 200 OK"), head
            await _until(lambda: _write_timeouts("http") > cut, "the stalled write was cut")
            await _until(lambda: _tasks_ended("CANCELLED") > cancelled, "the task was cancelled")
            read = head
            with contextlib.suppress(ConnectionResetError):  # the face's unsent bytes are dropped: the stream
                while chunk := await loop.sock_recv(sock, 1 << 20):  # ends where the kernel's buffers end
                    read += chunk
            assert b"event: token" in read and b"event: final" not in read
        # the face serves on
        reply = await client.get("/healthz")
        assert reply.status_code == 200


async def test_an_sse_client_over_tls_that_stops_reading_is_cut_as_well(pki):
    """The same over TLS (server.tls): the TLS layer's buffer fills and pauses the face's writes as the socket's
    does, and the bound cuts them the same way."""
    verify = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    tls = {"enabled": True, "require_client_auth": False, "cert_file": str(pki / "cert.pem"),
           "key_file": str(pki / "key.pem"), "ca_file": str(pki / "ca.pem")}
    async with http_stack({"verify": verify}, **{"server.tls": tls, "orchestrator.http.write_timeout_s": 0.5}) as (
            client, _, down):
        down.words, down.token_gap_s = LONG_ANSWER, 0.002
        cut, cancelled = _write_timeouts("http"), _tasks_ended("CANCELLED")
        body = json.dumps({**FIELD_BODY, "task_type": "chat"}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", client.base_url.port))
        reader, writer = await asyncio.open_connection(sock=sock, ssl=verify, server_hostname="127.0.0.1")
        writer.write(b"POST /api/v1/agent/run HTTP/1.1\r\nHost: face\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert (await reader.readline()).startswith(b"HTTP/1.1 200 OK")  # then the client reads no more
        await _until(lambda: _write_timeouts("http") > cut, "the stalled write was cut")
        await _until(lambda: _tasks_ended("CANCELLED") > cancelled, "the task was cancelled")
        writer.transport.abort()
        assert (await client.get("/healthz")).status_code == 200


async def test_an_sse_client_that_pauses_within_the_bound_reads_the_whole_stream():
    """The bound is on one write that waits, not on a stream's length: a reader that pauses (its buffers fill)
    and reads on within orchestrator.http.write_timeout_s reads every event to the final one."""
    async with http_stack(**{"orchestrator.http.write_timeout_s": 30.0}) as (client, _, down):
        down.words = ["x" * 32768] * 200  # 6 MiB: the buffers fill while the reader pauses
        cut = _write_timeouts("http")
        loop = asyncio.get_running_loop()
        body = json.dumps({**FIELD_BODY, "task_type": "chat"}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", client.base_url.port))
            await loop.sock_sendall(sock, b"POST /api/v1/agent/run HTTP/1.1\r\nHost: face\r\nContent-Type: "
                                          b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                    % (len(body), body))
            read = await loop.sock_recv(sock, 1024)
            while not down.requests:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # a pause, far within the bound
            while chunk := await loop.sock_recv(sock, 1 << 20):
                read += chunk
        assert b"event: final" in read and _write_timeouts("http") == cut


async def test_a_client_that_stops_reading_a_large_json_answer_is_cut_too():
    """The bound is on every write of the face, not on SSE alone: a status answer of megabytes (a finished task's
    result) to a client that reads nothing held its connection; it is aborted after the same wait."""
    async with http_stack(**{"orchestrator.http.write_timeout_s": 0.5}) as (client, _, down):
        down.words = ["x" * 32768] * 300  # a result of 9 MiB: past the sockets' buffers
        accepted = (await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "task_type": "chat"})).json()
        for _ in range(1200):
            if (await client.get(f"/api/v1/tasks/{accepted['task_id']}")).json()["state"] == "finished":
                break
            await asyncio.sleep(0.05)
        cut = _write_timeouts("http")
        loop = asyncio.get_running_loop()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", client.base_url.port))
            await loop.sock_sendall(sock, b"GET /api/v1/tasks/%s HTTP/1.1\r\nHost: face\r\n\r\n"
                                    % accepted["task_id"].encode())
            await _until(lambda: _write_timeouts("http") > cut, "the stalled write was cut")
            read = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await loop.sock_recv(sock, 1 << 20):
                    read += chunk
            head, _, body = read.partition(b"\r\n\r\n")
            promised = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                if line.lower().startswith(b"content-length:")))
            assert head.startswith(b"HTTP/1.1 200") and len(body) < promised  # cut short, then closed
        assert (await client.get("/healthz")).status_code == 200


async def test_a_grpc_caller_that_stops_reading_has_its_task_cancelled_and_reads_why_after_its_events():
    """The same over gRPC: a RunTask caller that read the first event, then nothing (no deadline, no cancel), held
    the call and its unsent events without end once its flow-control window filled. Each write now waits
    orchestrator.grpc_stream_write_timeout_s at most; then the task is cancelled and the status is sent after the
    events already written, naming the key."""
    async with http_stack(**{"orchestrator.grpc_stream_write_timeout_s": 0.5}) as (_, stub, down):
        down.words, down.token_gap_s = LONG_ANSWER, 0.002
        cut, cancelled = _write_timeouts("grpc"), _tasks_ended("CANCELLED")
        call = stub.RunTask(agent_pb2.RunTaskRequest(agent_id="stalled", task_type="chat", payload="hi"))
        assert (await call.read()).HasField("accepted")
        await _until(lambda: _write_timeouts("grpc") > cut, "the stalled write was cut")
        await _until(lambda: _tasks_ended("CANCELLED") > cancelled, "the task was cancelled")
        kinds = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (event := await call.read()) is not grpc.aio.EOF:
                kinds.append(event.WhichOneof("event"))
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "orchestrator.grpc_stream_write_timeout_s" in ended.value.details()
        assert "token" in kinds and "final" not in kinds


async def test_a_grpc_caller_that_reads_slowly_but_steadily_reads_the_whole_stream():
    """The bound is on a write that waits, not on a stream's length: a caller that pauses, then reads on, within
    the bound, reads every event to the final one."""
    async with http_stack(**{"orchestrator.grpc_stream_write_timeout_s": 30.0}) as (_, stub, down):
        down.words = ["x" * 32768] * 200  # 6 MiB: the caller's window fills while it pauses
        call = stub.RunTask(agent_pb2.RunTaskRequest(agent_id="slow", task_type="chat", payload="hi"))
        assert (await call.read()).HasField("accepted")
        while not down.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # a pause, far within the bound
        kinds = []
        while (event := await call.read()) is not grpc.aio.EOF:
            kinds.append(event.WhichOneof("event"))
        assert kinds[-1] == "final", kinds[-3:]


def test_the_grpc_edge_serves_every_agent_service_method():
    """The server serves AgentService through GrpcEdge, which lists the servicer's methods it passes on: a method
    added to the proto and not to GrpcEdge would be served as grpc's UNIMPLEMENTED stub, silently."""
    from types import SimpleNamespace

    from switchyard.orchestrator.service import GrpcEdge

    names = [m.name for m in agent_pb2.DESCRIPTOR.services_by_name["AgentService"].methods]
    service = SimpleNamespace(**{name: object() for name in names})
    edge = GrpcEdge(service)
    served = {name for name in names if name in vars(edge) or name in vars(GrpcEdge)}
    assert served == set(names), f"not passed on by GrpcEdge: {sorted(set(names) - served)}"
