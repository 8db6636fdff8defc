"""The HTTP face's OpenAPI document checked by a real OpenAPI validator (openapi-spec-validator) and against the
routes the application serves, and the SSE endpoint read by ``curl -N`` as a user at a terminal reads it,
reconnection with Last-Event-ID included; real aiohttp server on 127.0.0.1 port 0."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator
from test_http_face import FIELD_BODY, http_stack

from switchyard.common.config import load_config
from switchyard.orchestrator.http_face import HttpFace

pytestmark = pytest.mark.no_gpu

CHAT = {**FIELD_BODY, "task_type": "chat"}
CORS = {"orchestrator.http.cors_allowed_origins": ["https://dash.example.com"]}


@pytest.mark.parametrize("overrides", [{}, CORS], ids=["cors-off", "cors-on"])
async def test_the_openapi_document_is_valid_openapi_3_1_and_lists_every_route_the_face_serves(overrides):
    """/openapi.json itself was served and not in the document, nor HEAD beside each GET; with CORS on, the
    preflight routes. Both ways: each route of the application is an operation, each operation a route."""
    async with http_stack(**overrides) as (client, _, _down):
        reply = await client.get("/openapi.json")
        doc = reply.json()
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in OpenAPIV31SpecValidator(doc).iter_errors()]
    assert errors == []
    config = load_config("config", service="orchestrator").with_overrides(**overrides)
    served = {(route.method.lower(), route.resource.canonical)
              for route in HttpFace(None, config).app().router.routes()}  # the routes as the face builds them
    documented = {(method, path) for path, operations in doc["paths"].items() for method in operations}
    assert served == documented
    assert any(method == "options" for method, _ in documented) == bool(overrides)


async def _curl(*args: str) -> tuple[int, str, str]:
    """curl's exit status, the answer's head (-D -: status line and headers) and body, as it printed them."""
    process = await asyncio.create_subprocess_exec(
        "curl", "--silent", "--show-error", "--max-time", "60", "-D", "/dev/stderr", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, head = await process.communicate()
    return process.returncode, head.decode(), out.decode()


def _events(stream: str) -> list[dict[str, str]]:
    """The events of an SSE body as curl printed it: each block's fields (comment lines skipped)."""
    events = []
    for block in stream.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields:
            events.append(fields)
    return events


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_n_reads_the_stream_and_a_reconnection_with_last_event_id_is_not_run_again():
    async with http_stack(**{"orchestrator.http.sse_keepalive_s": 0.05}) as (client, _, down):
        url = f"{client.base_url}/api/v1/agent/run"
        post = ["-N", "-H", "Content-Type: application/json", "--data", json.dumps(CHAT), url]
        status, head, body = await _curl(*post)
        assert status == 0 and head.startswith("HTTP/1.1 200") and "text/event-stream" in head, head
        events = _events(body)
        assert [e["event"] for e in events][0] == "accepted" and events[-1]["event"] == "final", events
        assert all(json.loads(e["data"]) for e in events) and events[-1]["id"].endswith(":end")
        assert len(down.requests) == 1

        # a client reconnecting after the whole stream: 204, nothing run again
        status, head, body = await _curl("-H", f"Last-Event-ID: {events[-1]['id']}", *post)
        assert status == 0 and head.startswith("HTTP/1.1 204") and body == "", head
        # after a stream it lost part way: 409 in the error shape, nothing run again
        status, head, body = await _curl("-H", f"Last-Event-ID: {events[0]['id']}", *post)
        assert head.startswith("HTTP/1.1 409"), head
        assert json.loads(body)["error"]["code"] == "ABORTED" and "Last-Event-ID" in json.loads(body)["error"]["message"]
        assert len(down.requests) == 1

        # a stream quiet while its task waits: curl -N prints the keepalive comment lines as they come
        down.gate = asyncio.Event()
        running = asyncio.create_task(_curl(*post))
        while len(down.requests) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # several keepalive periods of quiet
        down.gate.set()
        status, head, body = await running
        assert status == 0 and ":\n\n" in body and _events(body)[-1]["event"] == "final", body[:300]
