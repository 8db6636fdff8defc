"""The orchestrator's HTTP face against the fixed downstream of test_orchestrator.py: real aiohttp server on
127.0.0.1 port 0 beside the real gRPC server, real HTTP client (httpx, SSE parsed by httpx-sse)."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import threading
import re

import grpc
import httpx
import jsonschema
import pytest
from httpx_sse import aconnect_sse
from test_orchestrator import Downstream

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.server import running, start_server
from switchyard.orchestrator.http_face import JSON, HttpFace
from switchyard.orchestrator.service import OrchestratorService
from orchestrator_fixtures import orchestrator_config

pytestmark = pytest.mark.no_gpu

FIELD_BODY = {"agent_id": "test-001", "priority": "core", "task_type": "react_loop", "max_tokens": 128}
"""The body of the field's curl submit command, as written."""


@contextlib.asynccontextmanager
async def http_stack(client_options: dict | None = None, tracer_provider=None, **overrides):
    """(httpx client on the HTTP face, gRPC stub, downstream) of one orchestrator serving both faces;
    ``server.tls`` in ``overrides`` applies to the downstream too, ``client_options`` to the httpx client,
    ``tracer_provider`` to the HTTP face's spans."""
    base = load_config("config", service="orchestrator")
    if "server.tls" in overrides:
        base = base.with_overrides(**{"server.tls": overrides.pop("server.tls")})
    scheme = "https" if base.server.tls.enabled else "http"
    down = Downstream()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base, **overrides) as cfg:
            orch = OrchestratorService(cfg)
            face = HttpFace(orch, cfg, port=0, tracer_provider=tracer_provider)
            async with running([orch, face], cfg.server) as srv:
                down.orchestrator_address = f"127.0.0.1:{srv.port}"
                channel = open_channel(f"127.0.0.1:{srv.port}", cfg.server)
                async with httpx.AsyncClient(base_url=f"{scheme}://127.0.0.1:{face.port}", timeout=30,
                                             **(client_options or {})) as client:
                    try:
                        yield client, agent_pb2_grpc.AgentServiceStub(channel), down
                    finally:
                        await channel.close()


async def finished(client: httpx.AsyncClient, path: str) -> dict:
    for _ in range(500):
        reply = await client.get(path)
        assert reply.status_code == 200, reply.text
        if reply.json()["state"] in ("finished", "failed"):
            return reply.json()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} never finished: {reply.json()}")


async def test_the_fields_submit_and_status_commands_answer_as_the_field_reads_them():
    async with http_stack() as (client, stub, down):
        reply = await client.post("/api/v1/agent/submit", json=FIELD_BODY)
        assert reply.status_code == 200, reply.text
        accepted = reply.json()
        assert accepted["status"] == "accepted" and accepted["queue_position"] >= 0 and accepted["task_id"]
        status = await finished(client, "/api/v1/agent/test-001/status")
        assert status["task_id"] == accepted["task_id"] and status["state"] == "finished"
        # The downstream's GenerateDone, 0.5 per model call, summed over the loop's calls (two tools, then the answer).
        assert len(down.requests) == 3 and status["compute_score_used"] == 1.5
        assert status["memory_peak_bytes"] == 1000 and status["memory_peak_mb"] == 1000 / 2**20
        assert status["result"]["output"] == "The answer." and status["timings"]["total_s"] > 0
        # a figure has one type wherever it is answered: protobuf's JSON writes int64 as a string, the face does not
        assert status["result"]["memory_peak_bytes"] == 1000 and status["result"]["usage"]["total_tokens"] > 0
        by_id = (await client.get(f"/api/v1/tasks/{accepted['task_id']}")).json()
        assert by_id["state"] == "finished" and by_id["result"] == status["result"]
        # The same task over gRPC: one store, one path.
        grpc_status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(agent_id="test-001"))
        assert grpc_status.task_id == accepted["task_id"] and grpc_status.state == agent_pb2.SUCCEEDED
        request = down.requests[0]
        assert request.agent_id == "test-001" and request.priority == agent_pb2.CORE
        assert request.task_type == "react_loop" and request.max_tokens == 128


async def test_answers_match_the_generated_openapi_document():
    async with http_stack() as (client, _, _down):
        doc = (await client.get("/openapi.json")).json()
        assert doc["openapi"].startswith("3.") and "/api/v1/agent/{agent_id}/status" in doc["paths"]
        schemas = doc["components"]["schemas"]
        assert doc["security"] == [{"bearer": []}, {}]  # a generated client sends a token where it has one

        def check(instance: dict, name: str) -> None:
            jsonschema.validate(instance, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})

        assert set(schemas["TaskRequest"]["properties"]) >= {"agent_id", "priority", "task_type", "max_tokens"}
        assert schemas["TaskRequest"]["properties"]["max_tokens"]["minimum"] == 0  # what a caller may send
        accepted = (await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "task_type": "chat"})).json()
        check(accepted, "AcceptedResponse")
        check(await finished(client, f"/api/v1/tasks/{accepted['task_id']}"), "TaskStatusResponse")
        check((await client.get("/api/v1/tasks/nope")).json(), "ErrorResponse")


@pytest.mark.parametrize(("body", "field"), [
    ({**FIELD_BODY, "max_tokens": "many"}, "max_tokens"),
    ({**FIELD_BODY, "priority": "urgent"}, "priority"),
    ({**FIELD_BODY, "max_tokens": 10**9}, "max_tokens"),  # past limits.max_tokens: the servicer's own check
    ({**FIELD_BODY, "task_type": "poem"}, "task_type"),
    ({**FIELD_BODY, "payload": "   "}, "payload"),
    ({**FIELD_BODY, "colour": "red"}, "colour"),
    (["not", "an", "object"], "body"),
])
async def test_a_bad_body_is_400_naming_the_field(body, field):
    async with http_stack() as (client, _, down):
        for path in ("/api/v1/agent/submit", "/api/v1/agent/run"):
            reply = await client.post(path, json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith(field), error
            assert error["origin"] == "orchestrator"
        not_json = await client.post("/api/v1/agent/submit", content=b"{not json", headers={"Content-Type": JSON})
        assert not_json.status_code == 400 and not_json.json()["error"]["message"].startswith("body: expected a JSON")
        assert down.requests == []


async def test_a_body_not_in_utf8_is_400_saying_so():
    """A stray byte read 'invalid unicode code point at line 1 column 15', a UTF-16 body 'expected value at line 1
    column 1': neither said the body is not UTF-8, as an X-Agent-Id header's byte is told."""
    text = '{"agent_id":"a","task_type":"chat","payload":"caf\u00e9"}'
    async with http_stack() as (client, _, down):
        for raw, says in ((text.encode("latin-1"), "byte 0xE9 at offset 49 is not UTF-8"),
                          (text.encode("utf-16"), "this body is UTF-16")):
            reply = await client.post("/api/v1/agent/submit", content=raw, headers={"Content-Type": JSON})
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]["message"]
            assert message.startswith("body: expected JSON in UTF-8 (RFC 8259 section 8.1): ") and says in message, \
                message
        assert down.requests == []


async def test_a_body_naming_a_key_twice_is_400_naming_it_as_a_header_sent_twice_is():
    """'"priority":"core","priority":"batch"' ran the task as batch: the last value won, unsaid."""
    async with http_stack() as (client, _, down):
        for raw, key in ((b'{"agent_id":"a","task_type":"chat","priority":"core","priority":"batch"}', "priority"),
                         (b'{"agent_id":"a","task_type":"chat","metadata":{"k":"1","k":"2"}}', "metadata.k")):
            reply = await client.post("/api/v1/agent/submit", content=raw, headers={"Content-Type": "application/json"})
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["message"].startswith(
                f"{key}: expected one value (the key appears more than once in its object)"), reply.text
        same = await client.post("/api/v1/agent/submit", headers={"Content-Type": "application/json"},
                                 content=b'{"agent_id":"a","task_type":"chat","priority":"core"}')
        assert same.status_code == 200, same.text
        assert len(down.requests) <= 1


