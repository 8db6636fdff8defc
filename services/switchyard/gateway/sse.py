"""Server-sent events: reading an upstream's stream, writing sim-openai's.

Reading uses httpx-sse's decoders, which parse the WHATWG HTML "server-sent events"
event-stream format: ``field: value`` lines, CR/LF/CRLF line ends, an
empty line ending each event, multi-line ``data`` joined with ``\n``, empty
``data:``, comment lines (``:`` keep-alives), ``event:``, ``id:`` and ``retry:``.
Two rules are kept here, as the format says and httpx-sse leaves to its caller:
the stream is UTF-8 whatever the Content-Type's charset, and one leading byte
order mark is ignored. And one server's variation: llama.cpp writes a streamed
error as an ``error:`` field (``server_sent_event(sink, "error", ...)``), a
field the format ignores; it is read as an ``error`` event of that data.
A completion stream is read once, so ``id`` and ``retry`` (reconnection) have
no use here. The media type is checked by the caller (the gateway client names
the URL and what came instead).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx
from httpx_sse import ServerSentEvent
from httpx_sse._decoders import SSEDecoder, SSELineDecoder  # the format's rules; EventSource has no hook for a field

DONE = "[DONE]"
ERROR_EVENT = "error"
"""The type of an event that carries an error object (``event: error``, or llama.cpp's ``error:`` field)."""
_ERROR_FIELD = ERROR_EVENT + ":"


STRAY_CHARS = 2_000
"""How much of a body's lines that are no field of the format :func:`iter_events` keeps, characters."""

_FIELDS = frozenset({"data", "event", "id", "retry"})


async def iter_events(response: httpx.Response, stray: list[str] | None = None) -> AsyncIterator[ServerSentEvent]:
    """Yield each event of ``response`` (``text/event-stream``) that carries data.

    Events without data (a bare ``event:``, ``id:`` or ``retry:``) are skipped.
    As the format says, an event cut off before its empty line is not dispatched:
    a stream whose ``data: [DONE]`` has no empty line after it ended early.
    The body is decoded as UTF-8 (a charset parameter is not read), a leading byte order mark dropped.
    ``stray`` gathers the lines that are no field of the format (ignored, as it says) until the first event, up to
    :data:`STRAY_CHARS`: what a body labelled ``text/event-stream`` held instead of events (a server's whole JSON
    error, a proxy's HTML page), for the caller to name.

    Raises:
        httpx.HTTPError: the connection failed while reading.
    """
    # "Event streams are always decoded as UTF-8", "one leading U+FEFF BYTE ORDER MARK character must be
    # ignored" (WHATWG HTML, 9.2.5): httpx would decode by the charset and keep the BOM, which made the first
    # line's field '\ufeffdata', an unknown field, and lost the first chunk.
    response.encoding = "utf-8-sig"
    lines, fields = SSELineDecoder(), SSEDecoder()
    kept = 0  # characters in stray
    async for text in response.aiter_text():
        for line in lines.decode(text):
            if stray is not None:
                kept = _keep_stray(stray, line, kept)
            if (event := _event(fields, line)) is not None:
                stray = None  # the body holds events: what else it holds is ignored, as the format says
                yield event
    for line in lines.flush():
        if stray is not None:
            kept = _keep_stray(stray, line, kept)
        if (event := _event(fields, line)) is not None:
            yield event


def _keep_stray(stray: list[str], line: str, kept: int) -> int:
    """Add ``line`` to ``stray`` (holding ``kept`` characters) when it is no field of the format (nor a comment,
    nor an event's end) and :data:`STRAY_CHARS` are not kept yet; returns the characters kept."""
    if not line or line.startswith((":", _ERROR_FIELD)) or line.partition(":")[0] in _FIELDS or kept >= STRAY_CHARS:
        return kept
    stray.append(line)
    return kept + len(line)


def _event(fields: SSEDecoder, line: str) -> ServerSentEvent | None:
    """Decode one line; the event it ends, when that carries data."""
    if line.startswith(_ERROR_FIELD):  # llama.cpp's streamed error: read as 'event: error' and its data
        fields.decode(f"event: {ERROR_EVENT}")
        line = "data:" + line[len(_ERROR_FIELD):]
    event = fields.decode(line)
    return event if event is not None and event.data else None


def encode(payload: dict[str, Any] | str) -> bytes:
    """One SSE event: ``data: <json or text>`` and the blank line that ends it."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
