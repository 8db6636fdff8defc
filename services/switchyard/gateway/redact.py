"""Keep API keys out of logs, spans, error messages and metrics.

Upstream error bodies may echo the key (OpenAI echoes a masked prefix; some
proxies echo it whole), so every upstream text that reaches a message passes
through :func:`redact` first. :class:`RedactingFilter` is a second line of
defence on log handlers.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

REDACTED = "[redacted]"

# "Bearer <token>" and OpenAI-style "sk-..." keys, whatever the key in use is.
_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\bsk-[A-Za-z0-9_*-]{8,}"),
)


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with each secret (as given and stripped of whitespace) and any bearer token replaced.

    Secrets shorter than 4 characters are left alone (they would mask ordinary words).
    """
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, secret.strip()}:
            if len(form) >= 4:
                text = text.replace(form, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.re.groups else "") + REDACTED, text)
    return text


def safe_url(url: str) -> str:
    """``url`` fit for a message: without its user and password (``http://user:key@host``), query and fragment
    (``?api-key=...``), where credentials ride in a URL; scheme, host, port and path kept."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]  # the host[:port] after any userinfo
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class RedactingFilter(logging.Filter):
    """A log filter that rewrites each record's message with :func:`redact`.

    Attach it to handlers (``handler.addFilter``): filters on a logger do not
    see records propagated from child loggers.
    """

    def __init__(self, *secrets: str | None) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message, *self.secrets)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def install_log_redaction(*secrets: str | None) -> RedactingFilter:
    """Add a :class:`RedactingFilter` to every handler of the root logger; returns it.

    Idempotent: a handler that already holds a filter for the same secrets is left alone.
    """
    flt = RedactingFilter(*secrets)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) and f.secrets == flt.secrets for f in handler.filters):
            handler.addFilter(flt)
    return flt