@pytest.mark.parametrize(("body", "message"), [
    ({}, "task_type: expected one of rag_answer, chat, react_loop (required)"),
    ({"task_type": "chat"}, "agent_id: expected a non-empty string, the agent's id (or the X-Agent-Id header)"),
    ({**FIELD_BODY, "agent_id": ""}, "agent_id: expected a non-empty string"),
    ({**FIELD_BODY, "task_type": ""}, "task_type: expected one of rag_answer, chat, react_loop (got '')"),
    # one message for every wrong value (the gRPC edge's "empty = rag_answer" does not hold here)
    ({**FIELD_BODY, "task_type": "foo"}, "task_type: expected one of rag_answer, chat, react_loop (got 'foo')"),
    ({**FIELD_BODY, "max_tokens": "128"}, "max_tokens: expected an integer from 0 (the default, 128, at most half the model's context window) to "
                                           "the lesser of limits.max_tokens (8192) and the model's context window "
                                           "less the prompt's tokens (got '128')"),
    ({**FIELD_BODY, "max_tokens": 1.5}, "max_tokens: expected an integer"),
    ({**FIELD_BODY, "max_tokens": True}, "max_tokens: expected an integer"),
    # a wrong value of the right type gets the servicer's message, the gRPC edge's (one range, not two)
    ({**FIELD_BODY, "max_tokens": -1}, "max_tokens: expected 0 (the default, "),
    # past the wire's int32: the servicer's message too, with the same bound
    ({**FIELD_BODY, "max_tokens": 2**31}, "max_tokens: expected 0 (the default, 128) to "),
    ({**FIELD_BODY, "max_tokens": True}, "max_tokens: expected an integer from 0 (the default, 128, at most half the model's context window) to "
                                         "the lesser of limits.max_tokens (8192) and the model's context window "
                                         "less the prompt's tokens (got true)"),  # a value shown as JSON spells it
    ({**FIELD_BODY, "colour": "red"}, "colour: expected one of the body's fields (agent_id, "),
    ({**FIELD_BODY, "agent_id": 7}, "agent_id: expected a non-empty string, the agent's id (or the X-Agent-Id "
                                    "header) (got 7)"),
    ({**FIELD_BODY, "priority": "urgent"}, "priority: expected core, normal or batch (got 'urgent')"),
    ({**FIELD_BODY, "priority": "PRIORITY_CORE"},  # quoted as sent, not lower-cased
     "priority: expected core, normal or batch (got 'PRIORITY_CORE')"),
    ({**FIELD_BODY, "max_tokens": None}, "max_tokens: expected an integer from 0"),  # "(got null)" below
    ({**FIELD_BODY, "metadata": {"k": 1}}, "metadata.k: expected a string (got 1)"),
    ({**FIELD_BODY, "metadata": []}, "metadata: expected an object of string values (got [])"),
    ("text", "body: expected a JSON object (got 'a JSON string')"),
])
async def test_a_body_missing_a_required_field_or_of_a_wrong_type_is_400_saying_what_was_expected(body, message):
    async with http_stack() as (client, _, down):
        for path in ("/api/v1/agent/submit", "/api/v1/agent/run"):
            reply = await client.post(path, json=body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["message"].startswith(message), reply.json()
            if isinstance(body, dict) and body.get("max_tokens", 0) is None:  # null is shown, as any wrong type
                assert reply.json()["error"]["message"].endswith("(got null)"), reply.json()
        assert down.requests == []


@pytest.mark.parametrize("max_tokens", [-5, 1_000_000])
async def test_a_max_tokens_out_of_range_gets_the_grpc_edges_message(max_tokens):
    async with http_stack() as (client, stub, _down):
        over_http = (await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "max_tokens": max_tokens,
                                                                     "payload": "hi"})).json()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="react_loop",
                                                           max_tokens=max_tokens))
        assert over_http["error"]["message"] == err.value.details()


async def test_every_max_tokens_refusal_states_one_bound_and_names_max_tokens_beside_a_short_prompt():
    """Beside "hi" in sim-7b's 4096 tokens, 2**31 was refused "to 8192 (limits.max_tokens)", 8192 "to 4095" and
    4095 as "payload: expected a prompt of at most 1 tokens". One rule: 0 to the lesser of limits.max_tokens and
    the window less the prompt; every refusal states that bound and names max_tokens."""
    body = {"agent_id": "a1", "task_type": "chat", "payload": "hi"}
    async with http_stack() as (client, stub, down):
        doc = (await client.get("/openapi.json")).json()
        assert doc["components"]["schemas"]["TaskRequest"]["properties"]["max_tokens"]["maximum"] == 8192
        # it read "0: the default, tokens.", the default's name lost
        assert "0: the default, limits.default_max_tokens (at most half the model's context window)" in \
            doc["components"]["schemas"]["TaskRequest"]["properties"]["max_tokens"]["description"]
        bounds = set()
        for max_tokens in (2**31, 10**6, 8193, 8192, 4095, -1, -2**31 - 1):
            reply = await client.post("/api/v1/agent/submit", json={**body, "max_tokens": max_tokens})
            assert reply.status_code == 400, (max_tokens, reply.text)
            message = reply.json()["error"]["message"]
            found = re.match(r"max_tokens: expected 0 \(the default, 128\) to (\d+): the lesser of limits.max_tokens "
                             r"\(8192\) and the context window of sim-7b, 4096 tokens \(limits.context_window_tokens\), "
                             r"less the prompt's (\d+) tokens", message)
            assert found and message.endswith(f"(got {max_tokens})"), message
            assert int(found[1]) == 4096 - int(found[2])
            bounds.add(found[1])
            if -2**31 <= max_tokens < 2**31:  # the gRPC edge says the same
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(max_tokens=max_tokens, **body))
                assert err.value.details() == message
        assert len(bounds) == 1
        bound = int(bounds.pop())
        reply = await client.post("/api/v1/agent/submit", json={**body, "max_tokens": bound})
        assert reply.status_code == 200, reply.text  # the bound itself is taken
        assert all(r.max_tokens <= bound for r in down.requests)
        # beside a payload too long for the window too, a max_tokens out of range is named, as sent
        for max_tokens in (-5, 10**12):
            reply = await client.post("/api/v1/agent/submit", json={**body, "max_tokens": max_tokens,
                                                                     "payload": "word " * 30_000})
            message = reply.json()["error"]["message"]
            assert message.startswith("max_tokens: expected 0") and message.endswith(f"(got {max_tokens})"), message


async def test_the_priority_message_is_the_grpc_edges():
    async with http_stack() as (client, stub, _down):
        over_http = (await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "priority": "urgent"})).json()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi"), metadata=(("x-priority", "urgent"),))
        assert over_http["error"]["message"] == err.value.details().replace("x-priority header", "priority")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1", "application/json; charset=utf-16",
                                          "application/json; charset=", "application/json; charset=utf-8; charset=latin1"])
async def test_a_body_that_is_not_application_json_is_415_naming_the_expected_type(content_type):
    import json

    async with http_stack() as (client, _, down):
        headers = {} if content_type is None else {"Content-Type": content_type}
        for path in ("/api/v1/agent/submit", "/api/v1/agent/run"):
            # The field's own body, valid JSON: the type is what is refused.
            reply = await client.post(path, content=json.dumps(FIELD_BODY).encode(), headers=headers)
            assert reply.status_code == 415, reply.text
            error = reply.json()["error"]
            assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith(
                "Content-Type: expected application/json"), error
        charset = await client.post("/api/v1/agent/submit", content=json.dumps({**FIELD_BODY, "task_type": "chat"}),
                                    headers={"Content-Type": "application/json; charset=utf-8"})
        assert charset.status_code == 200, charset.text
        upper = await client.post("/api/v1/agent/submit", content=json.dumps({**FIELD_BODY, "task_type": "chat"}),
                                  headers={"Content-Type": "application/json; charset=UTF-8"})
        assert upper.status_code == 200, upper.text
        assert len(down.requests) <= 2  # the two accepted submits, once they run


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"x-custom, chunked", b"deflate,chunked"])
async def test_a_transfer_coding_other_than_chunked_is_501_naming_it_and_nothing_is_submitted(coding):
    """'Transfer-Encoding: gzip, chunked' was read as chunked with the gzip left undone, and its compressed bytes
    refused as a body that is not JSON, 400 (RFC 9112 section 6.1: a transfer coding not understood is 501)."""
    import gzip

    async with http_stack() as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        body = gzip.compress(json.dumps({**FIELD_BODY, "task_type": "chat"}).encode())
        for path in (b"/api/v1/agent/submit", b"/api/v1/agent/run"):
            answer = await _raw(port, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nTransfer-Encoding: " + coding + b"\r\n\r\n"
                                + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
            head, _, rest = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 501 "), answer[:300]
            error = json.loads(rest)["error"]
            assert error["code"] == "UNIMPLEMENTED"
            assert error["message"] == ("Transfer-Encoding: expected chunked alone (the one transfer coding this face "
                                        "reads; name a compressed body's coding in Content-Encoding) "
                                        f"(got {coding.decode()!r})"), error
        chunked = await _raw(port, b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                             b"\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        assert chunked.startswith(b"HTTP/1.1 400 ") and b"task_type" in chunked  # chunked alone is read
        assert down.requests == []


async def test_the_501_of_a_transfer_coding_closes_the_connection_as_every_501_does():
    """The README: '408, 431, 501, 505 and that 400 close the connection'. The 501 of a method no route knows did;
    the 501 of 'Transfer-Encoding: gzip, chunked' kept the connection open and answered the next request on it."""
    async with http_stack() as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        answer = await _raw(port, b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                            b"\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                            b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 501 "), answer[:300]
        assert answer.count(b"HTTP/1.1 ") == 1, answer  # the connection closed after the 501
        assert b"connection: close" in answer.lower()
        assert down.requests == []


async def test_a_body_is_read_in_the_coding_it_names_and_a_bad_or_unknown_coding_is_refused_by_name(caplog):
    """A gzip header over a plain body was a 500 with a traceback (aiohttp's decoding error escaped), an unknown
    coding was read as if it were JSON, and a bad deflate body was 'not a well-formed HTTP/1.1 request'. Then the
    400 was answered and aiohttp's lingering read of the rest of the body raised the decoding error again: an
    ERROR 'Unhandled exception' with a traceback in the log for every such request."""
    import gzip
    import json
    import zlib

    import brotli

    async with http_stack() as (client, _, _down):
        body = json.dumps({**FIELD_BODY, "task_type": "chat"}).encode()
        for coding, encoded in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                                ("br", brotli.compress(body)), ("identity", body), ("", body)):
            reply = await client.post("/api/v1/agent/submit", content=encoded,
                                      headers={"Content-Type": "application/json", "Content-Encoding": coding})
            assert reply.status_code == 200, (coding, reply.text)
        for path in ("/api/v1/agent/submit", "/api/v1/agent/run"):
            for coding in ("gzip", "br", "deflate"):  # the body is not in the coding its header names
                caplog.clear()
                reply = await client.post(path, content=b"{}",
                                          headers={"Content-Type": "application/json", "Content-Encoding": coding})
                assert reply.status_code == 400, (path, coding, reply.text)
                # in the face's words and aiohttp's reason, not its exception's text ('400, message:\n  Can ...')
                # (a deflate stream that never ended was '... names (deflate)', saying neither the quote nor why)
                message = reply.json()["error"]["message"]
                assert message.startswith(
                    f"body: expected data in the coding its Content-Encoding names ('{coding}'): "
                    f"Can not decode content-encoding: {coding}"), reply.text
                assert "\n" not in message and "400, message" not in message, message
                await asyncio.sleep(0.05)  # aiohttp's handling of the connection after the answer
                assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], (
                    path, coding, [r.getMessage() for r in caplog.records])
            for coding in ("foo", "gzip, br", "compress", "x-gzip"):  # x-gzip: aiohttp does not decode it
                reply = await client.post(path, content=body,
                                          headers={"Content-Type": "application/json", "Content-Encoding": coding})
                assert reply.status_code == 415, (path, coding, reply.text)
                assert reply.json()["error"]["message"].startswith("Content-Encoding: expected one of identity"), reply.text


