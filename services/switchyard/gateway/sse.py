"""Server-sent events: reading an upstream's stream, writing sim-openai's.

Reading uses httpx-sse, which parses the WHATWG HTML "server-sent events"
event-stream format: ``field: value`` lines, CR/LF/CRLF line ends, an
empty line ending each event, multi-line ``data`` joined with ``\n``, empty
``data:``, comment lines (``:`` keep-alives), ``event:``, ``id:`` and ``retry:``.
The decoding is set here, as the format says and httpx-sse leaves to httpx: the
stream is UTF-8 whatever the Content-Type's charset, and one leading byte order
mark is ignored.
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

    The body is decoded as UTF-8 (a charset parameter is not read), a leading byte order mark dropped.
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
    # "Event streams are always decoded as UTF-8", "one leading U+FEFF BYTE ORDER MARK character must be
    # ignored" (WHATWG HTML, 9.2.5): httpx would decode by the charset and keep the BOM, which made the first
    # line's field '\ufeffdata', an unknown field, and lost the first chunk.
    response.encoding = "utf-8-sig"
    async for event in EventSource(response).aiter_sse():
        if event.data:
            yield event.data


def encode(payload: dict[str, Any] | str) -> bytes:
    """One SSE event: ``data: <json or text>`` and the blank line that ends it."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
