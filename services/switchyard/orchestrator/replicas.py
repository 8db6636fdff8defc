"""The dispatcher replicas behind one target, and which one an agent's call goes to.

A target names one replica (``host:port``), a fixed list
(``ipv4:10.0.0.5:50053,10.0.0.6:50053``, what ``switchyard up --dispatchers N``
passes), or a DNS name that resolves to every ready pod of a headless Service
(``dns:///dispatcher:50053``, re-resolved every ``resolve_interval_s``). Each
replica gets its own channel from :func:`switchyard.common.channels.open_channel`,
and agents are placed on replicas by :class:`~switchyard.common.affinity.BoundedLoadRing`,
so an agent's calls reach the replica that holds its warm state (KV of earlier
turns, parked while it waits on a tool). The same ring bounds the calls in
flight: while an agent's replica has more than ``balance`` x the mean calls in
flight, its overflow goes to the next replica on the ring, and its calls come
home as the load drops (the caller reports each call's start and end:
:meth:`ReplicaSet.started`, :meth:`ReplicaSet.finished`). Agents idle for
``idle_s`` are forgotten; a replica that leaves the DNS answer moves only its
own agents. Calls with no agent take the replicas in turn. Either way the caller knows
which replica a call went to, so an error can name it, and replicas whose
connection failed are skipped until it recovers.

With TLS on (``server.tls``), a replica's channel connects to its address,
an IP for a ``dns:`` target: the dispatchers' certificate must name the
Service (set ``tls.server_name`` to it, which every channel then checks) or
carry the pods' addresses.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from switchyard.common.channels import open_channel
from switchyard.common.affinity import BoundedLoadRing
from switchyard.common.config import ServerConfig
from switchyard.common.dns import resolve_addresses
from switchyard.common.grpc_target import dns_name, static_addresses
from switchyard.common.tasks import settle

log = logging.getLogger(__name__)

RETIRE_AFTER_S = 180.0
"""A channel to a replica that left is closed this long after (its running calls finish first)."""


def _dns_host_port(target: str) -> tuple[str, int]:
    """``dns:///name:port`` or ``dns://authority/name:port`` -> (name, port).

    Raises:
        ValueError: no port in the target.
    """
    host, sep, port = (dns_name(target) or "").rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"dispatcher_addr {target!r}: expected dns:///NAME:PORT")
    return host.strip("[]"), int(port)


class ReplicaSet:
    """Per-replica channels and the affinity ring for one dispatcher target.

    Args:
        target: the dispatcher target (``orchestrator.dispatcher_addr``).
        config: ``server``, for the channels.
        idle_s: an agent not seen for this long is forgotten (its replica's load drops).
        resolve_interval_s: seconds between DNS resolutions of a ``dns:`` target.
        balance: the affinity ring's load bound.
    """

    def __init__(self, target: str, config: ServerConfig, idle_s: float, resolve_interval_s: float,
                 balance: float) -> None:
        self.target, self.config = target, config
        self.idle_s, self.resolve_interval_s = idle_s, resolve_interval_s
        self.ring = BoundedLoadRing(balance=balance)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[tuple[float, grpc.aio.Channel]] = []
        self._static = static_addresses(target)
        self._resolved_at = float("-inf")
        self._resolving: asyncio.Task[None] | None = None
        self._turn = -1
        self.in_flight: dict[str, int] = {}
        """Calls running on each replica (from :meth:`started` to :meth:`finished`), this orchestrator's."""
        self.unhealthy: frozenset[str] = frozenset()
        """Replicas whose last health check did not answer SERVING (set by orchestrator/readiness.py)."""
        if self._static is not None:
            self._update(self._static)

    def _update(self, addresses: list[str]) -> None:
        now = time.monotonic()
        for address in sorted(set(addresses) - set(self.channels)):
            self.channels[address] = open_channel(address, self.config, peer="dispatcher")
            self.ring.add(address)
        for address in sorted(set(self.channels) - set(addresses)):
            moved = self.ring.remove(address)
            self._retired.append((now, self.channels.pop(address)))
            log.info("dispatcher replica %s left %s; %d agent(s) move", address, self.target, len(moved))

    async def _resolve(self) -> None:
        host, port = _dns_host_port(self.target)
        try:
            addresses = await resolve_addresses(host, port)
        except OSError as exc:
            log.warning("resolving %s failed (%s); keeping %d replica(s)", self.target, exc, len(self.channels))
            return
        if addresses:
            self._update(addresses)

    async def refresh(self) -> None:
        """Re-resolve a ``dns:`` target when ``resolve_interval_s`` has passed (waits only for the first
        resolution; later ones run in the background) and close channels retired long enough ago."""
        now = time.monotonic()
        if self._static is None and now - self._resolved_at >= self.resolve_interval_s:
            self._resolved_at = now
            if not self.channels:
                await self._resolve()
            elif self._resolving is None or self._resolving.done():
                self._resolving = settle(asyncio.create_task(self._resolve(), name="dispatcher-resolve"),
                                         expected=lambda e: False)
        while self._retired and now - self._retired[0][0] >= RETIRE_AFTER_S:
            await self._retired.pop(0)[1].close()

    def down(self) -> frozenset[str]:
        """Replicas whose channel is in TRANSIENT_FAILURE (the connection failed; gRPC retries it at most
        every 2 s): calls avoid them until it recovers."""
        failed = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        return frozenset(a for a, channel in self.channels.items() if channel.get_state(True) == failed)

    def _avoid(self, exclude: frozenset[str]) -> frozenset[str]:
        avoid = exclude | self.down() | (self.unhealthy & set(self.channels))
        return exclude if avoid >= set(self.channels) else avoid  # all down: let the call say so

    def pick(self, agent: str, exclude: frozenset[str] = frozenset()) -> tuple[str, grpc.aio.Channel]:
        """The replica (address, channel) for ``agent``'s next call: its home, or the overflow replica while its
        home has more than its bound of calls in flight; an agent whose replica is down or in ``exclude`` is
        placed anew.

        Raises:
            LookupError: no replica known, or all excluded.
        """
        now = time.monotonic()
        self.ring.expire(now, self.idle_s)
        address, _home = self.ring.route(agent, self.in_flight, now, self._avoid(exclude))
        return address, self.channels[address]

    def started(self, address: str) -> None:
        """A call to ``address`` (from :meth:`pick` or :meth:`rotate`) is running: it counts on its load."""
        self.in_flight[address] = self.in_flight.get(address, 0) + 1

    def finished(self, address: str) -> None:
        """A call :meth:`started` on ``address`` ended (whatever its outcome)."""
        left = self.in_flight.get(address, 0) - 1
        if left > 0:
            self.in_flight[address] = left
        else:
            self.in_flight.pop(address, None)

    def rotate(self, exclude: frozenset[str] = frozenset()) -> tuple[str, grpc.aio.Channel]:
        """The next replica in turn (a call with no agent), skipping those down or in ``exclude``.

        Raises:
            LookupError: no replica known, or all excluded.
        """
        avoid = self._avoid(exclude)
        addresses = [a for a in sorted(self.channels) if a not in avoid]
        if not addresses:
            raise LookupError("no dispatcher replica to call")
        self._turn = (self._turn + 1) % len(addresses)
        address = addresses[self._turn]
        return address, self.channels[address]

    async def close(self) -> None:
        """Close every channel, retired ones included."""
        if self._resolving is not None:
            self._resolving.cancel()
        for channel in [*self.channels.values(), *(c for _, c in self._retired)]:
            await channel.close()
        self.channels.clear()
        self._retired.clear()