async def test_the_openapi_documents_required_fields_as_the_face_checks_them():
    """Each field the document calls required is refused when left out; every other one may be left out."""
    async with http_stack() as (client, _, _down):
        doc = (await client.get("/openapi.json")).json()
        schema = doc["components"]["schemas"]["TaskRequest"]
        assert set(schema["required"]) == {"task_type"}
        assert schema["properties"]["task_type"]["enum"] == ["rag_answer", "chat", "react_loop"]
        assert {"413", "415"} <= set(doc["paths"]["/api/v1/agent/submit"]["post"]["responses"])
        full = {**FIELD_BODY, "task_type": "chat", "payload": "hi", "task_id": "", "model": "", "metadata": {}}
        assert set(full) == set(schema["properties"])
        for field in schema["properties"]:
            body = {k: v for k, v in full.items() if k != field}
            reply = await client.post("/api/v1/agent/submit", json=body, headers={"X-Agent-Id": "a-1"})
            if field in schema["required"]:
                assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(field), reply.text
            else:
                assert reply.status_code == 200, (field, reply.text)
        # agent_id: in the body or the header, as the X-Agent-Id parameter says; neither is 400.
        named = {p["name"] for p in doc["paths"]["/api/v1/agent/submit"]["post"]["parameters"]}
        assert {"X-Agent-Id", "X-Priority", "X-Tenant-Id"} <= named  # every header the face reads
        header = next(p for p in doc["paths"]["/api/v1/agent/submit"]["post"]["parameters"] if p["name"] == "X-Agent-Id")
        assert "one of the two is required" in header["description"]
        neither = await client.post("/api/v1/agent/submit", json={k: v for k, v in full.items() if k != "agent_id"})
        assert neither.status_code == 400 and neither.json()["error"]["message"].startswith("agent_id")


async def test_unknown_task_and_agent_are_404_and_a_taken_task_id_is_409():
    async with http_stack() as (client, _, _down):
        missing = await client.get("/api/v1/tasks/nope")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
        nobody = await client.get("/api/v1/agent/nobody/status")
        assert nobody.status_code == 404 and "agent 'nobody'" in nobody.json()["error"]["message"]
        body = {**FIELD_BODY, "task_id": "http-1", "task_type": "chat"}
        assert (await client.post("/api/v1/agent/submit", json=body)).status_code == 200
        again = await client.post("/api/v1/agent/submit", json=body)  # idempotent: the same task
        assert again.status_code == 200 and again.json()["task_id"] == "http-1"
        taken = await client.post("/api/v1/agent/submit", json={**body, "payload": "another question"})
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "ALREADY_EXISTS"


async def test_a_full_queue_answers_429_at_once_and_queues_nothing():
    """Submit's queue is the backlog of submitted tasks (orchestrator.max_unfinished_submitted_tasks); run's is
    the orchestration queue. Either full answers 429 naming it, and nothing is recorded or queued."""
    overrides = {"queues.orchestration": {"capacity": 1, "workers": 1, "timeout_ms": 30000},
                 "orchestrator.inference_mode": "inline", "orchestrator.max_unfinished_submitted_tasks": 2,
                 "orchestrator.max_running_submitted_tasks": 1}
    async with http_stack(**overrides) as (client, stub, down):
        down.gate = asyncio.Event()
        body = {**FIELD_BODY, "task_type": "chat"}
        assert (await client.post("/api/v1/agent/submit", json=body)).status_code == 200  # holds the worker
        while not down.requests:
            await asyncio.sleep(0.01)
        assert (await client.post("/api/v1/agent/submit", json=body)).status_code == 200  # waits in the backlog
        full = await client.post("/api/v1/agent/submit", json={**body, "task_id": "refused"})
        assert full.status_code == 429, full.text
        assert full.headers["Retry-After"] == "1"  # RFC 9110 section 10.2.3: when to try again
        assert "orchestrator.max_unfinished_submitted_tasks" in full.json()["error"]["message"]
        assert (await client.get("/api/v1/tasks/refused")).status_code == 404
        waiting = stub.RunTask(agent_pb2.RunTaskRequest(payload="hello", task_type="chat"))
        assert (await waiting.read()).HasField("accepted")  # waits in the orchestration queue: capacity 1
        full = await client.post("/api/v1/agent/run", json=body)
        assert full.status_code == 429, full.text
        assert "orchestration queue full" in full.json()["error"]["message"]
        down.gate.set()
        waiting.cancel()


async def sse_events(client: httpx.AsyncClient, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    async with aconnect_sse(client, "POST", "/api/v1/agent/run", json=body, headers=dict(headers or {})) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [(event.event, event.json()) async for event in source.aiter_sse()]


async def test_run_streams_one_event_per_task_event_ending_with_final():
    async with http_stack() as (client, stub, _down):
        events = await sse_events(client, {**FIELD_BODY, "task_type": "rag_answer", "payload": "What is with?"})
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "accepted" and kinds[-1] == "final" and "stage" in kinds
        assert "".join(data["text"] for kind, data in events if kind == "token") == "The answer."
        assert events[-1][1]["output"] == "The answer." and events[-1][1]["compute_score_used"] == 0.5
        grpc_events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(
            payload="What is with?", task_type="rag_answer", agent_id="test-001", priority=agent_pb2.CORE,
            max_tokens=128))]
        # One event per TaskEvent, as RunTask streams them (tokens ready together travel in one event, so
        # their number may differ between two runs; their text may not).
        assert [k for k in kinds if k != "token"] == [
            k for e in grpc_events if (k := e.WhichOneof("event")) != "token"]
        assert sum(data.get("count") or 1 for kind, data in events if kind == "token") == 3


async def test_a_stream_that_fails_after_accepted_ends_with_an_error_event():
    limits = {"chat": 0.3, "rag_answer": 180, "react_loop": 600}
    async with http_stack(**{"orchestrator.task_time_limit_s": limits}) as (client, _, down):
        down.gate = asyncio.Event()  # Generate never answers: the task's time limit passes
        events = await sse_events(client, {**FIELD_BODY, "task_type": "chat"})
        assert events[0][0] == "accepted" and events[-1][0] == "error"
        error = events[-1][1]["error"]
        assert error["code"] == "DEADLINE_EXCEEDED" and "task_time_limit_s.chat" in error["message"]
        down.gate.set()


@contextlib.asynccontextmanager
async def stack_to_stop(down: Downstream, http: bool = True):
    """(config, orchestrator, its HTTP face or None, their server) on port 0 in front of ``down``, for the drain
    tests, which stop the server themselves (``srv.stop``)."""
    base = load_config("config", service="orchestrator")
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base) as cfg:
            orch = OrchestratorService(cfg)
            face = HttpFace(orch, cfg, port=0) if http else None
            yield cfg, orch, face, await start_server([orch, face] if face else [orch], "127.0.0.1", 0, cfg.server)


async def test_a_stream_still_running_when_the_drain_ends_gets_an_error_naming_the_stop_on_both_faces():
    """SIGTERM lets streams finish within server.shutdown_grace_s; one still running then is ended UNAVAILABLE
    naming the stop, over gRPC and as an SSE ``error`` event. gRPC's own cancel read 'Cancelling all calls', and
    the SSE stream was cut with no event (its chunked body unterminated)."""
    down = Downstream()
    down.gate = asyncio.Event()  # Generate never answers: both tasks are inside infer when the drain ends
    async with stack_to_stop(down) as (cfg, _orch, face, srv):
        channel = open_channel(f"127.0.0.1:{srv.port}", cfg.server)
        try:
            call = agent_pb2_grpc.AgentServiceStub(channel).RunTask(agent_pb2.RunTaskRequest(
                payload="What is with?", task_type="chat", agent_id="drain-grpc"))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as client:
                async with aconnect_sse(client, "POST", "/api/v1/agent/run",
                                        json={**FIELD_BODY, "task_type": "chat"}) as source:
                    events = source.aiter_sse()
                    assert (await anext(events)).event == "accepted"
                    while len(down.requests) < 2:
                        await asyncio.sleep(0.01)
                    stopping = asyncio.create_task(srv.stop(0.2))
                    rest = [(e.event, json.loads(e.data)) async for e in events]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in call:
                        pass
            await stopping
        finally:
            await channel.close()
            down.gate.set()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "orchestrator is stopping" in refused.value.details(), refused.value.details()
    assert "server.shutdown_grace_s" in refused.value.details()
    assert [kind for kind, _ in rest if kind != "stage"] == ["error"], rest
    error = rest[-1][1]["error"]
    assert error["code"] == "UNAVAILABLE" and error["message"] == refused.value.details(), error


