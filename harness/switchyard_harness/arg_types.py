"""argparse types of the numbers the benchmarks and tools take, one rule each.

A bare ``type=int`` or ``type=float`` takes every number: ``--concurrency 0`` started no worker and the
run waited forever, ``--calls 0`` was a traceback, ``--minutes -1`` ran nothing and reported ``ok``,
``nan`` passed every ``<= 0`` check. Each type here refuses what its flag cannot mean, and argparse
names the flag beside the message (``argument --concurrency: expected a whole number >= 1, got '0'``),
exit status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit

from switchyard.common.config.model_gateway import url_problem
from switchyard.common.grpc_target import grpc_target


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # refused by every range below, named as given


def _whole(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def positive(text: str) -> float:
    """A finite number > 0 (seconds, a rate): inf never ended, nan passed ``<= 0``."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0 (a wait that may be none)."""
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (a spread, a share): 1 or more left nothing, a negative one is no spread."""
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def count(text: str) -> int:
    """A whole number >= 1 (calls, workers, rounds): 0 of them did nothing, or divided by it."""
    value = _whole(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def max_tokens(text: str) -> int:
    """A task's max_tokens: a whole number >= 0 (0: the stack's default). A negative one had every call refused
    400 / INVALID_ARGUMENT, and the run went on to print the refusals as its result."""
    value = _whole(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens >= 0 (0: the stack's default), "
                                         f"got {text!r}")
    return value


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host (the HTTP face, a /metrics URL), without a trailing ``/``:
    ``nohost`` or ``localhost:8080`` was a traceback from the HTTP client ("URL should be absolute") once the
    run began."""
    url = text.strip()
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or past 65535
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL with a host and a port in 1-65535, "
                                         f"such as http://127.0.0.1:8080, got {text!r}")
    return url.rstrip("/")


def model_server_url(text: str) -> str:
    """An OpenAI-compatible server's API root (``http://host:port/v1``), held to the rule ``model_gateway.base_url``
    is (:func:`switchyard.common.config.model_gateway.url_problem`): the chat completions URL pasted for the root
    (``.../v1/chat/completions``) was taken, then its ``/models`` could not be listed and its calls went to
    ``.../chat/completions/chat/completions``."""
    url = http_url(text)
    problem = url_problem(url)
    if problem:
        raise argparse.ArgumentTypeError(f"expected an OpenAI-compatible server's root, such as "
                                         f"http://127.0.0.1:8000/v1, got {text!r}: {problem}")
    return url


def grpc_address(text: str) -> str:
    """A gRPC target the services dial (``host:port``...; :func:`switchyard.common.grpc_target.grpc_target`):
    ``nohost`` had every call of the run fail UNAVAILABLE."""
    try:
        return grpc_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port(text: str) -> int:
    """A TCP port a server binds, 0 (a free one) to 65535: ``--port 70000`` printed a server 'ready' at ``:70000``,
    an address no client can dial."""
    value = _whole(text)
    if value is None or not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 0 (a free one) to 65535, got {text!r}")
    return value
