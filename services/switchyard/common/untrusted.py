"""Parsing and quoting text that comes from outside (callers, models, upstreams) without letting its shape hurt
the server.

``json.loads`` of a deeply nested document raises ``RecursionError``, which is
not a ``ValueError``: a handler that catches only ``JSONDecodeError`` answers
UNKNOWN with a traceback. :func:`loads` turns every way a document can be
unreadable into one :class:`ValueError` that names why.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
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


_DECIMAL = re.compile(r"[+-]?[0-9]+")


def json_integer(value: Any, *, digits: bool = False) -> int | None:
    """The integer a JSON ``value`` holds, or None when it holds none.

    JSON has one number type: ``0`` and ``0.0`` are the same number, and some servers' serializers write every
    number as a float (``"index": 0.0``, ``"prompt_tokens": 12.0``), so an integral float is its integer. None for a
    non-integral or non-finite float, a boolean (``true`` is no 1), null, and anything else; a string of decimal
    digits (``"0"``, some proxies quote numbers) only when ``digits``, and not past the digits ``int()`` reads
    (``sys.get_int_max_str_digits()``, 4300: it raised ValueError out of the stream's decoder). The one reader of "an integer from an
    upstream's JSON": a choice's and a tool call's ``index``, ``usage`` counts, an in-stream error's ``code``, a
    model's ``max_model_len``.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if digits and isinstance(value, str) and _DECIMAL.fullmatch(value):
        try:
            return int(value)
        except ValueError:  # more digits than int() converts
            return None
    return None


class _Pairs(list):  # type: ignore[type-arg]
    """A JSON object's (key, value) pairs, in the order read (``json.loads``'s ``object_pairs_hook``)."""


def duplicate_key(raw: str | bytes) -> str | None:
    """The dotted path (``metadata.k``, ``orchestrator.port``, ``a[2].b``) of the first key that appears twice
    in one object of the JSON document ``raw``, or None: ``json.loads`` keeps the last value of a key given
    twice, and which one counts is not a parser's to decide (an HTTP body, a config file). ``raw`` is valid
    JSON (parsed once already)."""
    try:
        return _first_twice(json.loads(raw, object_pairs_hook=_Pairs), "")
    except (ValueError, RecursionError):
        return None


def _first_twice(node: Any, path: str) -> str | None:
    if isinstance(node, _Pairs):
        seen: set[str] = set()
        for key, value in node:
            name = f"{path}.{key}" if path else key
            if key in seen:
                return name
            seen.add(key)
            if (found := _first_twice(value, name)) is not None:
                return found
    elif isinstance(node, list):
        for i, item in enumerate(node):
            if (found := _first_twice(item, f"{path}[{i}]")) is not None:
                return found
    return None


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters of it, with the value's length
    when cut: a message quoting a caller's 20,000-character id whole went past gRPC's 16 KiB limit on
    metadata, and the caller got RESOURCE_EXHAUSTED from the transport instead of the error."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, (str, bytes)) else f"{len(text)} characters shown"
    return f"{text[:limit]}... ({size})"


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def undecodable_byte(value: str) -> int | None:
    """The first byte of ``value`` that was not UTF-8 where it was read (a header, the environment, a file
    name: Python keeps such a byte as a surrogate escape, ``surrogateescape``), or None."""
    found = _ESCAPED_BYTE.search(value)
    return None if found is None else ord(found.group()) - 0xDC00


def check_utf8(value: str, field: str) -> str:
    """``value``, text from a header: an HTTP header's bytes that are not UTF-8 arrive as surrogate escapes
    (aiohttp decodes headers with ``surrogateescape``), refused here by name with the byte shown, where the id
    checks would have named a lone surrogate.

    Raises:
        InvalidArgument: naming ``field``: the first byte that is not UTF-8, and the value as the bytes it came
            as (at most 80 of them: ``b'caf\\xe9'``, each such byte once escaped; the text with the byte written
            out as ``\\xNN`` was quoted again, and read ``'caf\\\\xe9'``).
    """
    from switchyard.common.errors import InvalidArgument  # errors quotes values with shown(): no cycle at import

    byte = undecodable_byte(value)
    if byte is not None:
        raise InvalidArgument(field, f"UTF-8 text (byte 0x{byte:02X} is not UTF-8)",
                              value.encode("utf-8", "surrogateescape")[:80])
    return value


BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Unicode's Bidi_Control characters (PropList.txt; UAX #9): they reorder the text around them as it is shown,
so an id holding one reads as another in a log, a dashboard or a terminal (CVE-2021-42574, "Trojan Source")."""


_UNSEEN = {"Cc": "control", "Cs": "control", "Cf": "invisible format", "Zl": "line separator",
           "Zp": "paragraph separator", "Zs": "space other than U+0020"}
"""The Unicode general categories of characters an id may not hold, by what they are called in the refusal:
controls and lone surrogates, format characters (zero-width space, joiners, the byte order mark, soft hyphen,
tag characters), the line and paragraph separators (a new line to a log reader), and the spaces that look like
U+0020 or like nothing (no-break, thin, ideographic)."""


ID_PATTERN = (r"^(?! )(?!.* $)[^\x00-\x1f\x7f-\xa0\xad\u061c\u1680\u180e\u2000-\u200f\u2028-\u202f\u205f-\u2064\u2066-\u206f"
              r"\u3000\ufeff\ufff9-\ufffb]*$")
""":func:`check_id_chars` as far as a regular expression that ECMA-262 (JSON Schema's, OpenAPI's) and Python both
read can say it: no space at its start or end (spaces alone included), and none of the controls (C0, DEL, C1), the spaces other than U+0020, the
line and paragraph separators, and the common invisible format and bidirectional characters. What it does not
say (the rarer format characters, lone surrogates, NFC) the function still refuses; every string it refuses,
the function refuses too (test_http_clients.py)."""


def check_id_chars(value: str, field: str, blank_ok: bool = True) -> None:
    """An id (task, agent, model, request) is text that prints as it is, and so reads as only itself, at every
    edge that takes one: no character of the categories of :data:`_UNSEEN` (controls, lone surrogates, invisible
    format characters such as U+200B zero-width space, line and paragraph separators, spaces other than U+0020),
    none of the bidirectional controls (:data:`BIDI_CONTROLS`), in Unicode's composed form (NFC: 'cafe' with
    U+0301 reads as 'café', another id), not only whitespace unless empty (``blank_ok``: empty means
    "none"), and no space at its start or end: 'agent\u200b1' read as 'agent1' and was another task's agent in a
    log, a dashboard or a query, and ' t1' was another id than the 't1' a header (whose surrounding whitespace
    HTTP and gRPC strip) names. Refused, never stripped: the caller's id is the one it will look the task up by.

    Raises:
        InvalidArgument: naming ``field`` and the first such character, or the form expected.
    """
    from switchyard.common.errors import InvalidArgument  # errors quotes values with shown(): no cycle at import

    if (value and not value.strip()) or (not value and not blank_ok):
        raise InvalidArgument(field, "an id of printable characters, not blank", value[:80])
    if value != value.strip(" "):
        raise InvalidArgument(field, "an id of printable characters with no space at its start or end (the "
                              "OpenAPI document's id pattern)", value[:80])
    if not value.isprintable():  # every character refused below is one isprintable() refuses
        for c in value:
            kind = "bidirectional" if c in BIDI_CONTROLS else _UNSEEN.get(unicodedata.category(c))
            if kind is not None and c != " ":
                raise InvalidArgument(field, f"an id of printable characters (no {kind} characters; found "
                                      f"U+{ord(c):04X})", value[:80])
    if not value.isascii() and not unicodedata.is_normalized("NFC", value):
        raise InvalidArgument(field, "an id in Unicode's composed form, NFC (it reads as its NFC form "
                              f"{unicodedata.normalize('NFC', value[:80])!r}, another id)", value[:80])


def check_id(value: str, field: str, most: int, setting: str = "max_id_chars", *, required: bool = False) -> None:
    """An id field's rule at every edge that takes one (the orchestrator's RunTask, SubmitTask and lookups and
    its x-agent-id header; the dispatcher's Generate and ToolWait): at most ``most`` characters, the ``limits``
    setting named ``setting``; not empty where ``required``; and :func:`check_id_chars`.

    Raises:
        InvalidArgument: naming ``field`` and the bound it broke.
    """
    from switchyard.common.errors import InvalidArgument  # as check_id_chars: no cycle at import

    if len(value) > most or (required and not value):
        bound = f"1 to {most}" if required else f"at most {most}"
        raise InvalidArgument(field, f"{bound} characters (limits.{setting})", f"{len(value)} chars")
    check_id_chars(value, field)


def check_seconds(value: float, field: str, zero_means: str = "", at_most: float = math.inf) -> float:
    """``value``, a caller's number of seconds: finite, 0 or more and at most ``at_most`` (NaN, infinities and
    negatives read as "no bound" where they were let through). ``zero_means``: what 0 stands for, in the message.

    Raises:
        InvalidArgument: naming ``field``.
    """
    from switchyard.common.errors import InvalidArgument

    if not (math.isfinite(value) and 0 <= value <= at_most):
        bound = "0 or more" if at_most == math.inf else f"from 0 to {at_most:g}"
        raise InvalidArgument(field, f"a finite number of seconds, {bound}" + (f" (0: {zero_means})" if zero_means
                                                                               else ""), value)
    return value


_KEPT_CONTROLS = frozenset("\n\t")


def terminal_safe(text: str, keep: frozenset[str] = _KEPT_CONTROLS) -> str:
    """``text`` with every control character (Unicode category Cc: C0, DEL, C1) but those in ``keep`` written
    out as ``\\xNN``: what a task sends back (the model's tokens, tool calls and results, passage titles,
    an upstream's error, a model server's answer to ``switchyard doctor``) is not the terminal's to obey. An ESC
    in a token reached the terminal as is, so a model's output (or a document it quoted) could clear the screen,
    retitle the window or hide text."""
    if text.isprintable():  # the common case: nothing to escape (a control character is never printable)
        return text
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in keep else c for c in text)