async def test_a_task_asked_for_once_the_drain_began_is_refused_naming_it_and_the_running_ones_finish():
    """From SIGTERM on, no new task: a RunTask still validating at SIGTERM (here: waiting for the dispatcher's model
    info) started its task after the drain began, and was ended UNAVAILABLE, 'still running after
    server.shutdown_grace_s = 30 s of draining', the moment the streams running at SIGTERM had finished (a live
    stack under load: 65 ms after SIGTERM). It is refused before accepted now, naming the drain, so its caller
    may send it again elsewhere; the task running at SIGTERM finishes within the grace, its stream whole."""
    class Gated(Downstream):
        def __init__(self) -> None:
            super().__init__()
            self.describing = asyncio.Event()  # the first DescribeModel arrived
            self.describe_gate = asyncio.Event()  # the first DescribeModel answers once set
            self.gates = {"first": asyncio.Event()}  # each task's Generate, by agent_id

        async def DescribeModel(self, request, context):  # noqa: N802 - gRPC method name
            if not self.describing.is_set():
                self.describing.set()
                await self.describe_gate.wait()
            return await super().DescribeModel(request, context)

        async def Generate(self, request, context):  # noqa: N802 - gRPC method name
            self.requests.append(request)
            await self.gates[request.agent_id].wait()
            yield agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text="done", index=0))
            yield agent_pb2.GenerateChunk(done=agent_pb2.GenerateDone(
                usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=1, total_tokens=11)))

    async def run(stub, agent_id: str) -> list[str]:
        return [e.WhichOneof("event") async for e in stub.RunTask(agent_pb2.RunTaskRequest(
            payload="hello", task_type="chat", agent_id=agent_id))]

    async def until(condition) -> None:
        while not condition():
            await asyncio.sleep(0.01)

    down = Gated()
    async with stack_to_stop(down, http=False) as (cfg, orch, _face, srv):
        channel = open_channel(f"127.0.0.1:{srv.port}", cfg.server)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        try:
            second = asyncio.create_task(run(stub, "second"))  # validating: its model info does not come
            await until(down.describing.is_set)
            first = asyncio.create_task(run(stub, "first"))  # asks model info too, answered: running
            await until(lambda: len(down.requests) == 1)
            stopping = asyncio.create_task(srv.stop(30))
            await until(lambda: orch.not_ready() is not None and "draining" in orch.not_ready())
            down.describe_gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await second
            down.gates["first"].set()
            assert (await first)[-1] == "final"
            await stopping
        finally:
            down.describe_gate.set()
            down.gates["first"].set()
            await channel.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "orchestrator is draining (SIGTERM)" in refused.value.details(), refused.value.details()
    assert len(down.requests) == 1  # the refused task never reached the dispatcher


async def test_the_http_face_takes_no_new_task_on_a_kept_alive_connection_once_the_drain_began():
    """The HTTP face's listener closes at SIGTERM, its keep-alive connections stay open while streams drain: a
    /run or /submit sent on one was run (a submit queued, to be recorded FAILED at the stop) while /readyz on the
    same connection said to send to another replica. Now 503 naming the drain; the stream running finishes."""
    down = Downstream()
    down.gate = asyncio.Event()  # the stream running at SIGTERM holds the drain open
    async with stack_to_stop(down) as (_cfg, _orch, face, srv):
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as kept, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{face.port}", timeout=30) as other:
                assert (await kept.get("/readyz")).status_code == 200  # the connection kept alive
                running_stream = asyncio.create_task(sse_events(other, {**FIELD_BODY, "task_type": "chat"}))
                while len(down.requests) < 1:  # its task is in Generate
                    await asyncio.sleep(0.01)
                stopping = asyncio.create_task(srv.stop(30))
                while (await kept.get("/readyz")).status_code != 503:
                    await asyncio.sleep(0.01)
                for route in ("/api/v1/agent/run", "/api/v1/agent/submit"):
                    answer = await kept.post(route, json={**FIELD_BODY, "task_type": "chat"})
                    assert answer.status_code == 503, (route, answer.text)
                    assert "orchestrator is draining (SIGTERM)" in answer.json()["error"]["message"]
                assert len(down.requests) == 1  # neither reached the dispatcher
                down.gate.set()
                assert (await running_stream)[-1][0] == "final"
                await stopping
        finally:
            down.gate.set()


