"""Failure injection for ``switchyard serve sim-openai``.

A fault spec is comma-separated ``key=value`` items and bare flags, e.g.
``status=503,fail_first=2`` or ``cut_after=3``. It reaches the server three ways
(first match wins): the request header ``x-sim-fault``; a model-name suffix
``MODEL#SPEC`` (a caller of the server or of the gateway picks a fault through
``model``); the server's ``--fault [MODEL=]SPEC`` flags (per model, or for all
models). Through Switchyard's stack a task's ``model`` must be one the upstream
lists (a suffixed name is refused NOT_FOUND before it is accepted): list a model
for the fault beside the models served by default (``--model`` replaces that list:
``--model claude-sonnet-4-5 --model gpt-4o-mini --model flaky --fault flaky=status=503``) and name it,
as ``tools/soak.py`` does.
"""

from __future__ import annotations

import email.utils
import math
from dataclasses import dataclass, fields
from typing import Iterable

FAULT_HEADER = "x-sim-fault"
MODEL_SUFFIX = "#"

_FLAGS = ("no_done", "no_finish", "mismatch", "expired", "echo_key", "no_choices")


@dataclass(frozen=True)
class Fault:
    """What goes wrong with one request.

    - ``status``: answer with this HTTP status and an OpenAI-style error body.
    - ``fail_first``: with ``status``, fail only the first N requests for the model, then serve.
    - ``cut_after``: close the connection after N streamed items, with no ``[DONE]``.
    - ``no_done``: end the stream cleanly after the finish chunk (and usage chunk) but without
      ``data: [DONE]``, as ``transformers serve`` does: a finished stream.
    - ``no_finish``: end the body cleanly after the content, with neither a ``finish_reason`` nor
      ``data: [DONE]``: a cut stream, though the connection closed in order.
    - ``malformed_after``: send a chunk that is not JSON after N streamed items.
    - ``stream_error``: after the role chunk, send an error object inside the stream with this status in its
      ``code`` (vLLM's shape: ``{"error": {"message", "type", "code"}}``) and end the body.
    - ``no_choices``: send chunks without a ``choices`` list.
    - ``slow_ms``: extra delay before each streamed item, milliseconds.
    - ``mismatch``: answer the whole chat completion as JSON when a stream was asked (a server or proxy that
      ignores ``stream``), SSE when JSON was asked.
    - ``expired``: answer 401 saying the OAuth token expired.
    - ``echo_key``: on 401, echo the presented bearer token in the body (as some proxies do).
    - ``retry_after``: with ``status``, send ``Retry-After: N`` (delta-seconds).
    - ``retry_after_ms``: with ``status``, send ``retry-after-ms: N`` (milliseconds, as OpenAI does).
    - ``retry_after_date``: with ``status``, send ``Retry-After`` as the HTTP-date N seconds from now.
    - ``finish``: end the answer with this ``finish_reason`` instead of its own (vLLM's ``abort``, TGI's
      ``eos_token``).
    - ``reasoning``: stream N pieces of thinking in ``delta.reasoning_content`` before the answer, as vLLM with a
      reasoning parser does (counted in the usage's completion tokens).
    - ``stream_type``: label the stream with this Content-Type instead of ``text/event-stream`` (``none``: no
      Content-Type header), as LitServe's OpenAI spec sent ``application/x-ndjson``.
    - ``said``: with ``status``, the error body's ``message`` in place of the status's own words (a server that
      names an address of its own in them, as a proxy's "connect to http://10.0.0.9:8000 failed" does).
    """

    status: int | None = None
    fail_first: int = 0
    cut_after: int | None = None
    no_done: bool = False
    no_finish: bool = False
    malformed_after: int | None = None
    stream_error: int | None = None
    no_choices: bool = False
    slow_ms: float = 0.0
    mismatch: bool = False
    expired: bool = False
    echo_key: bool = False
    retry_after: float | None = None
    retry_after_ms: float | None = None
    retry_after_date: float | None = None
    finish: str | None = None
    reasoning: int = 0
    stream_type: str = "text/event-stream"
    said: str | None = None

    def retry_headers(self, now: float) -> dict[str, str]:
        """The Retry-After headers of this fault's status answer; ``now`` is ``time.time()``."""
        headers = {}
        if self.retry_after is not None:
            headers["retry-after"] = f"{self.retry_after:g}"
        if self.retry_after_ms is not None:
            headers["retry-after-ms"] = f"{self.retry_after_ms:g}"
        if self.retry_after_date is not None:
            headers["retry-after"] = email.utils.formatdate(now + self.retry_after_date, usegmt=True)
        return headers


_INTS = {"status", "fail_first", "cut_after", "malformed_after", "stream_error", "reasoning"}
_WORDS = {"finish", "stream_type", "said"}
_STATUSES = {"status", "stream_error"}
_WITH_STATUS = ("fail_first", "retry_after", "retry_after_ms", "retry_after_date", "said")
"""Keys that shape a ``status`` answer, and do nothing without one."""


