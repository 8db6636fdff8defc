"""Server-sent events: reading an upstream's stream, writing sim-openai's.

Reading uses httpx-sse, which parses the WHATWG HTML "server-sent events"
event-stream format in full: ``field: value`` lines, CR/LF/CRLF line ends, an
empty line ending each event, multi-line ``data`` joined with ``\n``, empty
``data:``, comment lines (``:`` keep-alives), ``event:``, ``id:`` and ``retry:``.
A completion stream is read once, so ``id`` and ``retry`` (reconnection) have
no use here; events of any type are passed on by their data.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx
from httpx_sse import EventSource

DONE = "[DONE]"


async def iter_data(response: httpx.Response) -> AsyncIterator[str]:
    """Yield the ``data`` of each event of ``response`` (``text/event-stream``).

    Events without data (a bare ``event:``, ``id:`` or ``retry:``) are skipped.
    As the format says, an event cut off before its empty line is not dispatched:
    a stream whose ``data: [DONE]`` has no empty line after it ended early.

    The media type is matched case-insensitively, as RFC 9110 section 8.3.1 says
    (``Text/Event-Stream;charset=UTF-8`` is ``text/event-stream``); httpx-sse compares it
    as written, so the header is lower-cased first.

    Raises:
        httpx_sse.SSEError: the response is not ``text/event-stream``.
        httpx.HTTPError: the connection failed while reading.
    """
    content_type = response.headers.get("content-type")
    if content_type is not None and content_type != content_type.lower():
        response.headers["content-type"] = content_type.lower()
    async for event in EventSource(response).aiter_sse():
        if event.data:
            yield event.data


def encode(payload: dict[str, Any] | str) -> bytes:
    """One SSE event: ``data: <json or text>`` and the blank line that ends it."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