async def test_agent_and_priority_headers_fill_what_the_body_leaves_out_and_the_body_wins():
    async with http_stack() as (client, stub, down):
        headers = {"X-Agent-Id": "agent-from-header", "X-Priority": "batch"}
        await sse_events(client, {"task_type": "chat", "payload": "hi"}, headers)
        await sse_events(client, {"task_type": "chat", "payload": "hi", "agent_id": "agent-in-body",
                                  "priority": "core"}, headers)
        reply = await client.post("/api/v1/agent/submit", json={"task_type": "chat"}, headers=headers)
        assert reply.status_code == 200
        await finished(client, "/api/v1/agent/agent-from-header/status")  # the header's agent owns the task
        metadata = (("x-agent-id", "grpc-agent"), ("x-priority", "CORE"))
        [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"), metadata=metadata)]
        [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat", agent_id="own",
                                                                priority=agent_pb2.NORMAL), metadata=metadata)]
        seen = [(r.agent_id, r.priority) for r in down.requests]
        assert seen == [("agent-from-header", agent_pb2.BATCH), ("agent-in-body", agent_pb2.CORE),
                        ("agent-from-header", agent_pb2.BATCH), ("grpc-agent", agent_pb2.CORE),
                        ("own", agent_pb2.NORMAL)]
        bad = await client.post("/api/v1/agent/submit", json={"task_type": "chat", "agent_id": "a-1"},
                                headers={"X-Priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("x-priority header")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi"), metadata=(("x-priority", "urgent"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-priority" in err.value.details()
        # an empty header names nothing and is ignored, X-Priority as X-Agent-Id (it was refused with 400)
        empty = await client.post("/api/v1/agent/submit", json={"task_type": "chat", "agent_id": "a-2"},
                                  headers={"X-Priority": "", "X-Agent-Id": ""})
        assert empty.status_code == 200, empty.text


async def test_spaces_around_an_agent_or_tenant_header_are_not_part_of_it_on_either_face():
    """An HTTP parser drops the spaces around a header's value (RFC 9110 section 5.5); gRPC metadata kept them, so
    'X-Agent-Id:  agent-7 ' was agent 'agent-7' over HTTP and ' agent-7 ' over gRPC: two agents, each with its own
    memory and latest task, from one harness setting; ' acme' was refused over gRPC and tenant acme over HTTP."""
    async with http_stack() as (client, stub, down):
        port = httpx.URL(str(client.base_url)).port
        body = json.dumps({"task_type": "chat", "payload": "hi"}).encode()
        answer = await _raw(port, b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                            b"\r\nConnection: close\r\nX-Agent-Id:  agent-7 \r\nX-Tenant-Id:  acme \r\n"
                            b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        http_task = json.loads(answer.partition(b"\r\n\r\n")[2])["task_id"]
        over_grpc = await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"),
                                          metadata=(("x-agent-id", " agent-7 "), ("x-tenant-id", " acme ")))
        latest = await client.get("/api/v1/agent/agent-7/status", headers={"X-Tenant-Id": "acme"})
        assert latest.status_code == 200 and latest.json()["task_id"] == over_grpc.task_id, latest.text
        await finished(client, f"/api/v1/tasks/{over_grpc.task_id}")
        await finished(client, f"/api/v1/tasks/{http_task}")
        assert {(r.agent_id, r.tenant_id) for r in down.requests} == {("agent-7", "acme")}


async def test_a_wrong_header_is_refused_even_where_the_body_wins_and_priority_takes_any_case_on_both():
    async with http_stack() as (client, stub, down):
        body = {"task_type": "chat", "payload": "hi", "agent_id": "a-1", "priority": "core"}
        bad = await client.post("/api/v1/agent/submit", json=body, headers={"X-Priority": "urgent"})
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("x-priority header"), bad.text
        for metadata in ((("x-priority", "urgent"),), (("x-agent-id", "   "),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitTask(agent_pb2.RunTaskRequest(payload="hi", agent_id="a-1", priority=agent_pb2.CORE),
                                      metadata=metadata)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{metadata[0][0]} header"), err.value.details()
        empty = await client.post("/api/v1/agent/submit", json=body, headers={"X-Agent-Id": ""})
        assert empty.status_code == 200  # an empty header names nothing: as if absent
        for pair in (["c", "b"], ["b", "c"]):  # either order: the rule for two, not "agent_id missing"
            twice = await client.post("/api/v1/agent/submit", json={"task_type": "chat", "payload": "hi"},
                                      headers=[("X-Agent-Id", pair[0]), ("X-Agent-Id", pair[1])])
            assert twice.status_code == 400
            assert twice.json()["error"]["message"].startswith("x-agent-id header: expected one value"), twice.text
            assert twice.json()["error"]["message"].endswith("(got ('b', 'c'))"), twice.text  # both, as sent
        await sse_events(client, {**body, "priority": "CORE"}, {"X-Priority": "Batch"})
        assert down.requests[-1].priority == agent_pb2.CORE  # the body's, in capitals; the header's any case


async def test_an_empty_header_beside_one_with_a_value_is_ignored_on_both_edges():
    """README: "an empty header names nothing and is ignored". An empty X-Agent-Id beside X-Agent-Id: real was
    400 "expected one value (... got ('', 'real'))", and so were X-Priority and X-Tenant-Id, over HTTP and gRPC."""
    async with http_stack() as (client, stub, down):
        for name, value in (("X-Agent-Id", "real"), ("X-Priority", "batch"), ("X-Tenant-Id", "acme")):
            for pair in (["", value], [value, ""], ["", value, ""]):
                body = {"task_type": "chat", "payload": "hi", **({} if name == "X-Agent-Id" else {"agent_id": "a-1"})}
                reply = await client.post("/api/v1/agent/submit", json=body, headers=[(name, v) for v in pair])
                assert reply.status_code == 200, (name, pair, reply.text)
                metadata = tuple((name.lower(), v) for v in pair)
                await stub.SubmitTask(agent_pb2.RunTaskRequest(**body), metadata=metadata)
        status = await finished(client, "/api/v1/agent/a-1/status")
        assert status["tenant_id"] == "default"  # the default tenant's agent a-1; acme's is another agent
        acme = await client.get("/api/v1/agent/a-1/status", headers=[("X-Tenant-Id", ""), ("X-Tenant-Id", "acme")])
        assert acme.status_code == 200 and acme.json()["tenant_id"] == "acme", acme.text
        wanted = {("real", agent_pb2.NORMAL, "default"), ("a-1", agent_pb2.BATCH, "default"),
                  ("a-1", agent_pb2.NORMAL, "acme")}
        for _ in range(500):  # the submitted tasks reach the model in their time (a fixed 0.2 s was not always it)
            seen = {(r.agent_id, r.priority, r.tenant_id) for r in down.requests}
            if wanted <= seen:
                break
            await asyncio.sleep(0.02)
        assert wanted <= seen, seen
        for name in ("X-Agent-Id", "X-Priority", "X-Tenant-Id"):  # two non-empty values still say two things
            values = {"X-Agent-Id": ("b", "c"), "X-Priority": ("core", "batch"), "X-Tenant-Id": ("x", "y")}[name]
            reply = await client.post("/api/v1/agent/submit", json={"task_type": "chat", "agent_id": "a-1"},
                                      headers=[(name, "")] + [(name, v) for v in values])
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["message"].startswith(f"{name.lower()} header: expected one value"), reply.text


async def test_an_agent_id_header_too_long_is_refused_naming_the_header_whether_or_not_the_body_wins():
    """A 300-character X-Agent-Id beside a body agent_id was accepted silently, and a 257-character one alone was
    refused as "agent_id: expected at most 256 characters"."""
    async with http_stack() as (client, stub, down):
        for body in ({"task_type": "chat", "payload": "hi", "agent_id": "a-1"}, {"task_type": "chat", "payload": "hi"}):
            for length in (257, 300):
                reply = await client.post("/api/v1/agent/submit", json=body, headers={"X-Agent-Id": "a" * length})
                assert reply.status_code == 400, reply.text
                assert reply.json()["error"]["message"] == (
                    f"x-agent-id header: expected at most 256 characters (limits.max_id_chars) (got '{length} chars')")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SubmitTask(agent_pb2.RunTaskRequest(**body), metadata=(("x-agent-id", "a" * length),))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == reply.json()["error"]["message"]
            fits = await client.post("/api/v1/agent/submit", json=body, headers={"X-Agent-Id": "a" * 256})
            assert fits.status_code == 200, fits.text
        assert all(len(r.agent_id) <= 256 for r in down.requests)


@pytest.mark.parametrize("field,value", [("agent_id", "   "), ("agent_id", "a\u0000b"), ("task_id", "t\nx"),
                                         ("model", "m\x7f"), ("agent_id", "a\u0085b")])
async def test_an_id_that_is_blank_or_holds_a_control_character_is_refused_naming_it(field, value):
    async with http_stack() as (client, stub, down):
        body = {"task_type": "chat", "payload": "hi", "agent_id": "a-1", field: value}
        reply = await client.post("/api/v1/agent/submit", content=json.dumps(body), headers={"Content-Type": JSON})
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(f"{field}:"), reply.text
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(**{"payload": "hi", "agent_id": "a-1", field: value}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(f"{field}:")
        assert not down.requests  # nothing reached the dispatcher


async def test_bearer_tokens_of_the_grpc_edge_guard_the_http_face(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("tok-full-1\ntok-reader-2 agent.AgentService/GetTaskStatus\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(path), "tokens_env": ""}}
    async with http_stack(**auth) as (client, _, down):
        body = {**FIELD_BODY, "task_type": "chat"}
        missing = await client.post("/api/v1/agent/submit", json=body)
        assert missing.status_code == 401 and "'Authorization' header" in missing.json()["error"]["message"]
        assert missing.headers["WWW-Authenticate"].startswith("Bearer")  # RFC 6750 section 3: the scheme asked for
        wrong = await client.post("/api/v1/agent/run", json=body, headers={"Authorization": "Bearer tok-nope"})
        assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"].startswith("Bearer")
        reader = {"Authorization": "Bearer tok-reader-2"}
        forbidden = await client.post("/api/v1/agent/submit", json=body, headers=reader)
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "PERMISSION_DENIED"
        assert down.requests == []
        ok = await client.post("/api/v1/agent/submit", json=body, headers={"Authorization": "Bearer tok-full-1"})
        assert ok.status_code == 200
        assert (await client.get("/api/v1/agent/test-001/status", headers=reader)).status_code == 200
        assert (await client.get("/openapi.json")).status_code == 200  # the document needs no token


async def test_the_accepted_event_carries_the_states_lower_case_name_as_submit_does():
    """The accepted SSE event said "state":"TASK_STATE_UNSPECIFIED" (protobuf's enum name) where /submit says
    "queued" and the OpenAPI state enum is lower-case."""
    from switchyard.orchestrator.http_face import event_bytes

    async with http_stack() as (client, _, _down):
        doc = (await client.get("/openapi.json")).json()
        names = doc["components"]["schemas"]["AcceptedResponse"]["properties"]["state"]["enum"]
        events = await sse_events(client, {**FIELD_BODY, "task_type": "chat"})
        assert events[0][0] == "accepted" and events[0][1]["state"] == "unspecified", events[0]  # unset on RunTask
        assert events[0][1]["state"] in names
    queued = agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id="t", state=agent_pb2.QUEUED))
    assert b'"state":"queued"' in event_bytes(queued)


async def test_the_openapi_document_lists_the_headers_and_statuses_each_route_answers():
    """The status routes honour X-Tenant-Id, submit and run answer 404 for a model not served, and every route
    answers 417 and 431, but the document said none of it; 501 (a method no route knows) is answered by the face,
    not by an operation."""
    async with http_stack() as (client, _, _down):
        doc = (await client.get("/openapi.json")).json()
        paths = doc["paths"]
        names = lambda op: {p["name"] for p in op.get("parameters", ()) if p["in"] == "header"}  # noqa: E731
        for path, own in (("/api/v1/agent/submit", set()), ("/api/v1/agent/run", {"Last-Event-ID"})):
            assert names(paths[path]["post"]) == {"X-Agent-Id", "X-Priority", "X-Tenant-Id", *own}
        for path in ("/api/v1/agent/{agent_id}/status", "/api/v1/tasks/{task_id}"):  # the tasks routes read it
            assert names(paths[path]["get"]) == {"X-Tenant-Id"}, path  # too (400, 403), and said nothing of it
        assert names(paths["/api/v1/tasks/{task_id}/cancel"]["post"]) == {"X-Tenant-Id"}
        for path in ("/api/v1/agent/submit", "/api/v1/agent/run"):  # a model not served: 404, undocumented there
            assert "NOT_FOUND" in paths[path]["post"]["responses"]["404"]["description"], path
        bad_tenant = await client.get("/api/v1/tasks/t", headers={"X-Tenant-Id": "a b"})
        assert bad_tenant.status_code == 400 and "x-tenant-id" in bad_tenant.text, bad_tenant.text
        for path, item in paths.items():
            for method, op in item.items():
                assert {"417", "431"} <= set(op["responses"]), (path, method)
        assert "501" in doc["info"]["description"] and "405" in doc["info"]["description"]
        # ... and the face answers them there
        expect = await client.get("/api/v1/agent/a/status", headers={"Expect": "something"})
        assert expect.status_code == 417, expect.text
        long = await client.get("/api/v1/tasks/t", headers={"X-Long": "x" * 9000})
        assert long.status_code == 431, long.text
        port = httpx.URL(str(client.base_url)).port
        unknown = await _raw(port, b"FOO /api/v1/tasks/t HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert unknown.split(b"\r\n", 1)[0].endswith(b" 501 Not Implemented"), unknown[:200]


@pytest.mark.parametrize(("accept", "streams"), [
    (None, True), ("*/*", True), ("text/event-stream", True), ("text/*", True), ("TEXT/Event-Stream; q=0.5", True),
    ("application/json, text/event-stream;q=0.1", True),  # SSE less preferred, still taken
    ("application/json", False), ("application/*", False), ("text/event-stream;q=0, */*", False),
    ("text/event-stream;q=0", False), ("text/event-stream;q=2", False), ("json", False),
])
async def test_run_answers_an_event_stream_only_to_a_client_that_takes_one_else_406_naming_it(accept, streams):
    """POST /run with Accept: application/json was answered text/event-stream anyway. A client whose Accept takes
    no text/event-stream gets 406 in the face's JSON error shape, naming the header, what it takes and what it sent,
    before the body is read or a task runs; the others get the stream as before (RFC 9110 section 12.5.1)."""
    async with http_stack() as (client, _stub, down):
        headers = {} if accept is None else {"Accept": accept}
        body = {**FIELD_BODY, "task_type": "chat", "payload": "What is with?"}
        if streams:
            events = await sse_events(client, body, headers)
            assert events[0][0] == "accepted" and events[-1][0] == "final"
            return
        reply = await client.post("/api/v1/agent/run", json=body, headers=headers)
        assert reply.status_code == 406 and reply.headers["content-type"].startswith(JSON), reply.text
        error = reply.json()["error"]
        assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith(
            "Accept: expected a media range that takes text/event-stream (text/event-stream, text/* or */*"), error
        assert repr(accept) in error["message"] and not down.requests  # nothing ran


async def test_every_route_refuses_an_accept_that_takes_none_of_its_answer_and_the_openapi_document_says_so():
    """The JSON routes answered JSON to a client that said it takes none (Accept: text/event-stream on /submit,
    text/html on the status routes): 406 naming what each answers; HEAD as GET; nothing submitted. The OpenAPI
    document lists the 406 on every operation but the probes', naming its media type."""
    async with http_stack() as (client, _stub, down):
        for method, path in (("POST", "/api/v1/agent/submit"), ("GET", "/api/v1/tasks/t-1"),
                             ("HEAD", "/api/v1/tasks/t-1"), ("GET", "/api/v1/agent/a/status"),
                             ("POST", "/api/v1/tasks/t-1/cancel"), ("GET", "/openapi.json")):
            reply = await client.request(method, path, json=FIELD_BODY if method == "POST" else None,
                                         headers={"Accept": "text/event-stream, text/html"})
            assert reply.status_code == 406, (method, path, reply.status_code, reply.text)
            if method != "HEAD":
                message = reply.json()["error"]["message"]
                assert "takes application/json" in message and "'text/event-stream, text/html'" in message, message
        assert not down.requests
        taken = await client.post("/api/v1/agent/submit", json=FIELD_BODY,
                                  headers={"Accept": "application/*;q=0.2, text/html"})
        assert taken.status_code == 200, taken.text
        doc = (await client.get("/openapi.json", headers={"Accept": "application/json"})).json()
        for path, item in doc["paths"].items():
            for method, op in item.items():
                assert ("406" in op["responses"]) == (path not in ("/healthz", "/readyz")), (path, method)
        assert "text/event-stream" in doc["paths"]["/api/v1/agent/run"]["post"]["responses"]["406"]["description"]
        assert "application/json" in doc["paths"]["/api/v1/tasks/{task_id}"]["get"]["responses"]["406"]["description"]


async def test_the_probes_answer_a_health_checker_whatever_its_accept():
    """A health checker sends the Accept it is configured with (an uptime monitor's text/html, say): the probes'
    answer is their status, not negotiated; a healthy face read 406 and was taken out of service."""
    async with http_stack() as (client, _stub, _down):
        for path in ("/healthz", "/readyz"):
            for accept in ("text/html", "text/plain;q=1, text/event-stream"):
                reply = await client.get(path, headers={"Accept": accept})
                assert reply.status_code in (200, 503), (path, accept, reply.status_code, reply.text)
        doc = (await client.get("/openapi.json")).json()
        assert "406" not in doc["paths"]["/healthz"]["get"]["responses"]
        assert "406" not in doc["paths"]["/readyz"]["get"]["responses"]


def test_a_token_event_is_the_same_json_as_every_other_event_gets():
    import json

    from switchyard.orchestrator.http_face import event_bytes
    from switchyard.orchestrator.http_models import message_dict

    for token in (agent_pb2.TokenEvent(text=' "quoted" \\ line\nbreak \u00e9', index=7, count=2), agent_pb2.TokenEvent()):
        text = event_bytes(agent_pb2.TaskEvent(token=token)).decode()
        kind, data = text.split("\n")[:2]
        assert kind == "event: token" and text.endswith("\n\n")
        assert json.loads(data.removeprefix("data: ")) == message_dict(token)


async def test_a_client_that_leaves_a_stream_cancels_its_task():
    async with http_stack() as (client, _, down):
        down.gate = asyncio.Event()  # Generate waits: the task is inside infer when the client leaves
        async with client.stream("POST", "/api/v1/agent/run", json={**FIELD_BODY, "task_type": "chat"}) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("event: accepted"):
                    break
            while not down.requests:
                await asyncio.sleep(0.01)
        for _ in range(500):  # the connection is closed: RunTask's task is cancelled, and its Generate with it
            if down.cancelled:
                break
            await asyncio.sleep(0.02)
        assert down.cancelled == [down.requests[0].request_id]
        down.gate.set()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    import trustme

    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    leaf.private_key_pem.write_to_path(folder / "key.pem")
    leaf.cert_chain_pems[0].write_to_path(folder / "cert.pem")
    ca.cert_pem.write_to_path(folder / "ca.pem")
    return folder


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
async def test_the_http_face_serves_tls_with_the_grpc_edges_certificates(pki, mtls):
    import ssl

    files = {"cert_file": str(pki / "cert.pem"), "key_file": str(pki / "key.pem"), "ca_file": str(pki / "ca.pem")}
    verify = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if mtls:
        verify.load_cert_chain(str(pki / "cert.pem"), str(pki / "key.pem"))
    tls = {"enabled": True, "require_client_auth": mtls, **files}
    async with http_stack({"verify": verify}, **{"server.tls": tls}) as (client, _, _down):
        reply = await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "task_type": "chat"})
        assert reply.status_code == 200 and reply.json()["status"] == "accepted"
        # plain HTTP against the TLS port: it read an empty reply (curl: exit 52); answered 400 saying so now
        plain = httpx.AsyncClient(base_url=str(client.base_url).replace("https", "http"), timeout=10)
        for _ in range(3):  # each on a connection of its own (the answer closes it)
            refused = await plain.post("/api/v1/agent/submit", json=FIELD_BODY)
            assert refused.status_code == 400, refused.text
            assert "plain HTTP sent to an HTTPS port" in refused.text, refused.text
        await plain.aclose()
        reply = await client.get("/openapi.json")  # TLS calls are served beside them
        assert reply.status_code == 200
        if mtls:
            anonymous = httpx.AsyncClient(base_url=str(client.base_url), timeout=10,
                                          verify=ssl.create_default_context(cafile=str(pki / "ca.pem")))
            with pytest.raises(httpx.HTTPError):
                await anonymous.get("/openapi.json")  # no client certificate
            await anonymous.aclose()



async def test_a_body_past_the_size_limit_is_413_naming_it_and_unknown_paths_and_methods_answer_json():
    async with http_stack() as (client, _, down):
        limit = load_config("config", service="orchestrator").limits.max_payload_chars
        for chars in (13 * limit, 16 * limit):  # past the face's body limit (12 bytes a character and more)
            for path in ("/api/v1/agent/submit", "/api/v1/agent/run"):
                reply = await client.post(path, json={**FIELD_BODY, "payload": "x" * chars})
                assert reply.status_code == 413, reply.text
                error = reply.json()["error"]
                assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith("body: expected at most")
                assert "limits.max_payload_chars" in error["message"]
        unknown = await client.get("/api/v1/nothing-here")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND"
        for method in ("GET", "PUT", "DELETE"):
            wrong = await client.request(method, "/api/v1/agent/submit", json=FIELD_BODY)
            assert wrong.status_code == 405 and "POST" in wrong.json()["error"]["message"]
            assert "POST" in wrong.headers["Allow"]
        assert (await client.post("/api/v1/tasks/t-1")).status_code == 405
        assert down.requests == []


async def test_a_payload_within_its_limit_is_read_however_its_json_is_escaped_and_a_bom_is_ignored():
    """Python's json.dumps escapes every non-ASCII character by default: an emoji takes 12 bytes (two \\u
    escapes), an e-acute 6; the payload's limit counts characters, so the body's limit must allow for that.
    (A window that holds the longest payload's tokens: the edge refuses a question its window cannot hold.)"""
    async with http_stack(**{"limits.context_window_tokens": {"sim-7b": 1_000_000}}) as (client, _, down):
        limit = load_config("config", service="orchestrator").limits.max_payload_chars
        for text in ("\U0001F600" * limit, "\u00e9" * limit):
            body = json.dumps({**FIELD_BODY, "task_type": "chat", "payload": text, "max_tokens": 1})  # ensure_ascii
            reply = await client.post("/api/v1/agent/submit", content=body, headers={"Content-Type": JSON})
            assert reply.status_code == 200, reply.text[:300]
        over = json.dumps({**FIELD_BODY, "task_type": "chat", "payload": "\U0001F600" * (limit + 1)})
        reply = await client.post("/api/v1/agent/submit", content=over, headers={"Content-Type": JSON})
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("payload: expected at most")
        bom = codecs.BOM_UTF8 + json.dumps({**FIELD_BODY, "task_type": "chat", "max_tokens": 1}).encode()
        reply = await client.post("/api/v1/agent/submit", content=bom, headers={"Content-Type": JSON})
        assert reply.status_code == 200, reply.text
        lone = b'{"agent_id": "a-1", "task_type": "chat", "payload": "\\ud800"}'
        reply = await client.post("/api/v1/agent/submit", content=lone, headers={"Content-Type": JSON})
        assert reply.status_code == 400 and "surrogate" in reply.json()["error"]["message"], reply.text


async def test_a_question_its_models_window_cannot_hold_is_refused_400_at_submit_naming_payload():
    async with http_stack() as (client, _, down):
        body = {**FIELD_BODY, "task_type": "chat", "payload": "word " * 5000, "max_tokens": 16}
        reply = await client.post("/api/v1/agent/submit", json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "INVALID_ARGUMENT" and error["origin"] == "orchestrator"
        assert error["message"].startswith("payload: expected a prompt of at most 4080 tokens")
        status = await client.get(f"/api/v1/agent/{FIELD_BODY['agent_id']}/status")
        assert status.status_code == 404, status.text  # no task was made


async def test_a_body_that_stalls_short_of_its_content_length_gets_408_and_the_connection_closes():
    async with http_stack(**{"orchestrator.http.body_read_timeout_s": 0.5}) as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"agent")
        await writer.drain()
        # read() to EOF: the face closed it, at once (aiohttp's lingering read of the unsent body held it 10 s)
        answer = await asyncio.wait_for(reader.read(), timeout=5)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        error = json.loads(body)["error"]
        assert error["code"] == "DEADLINE_EXCEEDED" and "orchestrator.http.body_read_timeout_s" in error["message"]
        assert (await client.get("/openapi.json")).status_code == 200  # the face serves on
        assert down.requests == []


async def test_a_chunked_body_that_stalls_gets_408_naming_its_last_chunk_not_a_length_it_never_gave():
    """The 408 of a chunked body read 'expected its None bytes (Content-Length)'."""
    async with http_stack(**{"orchestrator.http.body_read_timeout_s": 0.5}) as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        answer = await _raw(port, b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n7\r\n{\"agent\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        message = json.loads(body)["error"]["message"]
        assert message.startswith("body: expected its last chunk (Transfer-Encoding: chunked) within 0.5 s"), message
        assert "None" not in message
        assert down.requests == []


async def test_a_header_past_8_kb_is_431_in_the_json_error_shape_logged_without_a_traceback(caplog):
    async with http_stack() as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        cases = ((b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nX-Agent-Id: " + b"a" * 9000 + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", 431, "headers: a header line"),
                 (b"GET /openapi.json HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400, "request: not a well-formed"),
                 # they read 400 "not a well-formed request": a method no server here knows is 501 (RFC 9110
                 # section 15.6.2), header fields too many together 431 (RFC 6585 section 5)
                 (b"FOO /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method: expected GET, HEAD or POST"),
                 (b"GARBAGE\r\n\r\n", 400, "request: not a well-formed"),  # no method, target, version: 400
                 (b"GET\r\n\r\n", 400, "request: not a well-formed"),
                 (b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
                  + b"\r\n", 431, "headers: too many header fields"))
        for request, status, message in cases:
            caplog.clear()
            counted = durations("_OTHER", "", str(status))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=30)  # to EOF: the face closes the connection
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert re.match(rb"HTTP/1\.[01] %d " % status, head), answer[:300]  # 1.0: no request line was read
            assert b"application/json" in head.lower()
            error = json.loads(body)["error"]
            assert error["code"] == ("UNIMPLEMENTED" if status == 501 else "INVALID_ARGUMENT"), error
            assert error["message"].startswith(message), error
            refused = [r for r in caplog.records if "refused a request" in r.getMessage()]
            assert len(refused) == 1 and refused[0].exc_info is None and "aaaa" not in refused[0].getMessage()
            assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
            assert durations("_OTHER", "", str(status)) == counted + 1  # refused by the parser, still counted
        within = await client.get("/openapi.json", headers={"X-Agent-Id": "a" * 8000})
        assert within.status_code == 200  # 8000 bytes is within the bound
        assert down.requests == []


@pytest.mark.parametrize("line, version", [
    (b"GET /openapi.json HTTP/2.0", "HTTP/2.0"),  # read by the parser, served as 1.1: 'HTTP/2.0 200 OK'
    (b"GET /openapi.json", "HTTP/0.9"),  # no version: HTTP/0.9's line, answered 200 with 1.1's headers
    (b"GET /openapi.json HTTP/0.9", "HTTP/0.9"),
    (b"GET /openapi.json HTTP/1.2", "HTTP/1.2"),  # refused by the parser: it read 400 "not well-formed"
    (b"GET /openapi.json HTTP/3.0", "HTTP/3.0"),
    (b"POST /api/v1/agent/submit HTTP/2.0", "HTTP/2.0"),  # never reaches the route: nothing submitted
    (b"GET /api/v1/tasks/t-1 HTTP/2.0", "HTTP/2.0"),  # nor a token check (auth on: still 505, not 401)
])
async def test_a_request_line_of_a_version_other_than_http_1_0_or_1_1_is_505_and_its_connection_closed(
        tmp_path, line, version):
    path = tmp_path / "tokens"
    path.write_text("tok-full-1\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(path), "tokens_env": ""}}
    async with http_stack(**auth) as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        counted = durations("_OTHER", "", "505")
        body = json.dumps(FIELD_BODY).encode()
        answer = await _raw(port, line + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 505 "), answer[:300]
        error = json.loads(rest)["error"]
        assert error["code"] == "INVALID_ARGUMENT", error
        assert error["message"] == f"version: expected HTTP/1.0 or HTTP/1.1 (HTTP/2 is not served on this port) (got {version})"
        assert durations("_OTHER", "", "505") == counted + 1
        assert down.requests == []
        for ok in (b"HTTP/1.0", b"HTTP/1.1"):  # the versions served
            served = await _raw(port, b"GET /openapi.json " + ok + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert served.startswith(ok + b" 200 "), served[:200]


def durations(method: str, route: str, status: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("http_server_request_duration_seconds_count", {
        "http_request_method": method, "http_route": route, "http_response_status_code": status}) or 0.0


async def test_each_request_is_a_server_span_in_the_callers_trace_and_a_duration_by_route_template():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.trace.v1 import trace_pb2
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from otlp_receiver import OtlpReceiver
    from prometheus_client import REGISTRY

    from switchyard.common import telemetry

    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    status_route = "/api/v1/agent/{agent_id}/status"
    series = [("POST", "/api/v1/agent/submit", "200"), ("POST", "/api/v1/agent/submit", "400"),
              ("GET", status_route, "200"), ("GET", "", "404"),
              ("_OTHER", "/api/v1/agent/submit", "405")]  # a 405 is its path's route's (that route refused it)
    with OtlpReceiver() as receiver:
        provider = telemetry.make_tracer_provider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)))
        async with http_stack(tracer_provider=provider) as (client, _, _down):
            assert durations("POST", "/api/v1/agent/run", "200") is not None  # the routes' series start at 0
            before = {key: durations(*key) for key in series}
            accepted = await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "task_type": "chat"},
                                         headers={"traceparent": f"00-{trace_id}-{caller}-01"})
            assert accepted.status_code == 200
            assert accepted.json()["trace_id"] == trace_id  # the task was accepted in the caller's trace
            await finished(client, "/api/v1/agent/test-001/status")
            assert (await client.post("/api/v1/agent/submit", json={})).status_code == 400
            assert (await client.get("/api/v1/nothing-here?x=1")).status_code == 404
            assert (await client.request("PROPFIND", "/api/v1/agent/submit")).status_code == 405
            after = {key: durations(*key) for key in series}
        provider.shutdown()

        assert after[series[0]] == before[series[0]] + 1 and after[series[1]] == before[series[1]] + 1
        assert after[series[2]] >= before[series[2]] + 1
        assert after[series[3]] == before[series[3]] + 1 and after[series[4]] == before[series[4]] + 1
        routes = {s.labels["http_route"] for f in REGISTRY.collect() for s in f.samples
                  if s.name.startswith("http_server_request_duration_seconds")}
        assert routes <= {route for _, route in http_face_routes()} | {""}  # templates, never raw paths

        spans = receiver.wait_for(lambda got: any(s.name == "HTTP" for s in got), timeout_s=30)
    server = [s for s in spans if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    submit = next(s for s in server if s.name == "POST /api/v1/agent/submit" and s.trace_id == trace_id)
    assert submit.parent_span_id == caller
    assert submit.attributes["http.request.method"] == "POST" and submit.attributes["http.route"] == "/api/v1/agent/submit"
    assert submit.attributes["http.response.status_code"] == 200 and submit.attributes["url.scheme"] == "http"
    assert submit.attributes["url.path"] == "/api/v1/agent/submit" and submit.attributes["server.port"] > 0
    assert submit.attributes["network.protocol.version"] == "1.1" and "client.address" in submit.attributes
    polls = [s for s in server if s.name == f"GET {status_route}"]
    assert polls and all(s.attributes["url.path"] == "/api/v1/agent/test-001/status" for s in polls)
    assert all(s.trace_id != trace_id for s in polls)  # no traceparent: traces of their own
    invalid = next(s for s in server if s.name == "POST /api/v1/agent/submit" and s.attributes[
        "http.response.status_code"] == 400)
    unrouted = next(s for s in server if s.name == "GET")
    assert "http.route" not in unrouted.attributes and unrouted.attributes["url.query"] == "x=1"
    other = next(s for s in server if s.name == "HTTP")
    assert other.attributes["http.request.method"] == "_OTHER"
    assert other.attributes["http.request.method_original"] == "PROPFIND"
    assert other.attributes["http.response.status_code"] == 405
    assert not [s.name for s in (submit, invalid, unrouted, other, *polls) if s.is_error]  # 4xx: the caller's


def http_face_routes():
    from switchyard.orchestrator.http_face import ROUTES

    return ROUTES.values()


async def _raw(port: int, request: bytes, whole: bool = True) -> bytes:
    """``request`` sent on a connection of its own; what came back until the face closed it (``whole``: a
    face still reading a body after 5 s fails the test), else the first head it sent (within 5 s: the answer
    comes before any body byte)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read() if whole else reader.readuntil(b"\r\n\r\n"), timeout=5)
    finally:
        writer.close()


async def test_a_promised_body_past_the_cap_is_413_at_once_and_never_invited_by_100_continue():
    """A Content-Length of 99,999,999,999 waited out body_read_timeout_s (10 s) and answered 408; with
    ``Expect: 100-continue`` the face first sent ``100 Continue``, inviting the upload. Both are 413 now, before
    any body byte, and a wrong Content-Type is 415 before 100 Continue too; an unknown expectation is 417 in the
    JSON error shape."""
    async with http_stack() as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        head = b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        for extra in (b"", b"Expect: 100-continue\r\n"):
            answer = await _raw(port, head + extra + b"Content-Type: application/json\r\n"
                                b"Content-Length: 99999999999\r\n\r\n", whole=False)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert b"100 Continue" not in answer
        answer = await _raw(port, head + b"Expect: 100-continue\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\n",
                            whole=False)
        assert answer.startswith(b"HTTP/1.1 415") and b"100 Continue" not in answer, answer[:200]
        answer = await _raw(port, head + b"Expect: 100-continue\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 2\r\n\r\n", whole=False)
        assert answer.startswith(b"HTTP/1.1 100 Continue"), answer[:200]  # invited: then the body
        answer = await _raw(port, head + b"Expect: teapot\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 417"), answer[:200]
        assert "Expect: expected 100-continue" in json.loads(body)["error"]["message"]
        assert down.requests == []


async def test_head_is_answered_wherever_get_is():
    """HEAD on a GET route answered 405; RFC 9110 section 9.3.2 has a server answer HEAD wherever it answers
    GET, with GET's status and headers and no body."""
    async with http_stack() as (client, _, _down):
        for path in ("/openapi.json", "/api/v1/tasks/nope", "/api/v1/agent/nobody/status"):
            get, head = await client.get(path), await client.head(path)
            assert head.status_code == get.status_code != 405 and head.content == b"", (path, head.status_code)
            assert head.headers["Content-Type"] == get.headers["Content-Type"]



async def test_a_connection_that_sends_no_whole_request_head_is_closed_at_the_keepalive_timeout():
    """aiohttp's server keeps a connection that sends nothing, or a head a byte at a time, for an hour (its
    default keepalive_timeout is 3630 s): 30 such connections were all open after 100 s. The face closes it
    after ``orchestrator.http.keepalive_timeout_s`` (75 s; 1 s here), and one that made a request the same."""
    async with http_stack(**{"orchestrator.http.keepalive_timeout_s": 1.0}) as (client, _, _down):
        port = httpx.URL(str(client.base_url)).port
        idle = await asyncio.open_connection("127.0.0.1", port)
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nX-Slow: aaa")
        served = await asyncio.open_connection("127.0.0.1", port)
        served[1].write(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await served[0].readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        for reader, writer in (idle, partial, served):
            await asyncio.wait_for(reader.read(), timeout=30)  # to EOF: closed by the face (an hour before)
            writer.close()


async def test_a_wide_body_is_validated_off_the_event_loop(monkeypatch):
    """A body within the size limit made of 140,000 unknown keys took the orchestrator's loop for half a second:
    every stream waited. A body past PARSE_IN_THREAD_BYTES is validated in a worker thread; a short one inline.
    Here 14,000 keys (some 200 KB, three times the bound): where it is validated does not depend on how long."""
    from switchyard.orchestrator.http_face import PARSE_IN_THREAD_BYTES, HttpFace

    threads: list[tuple[int, int]] = []
    parse = HttpFace._parse

    def recorded(self, raw: bytes):
        threads.append((len(raw), threading.get_ident()))
        return parse(self, raw)

    monkeypatch.setattr(HttpFace, "_parse", recorded)
    wide = json.dumps({"agent_id": "x", "task_type": "chat", **{f"k{i}": i for i in range(14_000)}}).encode()
    async with http_stack() as (client, _, _down):
        loop_thread = threading.get_ident()
        reply = await client.post("/api/v1/agent/submit", content=wide, headers={"Content-Type": JSON})
        short = await client.post("/api/v1/agent/submit", json={**FIELD_BODY, "colour": "red"})
    assert reply.status_code == 400 and "and 13990 more errors" in reply.json()["error"]["message"]
    assert short.status_code == 400
    (wide_size, wide_thread), (short_size, short_thread) = threads
    assert wide_size > 3 * PARSE_IN_THREAD_BYTES and wide_thread != loop_thread
    assert short_size <= PARSE_IN_THREAD_BYTES and short_thread == loop_thread


async def test_a_status_lookup_by_an_id_submit_would_refuse_is_400_as_at_submit():
    async with http_stack() as (client, _, _down):
        by_agent = await client.get("/api/v1/agent/x%00y/status")
        by_task = await client.get("/api/v1/tasks/t%01")
    for reply, field in ((by_agent, "agent_id"), (by_task, "task_id")):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"].startswith(field)


async def test_a_method_a_route_does_not_serve_is_counted_under_that_routes_template():
    async with http_stack() as (client, _, _down):
        before = durations("DELETE", "/api/v1/tasks/{task_id}", "405")
        reply = await client.delete("/api/v1/tasks/x")
        assert reply.status_code == 405
    assert durations("DELETE", "/api/v1/tasks/{task_id}", "405") == before + 1


async def test_a_caller_without_a_token_is_refused_before_100_continue_invites_its_body(tmp_path):
    """With auth on, ``Expect: 100-continue`` from a caller with no token got ``100 Continue`` (inviting a 2 MB
    upload) and then 401; a 3 MB promise got 413 and a wrong type 415 before the 401. The token is checked first,
    and the refusal is counted like any answer."""
    path = tmp_path / "tokens"
    path.write_text("tok-full-1\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(path), "tokens_env": ""}}
    async with http_stack(**auth) as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        head = b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
        counted = durations("POST", "/api/v1/agent/submit", "401")
        for body_head in (b"Content-Type: application/json\r\nContent-Length: 2000000\r\n\r\n",
                          b"Content-Type: application/json\r\nContent-Length: 3000000\r\n\r\n",
                          b"Content-Type: text/plain\r\nContent-Length: 5\r\n\r\n"):
            answer = await _raw(port, head + body_head, whole=False)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
        assert durations("POST", "/api/v1/agent/submit", "401") == counted + 3
        invited = await _raw(port, head + b"Authorization: Bearer tok-full-1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 2\r\n\r\n", whole=False)
        assert invited.startswith(b"HTTP/1.1 100 Continue"), invited[:200]
        assert down.requests == []


async def test_headers_that_are_not_utf8_or_say_two_things_are_refused_by_name_never_a_500(tmp_path):
    """A Latin-1 byte in Authorization raised UnicodeEncodeError in the token check (500 on every guarded route);
    two different Authorization headers let the first one win; a Latin-1 byte in X-Agent-Id was named as the
    lone surrogate U+DCE9. Now: 401, 401, and 400 naming the byte."""
    path = tmp_path / "tokens"
    path.write_text("tok-full-1\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(path), "tokens_env": ""}}
    async with http_stack(**auth) as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        head = b"GET /api/v1/tasks/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        latin1 = await _raw(port, head + b"Authorization: Bearer t\xf6k\r\n\r\n")
        assert latin1.startswith(b"HTTP/1.1 401") and b"byte 0xF6 is not UTF-8" in latin1, latin1[:300]
        for first, second in ((b"tok-full-1", b"tok-nope"), (b"tok-nope", b"tok-full-1")):
            twice = await _raw(port, head + b"Authorization: Bearer " + first + b"\r\nAuthorization: Bearer " + second
                               + b"\r\n\r\n")
            assert twice.startswith(b"HTTP/1.1 401") and b"more than once, with different values" in twice, twice[:300]
        same_twice = await _raw(port, head + b"Authorization: Bearer tok-full-1\r\nAuthorization: Bearer tok-full-1"
                                b"\r\n\r\n")
        assert same_twice.startswith(b"HTTP/1.1 404"), same_twice[:300]  # one value, said twice: let in
        body = json.dumps({**FIELD_BODY, "agent_id": "", "task_type": "chat"}).encode()
        agent = await _raw(port, b"POST /api/v1/agent/submit HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"Authorization: Bearer tok-full-1\r\nContent-Type: application/json\r\n"
                           b"X-Agent-Id: ag\xe9nt\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert agent.startswith(b"HTTP/1.1 400"), agent[:300]
        message = json.loads(agent.partition(b"\r\n\r\n")[2])["error"]["message"]
        # the bytes as sent, the one escape of each: it read (got 'ag\\\\xe9nt'), quoted twice
        assert message == "x-agent-id header: expected UTF-8 text (byte 0xE9 is not UTF-8) (got b'ag\\xe9nt')", message
        assert down.requests == []


async def test_an_agents_status_is_its_own_tenants_agents_latest_task(tmp_path):
    """Tenant zeta's agent "shared" submitted after acme's: acme's bound token read 404 for its own agent (the
    lookup took the latest across tenants, then hid it). An agent is its tenant's and its id's."""
    path = tmp_path / "tokens"
    path.write_text("tok-all\ntok-acme tenant=acme\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(path), "tokens_env": ""}}
    async with http_stack(**auth) as (client, _, down):
        acme = {"Authorization": "Bearer tok-acme"}
        body = {**FIELD_BODY, "agent_id": "shared", "task_type": "chat"}
        mine = await client.post("/api/v1/agent/submit", json={**body, "task_id": "acme-1"}, headers=acme)
        assert mine.status_code == 200, mine.text
        theirs = await client.post("/api/v1/agent/submit", json={**body, "task_id": "zeta-1"},
                                   headers={"Authorization": "Bearer tok-all", "X-Tenant-Id": "zeta"})
        assert theirs.status_code == 200, theirs.text
        status = await client.get("/api/v1/agent/shared/status", headers=acme)
        assert status.status_code == 200 and status.json()["task_id"] == "acme-1", status.text
        zeta = await client.get("/api/v1/agent/shared/status",
                                headers={"Authorization": "Bearer tok-all", "X-Tenant-Id": "zeta"})
        assert zeta.status_code == 200 and zeta.json()["task_id"] == "zeta-1", zeta.text
        default = await client.get("/api/v1/agent/shared/status", headers={"Authorization": "Bearer tok-all"})
        assert default.status_code == 404, default.text  # the default tenant's agent "shared" submitted nothing


async def test_a_path_id_with_a_percent_escape_that_is_not_utf8_is_400_naming_the_byte():
    """/api/v1/agent/%FF/status looked up the agent literally named "%FF", which %25FF names too."""
    async with http_stack() as (client, _, down):
        port = httpx.URL(str(client.base_url)).port
        for path in (b"/api/v1/agent/%FF/status", b"/api/v1/tasks/t%FF", b"/api/v1/tasks/t%C3/cancel"):
            method = b"POST" if path.endswith(b"cancel") else b"GET"
            answer = await _raw(port, method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                b"Content-Length: 0\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
            assert b"is not UTF-8" in answer and (b"agent_id" in answer or b"task_id" in answer), answer
        named = await client.get("/api/v1/agent/%25FF/status")  # the agent named "%FF": only not found
        assert named.status_code == 404, named.text
        utf8 = await client.get("/api/v1/agent/agent-%C3%A9/status")  # agent-é: a UTF-8 escape is fine
        assert utf8.status_code == 404 and "agent 'agent-é'" in utf8.json()["error"]["message"], utf8.text


def test_every_task_state_has_one_http_name_which_the_answers_schema_lists():
    """The HTTP names of the task states come from one table (http_models.STATE_NAMES): every TaskState the
    proto knows has one, the answers' schemas enumerate exactly those, and a number the proto does not know
    reads unspecified."""
    from switchyard.orchestrator.http_models import STATE_NAMES, AcceptedResponse, TaskStatusResponse, state_name

    assert set(STATE_NAMES) == set(agent_pb2.TaskState.values())
    for model in (AcceptedResponse, TaskStatusResponse):
        assert model.model_json_schema()["properties"]["state"]["enum"] == list(STATE_NAMES.values())
    assert state_name(agent_pb2.SUCCEEDED) == "finished" and state_name(99) == "unspecified"
