"""The HTTP face's listener over TLS: plain HTTP sent to it is answered 400, not closed in silence.

A client that sent plain HTTP to the face with ``server.tls`` on (``curl http://`` for ``https://``) had its
connection closed by the failed handshake and read an empty reply (curl: exit 52, "Empty reply from server"),
nothing saying why. Most servers answer it (nginx: 400 "The plain HTTP request was sent to HTTPS port").

Nothing of the request is parsed: a TLS connection opens with a handshake record, whose first byte is
:data:`TLS_HANDSHAKE` (0x16), and no HTTP request does (it opens with its method's letters). The listener accepts
each connection itself, peeks at its first byte (``MSG_PEEK``: nothing is taken from the socket) and hands the
socket to aiohttp's server over TLS (``loop.connect_accepted_socket``, the handshake as ``create_server``'s), or
writes :data:`PLAIN_HTTP_ANSWER` and closes after reading what the client sent (closing with its bytes unread
would reset the connection, and the client could lose the answer). asyncio's own TLS server consumes the first
bytes before it could tell, and cannot hand them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any, Callable

from aiohttp import web

log = logging.getLogger(__name__)

TLS_HANDSHAKE = 0x16
"""The first byte of every TLS connection: the record type of its ClientHello (handshake)."""
HANDSHAKE_TIMEOUT_S = 60.0
"""Longest wait for a connection's first byte and then its TLS handshake (asyncio's own default for the
handshake, which ``create_server`` used)."""
DRAIN_S = 1.0
"""Longest time the client's plain request is read (and dropped) after the answer, before the close."""
DRAIN_BYTES = 64 * 1024
"""Most bytes of the client's plain request read (and dropped) after the answer."""
ACCEPT_RETRY_S = 1.0
"""Pause after an accept that failed (out of file descriptors), as asyncio's server pauses."""

_BODY = b"plain HTTP sent to an HTTPS port: this server takes https:// only (server.tls is on)\n"
PLAIN_HTTP_ANSWER = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     b"Content-Length: " + str(len(_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BODY)
"""The whole answer to a connection that did not open with a TLS handshake."""


class _Listener:
    """The bound sockets and their accept loops, in the part of ``asyncio.Server`` an aiohttp site uses:
    ``sockets`` and ``close()`` (stop accepting; connections being served go on)."""

    def __init__(self, sockets: list[socket.socket], context: ssl.SSLContext,
                 factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self.sockets = sockets
        self._context = context
        self._factory = factory
        self._tasks = {asyncio.create_task(self._accept(s), name="https-accept") for s in sockets}
        self._connections: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        """Stop accepting, and drop the connections not yet handed to aiohttp (silent, or being answered 400):
        those handed over are the runner's to end."""
        for task in (*self._tasks, *self._connections):
            task.cancel()  # each closes its socket as it ends

    async def _accept(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(listening)
                except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the connection waits in the backlog
                    log.warning("HTTP face: accept failed (%s); retrying in %g s", exc, ACCEPT_RETRY_S)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                    continue
                task = asyncio.create_task(self._serve(conn), name="https-connection")
                self._connections.add(task)
                task.add_done_callback(self._connections.discard)
        finally:
            listening.close()

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                first = await _peek(loop, conn)
            if not first:  # closed before it sent anything
                conn.close()
            elif first[0] == TLS_HANDSHAKE:
                await loop.connect_accepted_socket(self._factory, conn, ssl=self._context,
                                                   ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
            else:
                await _answer_plain(loop, conn)
        except (OSError, TimeoutError) as exc:  # a failed handshake (ssl.SSLError is an OSError), a reset, silence
            log.debug("HTTP face: connection dropped before its first request (%s)", exc)
            conn.close()
        except asyncio.CancelledError:  # the face stops
            conn.close()
            raise


async def _peek(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    """The connection's first byte, left in the socket; b"" when it was closed first."""
    while True:
        try:
            return conn.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(conn.fileno())


async def _answer_plain(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    """:data:`PLAIN_HTTP_ANSWER`, then read what the client sent until it closes (or :data:`DRAIN_S`,
    :data:`DRAIN_BYTES`), then close."""
    try:
        await loop.sock_sendall(conn, PLAIN_HTTP_ANSWER)
        conn.shutdown(socket.SHUT_WR)
        read = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_S):
                while read < DRAIN_BYTES and (chunk := await loop.sock_recv(conn, 4096)):
                    read += len(chunk)
    finally:
        conn.close()


class HttpsSite(web.TCPSite):
    """aiohttp's TCP site over TLS (``ssl_context``), with plain HTTP answered 400 (see the module docstring).
    Binds as ``loop.create_server`` does: every address ``host`` resolves to, ``SO_REUSEADDR``, IPv6 sockets
    IPv6 only."""

    async def start(self) -> None:
        self._runner._reg_site(self)  # web.BaseSite.start's one step
        assert self._ssl_context is not None and self._runner.server is not None
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host or None, self._port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(self._backlog)
                sock.setblocking(False)
        except OSError:
            for sock in sockets:
                sock.close()
            raise
        server: Any = _Listener(sockets, self._ssl_context, self._runner.server)
        self._server = server
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
