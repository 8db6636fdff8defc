"""One name resolved to the addresses of every replica behind it: a headless Service's ready pods, each an
``ip:port`` (``[v6]:port`` for IPv6). The orchestrator's dispatcher replicas (orchestrator/replicas.py) and the
gateway's pool of model servers (gateway/pool.py) both re-resolve their names with it."""

from __future__ import annotations

import asyncio
import socket


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as ``ip:port`` or ``[v6]:port`` with ``port``, sorted, without repeats
    (one per replica, however many socket types the resolver answered for it).

    Raises:
        OSError: the name did not resolve (``socket.gaierror``); the caller keeps the replicas it had.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
                   for info in infos})
