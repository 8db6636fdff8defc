"""The orchestrator's HTTP face against the clients its users read it with: httpx with its timeouts, httpx-sse,
aiohttp's client, and a reconnecting EventSource-style consumer; real aiohttp server on 127.0.0.1 port 0 beside
the real gRPC server, the fixed downstream of test_orchestrator.py."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest
from httpx_sse import aconnect_sse
from test_http_face import FIELD_BODY, http_stack

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
        client.timeout = httpx.Timeout(30, read=0.5)
        down.gate = asyncio.Event()
        releasing = asyncio.create_task(_release_after(down, 1.5))  # three read timeouts of quiet
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
        releasing = asyncio.create_task(_release_after(down, 1.5))
        timeout = aiohttp.ClientTimeout(total=None, sock_read=0.5)
        async with aiohttp.ClientSession(str(client.base_url), timeout=timeout) as session:
            async with session.post("/api/v1/agent/run", json=CHAT) as reply:
                assert reply.status == 200 and reply.content_type == "text/event-stream"
                kinds = [line.decode().split(": ", 1)[1].strip() async for line in reply.content
                         if line.startswith(b"event: ")]
        await releasing
        assert kinds[0] == "accepted" and kinds[-1] == "final", kinds
