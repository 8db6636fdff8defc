"""Server-sent events framing (the subset OpenAI-compatible servers use).

Per the WHATWG HTML "server-sent events" section: lines ``field: value``; an
empty line ends an event; ``data`` lines of one event are joined with ``\\n``;
lines starting with ``:`` are comments (keep-alives).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

DONE = "[DONE]"


async def iter_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the ``data`` payload of each event read from ``lines`` (one text line per item).

    Events without data (comments, bare ``event:``/``id:``/``retry:``) are skipped.
    A final event not followed by an empty line is still yielded.
    """
    data: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def encode(payload: dict[str, Any] | str) -> bytes:
    """One SSE event: ``data: <json or text>`` and the blank line that ends it."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
