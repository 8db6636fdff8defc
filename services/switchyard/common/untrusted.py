"""Parsing text that comes from outside (callers, models, upstreams) without letting its shape hurt the server.

``json.loads`` of a deeply nested document raises ``RecursionError``, which is
not a ``ValueError``: a handler that catches only ``JSONDecodeError`` answers
UNKNOWN with a traceback. :func:`loads` turns every way a document can be
unreadable into one :class:`ValueError` that names why.
"""

from __future__ import annotations

import json
from typing import Any


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
