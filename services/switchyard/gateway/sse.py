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
no use here. The media type is the caller's to read, and it is not what decides:
a body that opens as an event stream is one under any label
(:func:`opens_as_events`), as the OpenAI Python SDK reads every answer to a
stream request, whatever its Content-Type.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any, AsyncIterator

from httpx_sse import ServerSentEvent
from httpx_sse._decoders import SSEDecoder, SSELineDecoder  # the format's rules; EventSource has no hook for a field

DONE = "[DONE]"
ERROR_EVENT = "error"
"""The type of an event that carries an error object (``event: error``, or llama.cpp's ``error:`` field)."""
_ERROR_FIELD = ERROR_EVENT + ":"


STRAY_CHARS = 2_000
"""How much of a body's lines that are no field of the format :func:`iter_events` keeps, characters."""

_FIELDS = frozenset({"data", "event", "id", "retry"})


_BOM = codecs.BOM_UTF8
_OPENING = re.compile(rb"(?:data|event|id|retry|error)?:")
"""How an event stream's first line opens: a field of the format (or llama.cpp's ``error``) and its colon, or a
comment's colon."""
OPENING_BYTES = len(b"retry:")
"""How much of a body, past a byte order mark and blank lines, :func:`opens_as_events` reads to tell, bytes."""


async def opening(chunks: AsyncIterator[bytes]) -> tuple[bytes, AsyncIterator[bytes]]:
    """The first bytes of a body (at least :data:`OPENING_BYTES` past a byte order mark and blank lines, unless it
    is shorter), and the whole body again, those bytes first, for whoever reads it next."""
    head = b""
    async for chunk in chunks:
        head += chunk
        if len(head.removeprefix(_BOM).lstrip(b"\r\n")) >= OPENING_BYTES:
            break
    return head, _chained(head, chunks)


async def _chained(head: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if head:
        yield head
    async for chunk in chunks:
        yield chunk


def opens_as_events(head: bytes) -> bool:
    """Whether a body whose first bytes are ``head`` (:func:`opening`) is an event stream: past one byte order mark
    and blank lines, its first line is a field of the format (``data:``, ``event:``, ``id:``, ``retry:``, or
    llama.cpp's ``error:``) or a ``:`` comment. A JSON body opens with ``{``, a proxy's page with ``<``.

    Servers label their streams otherwise: LitServe's OpenAI spec sends ``application/x-ndjson``, Microsoft's
    Foundry Local ``application/json``, a proxy may drop the header; the OpenAI Python SDK reads the answer to a
    stream request as events whatever its Content-Type, so each of them works with it."""
    return _OPENING.match(head.removeprefix(_BOM).lstrip(b"\r\n")) is not None


async def iter_events(chunks: AsyncIterator[bytes], stray: list[str] | None = None) -> AsyncIterator[ServerSentEvent]:
    """Yield each event of a body, its bytes in ``chunks`` (``response.aiter_bytes()``, or :func:`opening`'s), that
    carries data.

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
    # line's field '\ufeffdata', an unknown field, and lost the first chunk. A byte that is no UTF-8 is U+FFFD.
    text_of = codecs.getincrementaldecoder("utf-8-sig")("replace")
    lines, fields = SSELineDecoder(), SSEDecoder()
    kept = 0  # characters in stray
    async for chunk in chunks:
        for line in lines.decode(text_of.decode(chunk)):
            if stray is not None:
                kept = _keep_stray(stray, line, kept)
            if (event := _event(fields, line)) is not None:
                stray = None  # the body holds events: what else it holds is ignored, as the format says
                yield event
    for line in [*lines.decode(text_of.decode(b"", final=True)), *lines.flush()]:
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
