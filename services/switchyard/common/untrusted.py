"""Parsing and quoting text that comes from outside (callers, models, upstreams) without letting its shape hurt
the server.

``json.loads`` of a deeply nested document raises ``RecursionError``, which is
not a ``ValueError``: a handler that catches only ``JSONDecodeError`` answers
UNKNOWN with a traceback. :func:`loads` turns every way a document can be
unreadable into one :class:`ValueError` that names why.
"""

from __future__ import annotations

import json
from typing import Any

SHOWN_CHARS = 100
"""The most characters of an outside value an error message quotes (:func:`shown`)."""


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``, with too-deep nesting reported as a ``ValueError`` like any other bad JSON.

    Raises:
        ValueError: not JSON, or nested deeper than the parser's recursion limit
            (``json.JSONDecodeError`` is a ``ValueError``).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters of it, with the value's length
    when cut: a message quoting a caller's 20,000-character id whole went past gRPC's 16 KiB limit on
    metadata, and the caller got RESOURCE_EXHAUSTED from the transport instead of the error."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, (str, bytes)) else f"{len(text)} characters shown"
    return f"{text[:limit]}... ({size})"
