"""A real HTTP proxy on 127.0.0.1 that logs each request line and answers 503.

It stands in for the corporate or developer proxy that ``http_proxy`` /
``https_proxy`` point at: any channel that honours those variables sends it a
``CONNECT host:port`` and fails, so a test can show that a channel did not.
"""

from __future__ import annotations

import contextlib
import socketserver
import threading
from typing import Iterator

import pytest

PROXY_VARIABLES = ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy")
NO_PROXY_VARIABLES = ("no_proxy", "NO_PROXY", "no_grpc_proxy")


class RefusingProxy(socketserver.ThreadingTCPServer):
    """``requests`` holds the first line of every request received (e.g. ``CONNECT 127.0.0.1:5001 HTTP/1.1``)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def environment(self) -> dict[str, str]:
        """Every proxy variable pointed at this proxy."""
        return {name: self.url for name in PROXY_VARIABLES}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(65536).decode("latin-1").strip()
        if line:
            self.server.requests.append(line)  # type: ignore[attr-defined]
        while self.rfile.readline(65536) not in (b"\r\n", b"\n", b""):
            pass
        self.wfile.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def start_refusing_proxy() -> RefusingProxy:
    proxy = RefusingProxy()
    # a 10 ms poll: shutdown() waits for the next one (0.5 s by default, at the end of each test that uses it)
    threading.Thread(target=proxy.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    return proxy


@contextlib.contextmanager
def proxied_environment() -> Iterator[RefusingProxy]:
    """Every proxy variable of this process (and its children) points at a :class:`RefusingProxy`;
    no NO_PROXY. Restored, and the proxy stopped, on exit."""
    proxy = start_refusing_proxy()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in proxy.environment().items():
                patch.setenv(name, value)
            for name in NO_PROXY_VARIABLES:
                patch.delenv(name, raising=False)
            yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.fixture
def refusing_proxy() -> Iterator[RefusingProxy]:
    with proxied_environment() as proxy:
        yield proxy
