"""The HTTP face's connections as HTTP/1.1 clients use them: several requests on one keep-alive connection, some
malformed, sent one after another or pipelined in one write, and every error answer the face or aiohttp under it
can make, each in the face's error shape ``{"error": {"code", "message", "origin"}}``. Raw sockets against the
real aiohttp server on 127.0.0.1 port 0 (httpx would not send the malformed bytes)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_http_face import FIELD_BODY, http_stack

from switchyard.orchestrator.http_face import HttpFace

pytestmark = pytest.mark.no_gpu

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: face\r\n\r\n"


def _post(path: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: face\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (path, content_type, len(body), body))


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer off the connection: status, headers (names lower-case), body (by its Content-Length)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((name.strip().lower(), value.strip()) for name, _, value in
                   (line.partition(":") for line in lines[1:] if line))
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout=30)
    return int(lines[0].split()[1]), headers, body


def _error_of(status: int, headers: dict[str, str], body: bytes) -> dict[str, str]:
    """The error of an answer in the face's shape: JSON, and ``code``, ``message`` and ``origin`` only."""
    assert headers["content-type"].startswith("application/json"), (status, headers, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"code", "message", "origin"} and error["origin"] == "orchestrator", error
    return error


async def _at_eof(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), timeout=30) == b""


async def test_a_keep_alive_connection_answers_each_bad_request_in_the_error_shape_and_serves_on():
    """One connection, requests sent one after another (an HTTP/1.1 client's keep-alive pool): each body the face
    refuses gets its 4xx in the error shape, and the next request on the connection is served."""
    async with http_stack() as (client, _, down):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        sequence = [
            (HEALTHZ, 200, None),
            (_post(b"/api/v1/agent/submit", b"{not json"), 400, "body: expected a JSON object"),
            (_post(b"/api/v1/agent/run", json.dumps({**FIELD_BODY, "priority": "urgent"}).encode()), 400, "priority"),
            (_post(b"/api/v1/agent/submit", b"{}", b"text/plain"), 415, "Content-Type: expected application/json"),
            (b"GET /api/v1/nothing HTTP/1.1\r\nHost: face\r\n\r\n", 404, "path: no route"),
            (b"DELETE /healthz HTTP/1.1\r\nHost: face\r\n\r\n", 405, "method: DELETE"),
            (_post(b"/healthz", b"{}"), 405, "method: POST"),  # a body on a route that reads none: skipped
            (HEALTHZ, 200, None),
        ]
        for request, status, message in sequence:
            writer.write(request)
            got, headers, body = await _answer(reader)
            assert got == status, (request[:40], got, body[:200])
            if message is not None:
                assert _error_of(got, headers, body)["message"].startswith(message)
                assert headers.get("connection", "").lower() != "close"
        writer.close()
        assert down.requests == []


async def test_pipelined_requests_are_answered_in_order_with_the_bad_ones_in_the_error_shape():
    """The same requests written at once (pipelined): each answered, in order, the refused ones in the error shape,
    the good ones served."""
    async with http_stack() as (client, _, down):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(HEALTHZ + _post(b"/api/v1/agent/submit", b"{not json") + _post(b"/api/v1/agent/submit", b"[1]")
                     + b"GET /api/v1/tasks/none HTTP/1.1\r\nHost: face\r\n\r\n" + HEALTHZ)
        statuses = []
        for _ in range(5):
            status, headers, body = await _answer(reader)
            statuses.append(status)
            if status != 200:
                _error_of(status, headers, body)
        assert statuses == [200, 400, 400, 404, 200]
        writer.close()