def _expected(key: str) -> str:
    """What a value of ``key`` is, as an error names it: a word, a whole number (a count or a status) or a
    number (a delay, a wait). cut_after=1.5 and stream_type= had both read 'expected ...=<number>'."""
    return "a word" if key in _WORDS else "a whole number" if key in _INTS else "a number"


def parse_fault(spec: str) -> Fault:
    """Parse ``"status=503,fail_first=1"``-style specs.

    Raises:
        ValueError: an unknown key, a value not of its key's kind (:func:`_expected`), a negative or infinite
            one, or a status outside 400-599, naming both; a key that shapes a status answer
            (:data:`_WITH_STATUS`) without ``status`` (``said=...`` or ``retry_after=30`` alone injected
            nothing, and the server started as if it did).
    """
    known = {f.name for f in fields(Fault)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key not in known:
            raise ValueError(f"fault {item!r}: unknown key {key!r}; expected one of {sorted(known)}")
        if key in _FLAGS:
            values[key] = raw.strip().lower() not in ("0", "false", "no") if sep else True
            continue
        if key in _WORDS and sep and raw.strip():
            values[key] = raw.strip()
            continue
        if not sep or key in _WORDS:  # a word left empty lands here too
            raise ValueError(f"fault {item!r}: expected {key}=<{_expected(key)}>" + (f", got {raw!r}" if sep else ""))
        try:
            value = values[key] = int(raw) if key in _INTS else float(raw)
        except ValueError:
            raise ValueError(f"fault {item!r}: expected {key}=<{_expected(key)}>, got {raw!r}") from None
        # status=999 closed the connection with no answer (the HTTP server knows no such status line), status=200
        # answered an error body as a success, and a negative count or delay was taken as none at all
        if key in _STATUSES and not 400 <= value <= 599:
            raise ValueError(f"fault {item!r}: expected {key}=<an HTTP error status, 400 to 599>, got {raw.strip()!r}")
        if not 0 <= value < math.inf:
            raise ValueError(f"fault {item!r}: expected {key}=<a finite number >= 0>, got {raw.strip()!r}")
    alone = [key for key in _WITH_STATUS if key in values]
    if alone and "status" not in values:
        one = len(alone) == 1
        raise ValueError(f"fault {spec!r}: {', '.join(alone)} {'shapes' if one else 'shape'} a status answer and "
                         f"{'injects' if one else 'inject'} nothing without one; add status=<an HTTP error status, "
                         f"400 to 599>, e.g. status=503,{alone[0]}=...")
    return Fault(**values)  # type: ignore[arg-type]


def split_model(model: str) -> tuple[str, Fault | None]:
    """``"gpt-4o-mini#cut_after=2"`` -> ``("gpt-4o-mini", Fault(cut_after=2))``; no suffix -> ``(model, None)``."""
    base, sep, spec = model.partition(MODEL_SUFFIX)
    return (base, parse_fault(spec)) if sep else (model, None)


def parse_flag(value: str, models: "Iterable[str] | None" = None) -> tuple[str, Fault]:
    """A ``--fault [MODEL=]SPEC`` flag -> (model or ``*``, fault): the one reader of the flag's syntax.

    ``gpt-4o-mini=status=503`` applies to that model (the part before the first ``=`` is not a fault key,
    spaces around it ignored as :func:`parse_fault` ignores them around a key); ``status=503`` applies to
    every model.

    Args:
        value: the flag's value.
        models: the models the server serves; None takes any head that is not a fault key as a model.

    Raises:
        ValueError: naming the flag and what was expected: a head that is neither a fault key nor one of
            ``models`` (``bogus=1`` was read as model ``bogus`` and said only "unknown key '1'"), a blank model
            (``=status=503``), a flag with no fault (``flaky=``, ``''``), a head that is both a fault key and
            one of ``models`` (``--model said --fault said=status=502`` read ``said`` as the key), or
            :func:`parse_fault`'s error.
    """
    keys = sorted(f.name for f in fields(Fault))
    head, sep, rest = value.partition("=")
    if sep and head.strip() in keys and models is not None and head in models:
        raise ValueError(f"{value!r}: {head!r} is both a fault key and a model served here, so which it names is not "
                         f"known; serve the model under another id (--model ID)")
    model, spec = (head, rest) if sep and head.strip() not in keys else ("*", value)
    if model != "*" and (not model.strip() or (models is not None and model not in models)):
        what = "a blank model id" if not model.strip() else f"{model!r} is neither a fault key nor a model served here"
        served = f"one of {', '.join(models)} (serve another with --model ID)" if models is not None else "a model id"
        raise ValueError(f"{value!r}: {what}; expected [MODEL=]SPEC with MODEL {served} and SPEC key=value items "
                         f"of: {' '.join(keys)}")
    try:
        fault = parse_fault(spec)
    except ValueError as exc:
        raise ValueError(f"{value!r}: {exc}") from None
    if fault == Fault():
        raise ValueError(f"{value!r}: expected a fault (key=value items of: {' '.join(keys)}), found none")
    return model, fault