@pytest.mark.parametrize("malformed, message", [
    (b"GET /healthz HTTP/1.1\r\nHost: face\r\nBad Header\r\n\r\n", "request: not a well-formed"),
    (b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: face\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\n{}", "request: not a well-formed"),  # two lengths: where does the next one start?
    (b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: face\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "request: not a well-formed"),  # smuggling's shape
    (b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: face\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n", "request: not a well-formed"),
    (b"GET /healthz HTTP/1.1\r\nHost: face\r\nX-Agent-Id: \x01\r\n\r\n", "request: not a well-formed"),
    (b"GARBAGE\r\n\r\n", "request: not a well-formed"),
])
async def test_a_malformed_request_after_a_good_one_is_a_400_in_the_error_shape_and_the_connection_closes(
        malformed, message):
    """A request the parser refuses, second on a keep-alive connection: 400 in the error shape, and the connection
    closed (where a malformed request ends cannot be known, so nothing after it is read as a request); never a
    connection left waiting. Sent after the first answer was read, the first is answered 200."""
    async with http_stack() as (client, _, down):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(HEALTHZ)
        assert (await _answer(reader))[0] == 200
        writer.write(malformed + HEALTHZ)
        status, headers, body = await _answer(reader)
        assert status == 400 and _error_of(status, headers, body)["message"].startswith(message), body[:300]
        assert headers["connection"].lower() == "close" and await _at_eof(reader)
        writer.close()
        assert down.requests == []


async def test_a_malformed_request_pipelined_behind_a_good_one_ends_the_connection_with_the_error_shape():
    """Written in the same segment as the good request before it, the malformed one makes aiohttp's parser drop
    what it read of that write (the good request too): the connection gets the 400 in the error shape and closes,
    and the good request is not run (an HTTP/1.1 client resends a request left unanswered on a closed
    connection). Never a connection left waiting."""
    async with http_stack() as (client, _, down):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(_post(b"/api/v1/agent/submit", json.dumps({**FIELD_BODY, "task_id": "piped"}).encode())
                     + b"GET /healthz HTTP/1.1\r\nHost: face\r\nBad Header\r\n\r\n")
        answers = []
        while not reader.at_eof():
            try:
                answers.append(await _answer(reader))
            except asyncio.IncompleteReadError as end:
                assert end.partial == b""
                break
        status, headers, body = answers[-1]
        assert status == 400 and _error_of(status, headers, body)["message"].startswith("request: not a well-formed")
        assert [a[0] for a in answers] in ([400], [200, 400])  # [200, 400] once aiohttp keeps what it read
        writer.close()


async def test_a_body_past_the_cap_is_413_in_the_error_shape_and_the_connection_closes_after_it():
    """client_max_size's refusal, a body sent whole (Content-Length, and chunked: counted as it comes): 413 in the
    face's error shape, never aiohttp's text/plain; ``Connection: close`` (the face reads no more of it), and the
    client reads the answer before the close."""
    async with http_stack() as (client, _, down):
        port = client.base_url.port
        big = json.dumps({**FIELD_BODY, "payload": "x" * 3_000_000}).encode()
        chunked = (b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: face\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
                       b"%x\r\n%s\r\n" % (len(big[i:i + 65536]), big[i:i + 65536]) for i in range(0, len(big), 65536))
                   + b"0\r\n\r\n")
        for request in (_post(b"/api/v1/agent/submit", big), chunked):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEALTHZ)
            assert (await _answer(reader))[0] == 200
            writer.write(request + HEALTHZ)
            status, headers, body = await _answer(reader)
            assert status == 413, body[:300]
            assert _error_of(status, headers, body)["message"].startswith("body: expected at most")
            assert headers["connection"].lower() == "close" and await _at_eof(reader)
            writer.close()
        assert down.requests == []


async def test_a_handlers_fault_and_timeout_answer_500_and_504_in_the_error_shape(monkeypatch, caplog):
    """What aiohttp itself answers when a handler raises (500) or lets a TimeoutError out (504) was text/plain
    ("500 Internal Server Error\\n\\nServer got itself in trouble"), or HTML for a browser: now the error shape,
    the fault logged with its traceback on the server, none of it sent to the client."""
    async def fails(self, request):
        raise RuntimeError("a secret detail")

    async def times_out(self, request):
        raise TimeoutError

    for handler, status, code in ((fails, 500, "INTERNAL"), (times_out, 504, "DEADLINE_EXCEEDED")):
        monkeypatch.setattr(HttpFace, "healthz", handler)  # a fault the face's own code does not make
        async with http_stack() as (client, _, _down):
            # a browser's Accept (aiohttp answered it an HTML page): it takes JSON too, through */*
            for accept in ("*/*", "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"):
                reply = await client.get("/healthz", headers={"Accept": accept})
                assert reply.status_code == status and reply.headers["content-type"].startswith("application/json")
                error = reply.json()["error"]
                assert error["code"] == code and "secret" not in error["message"], error
    assert any(r.exc_info and "a secret detail" in str(r.exc_info[1]) for r in caplog.records)
