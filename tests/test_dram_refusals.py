"""A DRAM tier that refuses writes backs off (issue 26, item 3): a real Redis at a tiny maxmemory with
noeviction answers every write with ``OOM command not allowed``; the client logs once when the refusals begin
and once when they end, never a payload byte, and skips writes in between but for one probe per interval."""

from __future__ import annotations

import logging

import pytest
import redis
from prometheus_client import REGISTRY
from redis_fixtures import RedisDb, start_redis

from switchyard.common.dram import DramClient, describe_error
from switchyard.dispatcher.tiers import KvStore

pytestmark = pytest.mark.no_gpu
MARK = b"PAYLOAD-BYTES\x00\x01"


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def _hset_calls(client: redis.Redis) -> int:
    """HSET commands the server received, executed or rejected (INFO commandstats)."""
    stats = client.info("commandstats").get("cmdstat_hset", {})
    return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0)) + int(stats.get("failed_calls", 0))


async def test_a_full_redis_is_backed_off_and_logged_once_per_episode_without_payload_bytes(
        caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis()  # a server of its own: it is filled up
    try:
        sync = redis.Redis(host=server.host, port=server.port)
        used = int(sync.info("memory")["used_memory"])
        sync.config_set("maxmemory-policy", "noeviction")
        sync.config_set("maxmemory", used + 64 * 1024)  # room for about nothing
        db = RedisDb(server.host, server.port, 0)
        client = DramClient(db.dram_config.model_copy(update={"retry_interval_s": 3600.0}))
        store = KvStore(client, 7200)
        payload = MARK * (64 * 1024 // len(MARK))
        refusals, degraded = metric("switchyard_dram_write_refusals_total"), metric(
            "switchyard_dram_degraded_operations_total")
        with caplog.at_level(logging.DEBUG, logger="switchyard.common.dram"):
            calls = _hset_calls(sync)
            results = [await store.put(store.key("seq", f"r{i}"), payload, tokens=100, nbytes=100, priority="batch",
                                       hits=0, cost_us=1.0) for i in range(200)]
            assert not any(results)  # every swap-out is a miss later, none raised
            reached = _hset_calls(sync) - calls
            assert reached <= 2, "writes skip a refusing Redis instead of asking it each time"
            assert not store.available() and client.up  # no swap is planned; reads and deletes still go
            assert await client.call(lambda r: r.get("absent"), "fallback", "read") is None
            assert metric("switchyard_dram_write_refusals_total") == refusals + 1
            assert metric("switchyard_dram_degraded_operations_total") == degraded + 200

            # room again; once the probe is due, the next write goes through and ends the episode
            sync.config_set("maxmemory", 0)
            client._next_write_try = 0.0  # the retry interval has passed (not waited out: 3600 s)
            assert await store.put(store.key("seq", "after"), payload, tokens=100, nbytes=100, priority="batch",
                                   hits=0, cost_us=1.0)
            assert store.available()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        print(f"\nfull Redis: 200 swap-outs, {reached} HSET reached the server, {len(warnings)} WARNING lines")
        assert len(warnings) == 2, warnings
        assert "refuses writes" in warnings[0] and "OutOfMemoryError: command not allowed" in warnings[0]
        assert "accepts writes again" in warnings[1] and "199 writes skipped" in warnings[1]
        for record in caplog.records:
            text = record.getMessage()
            assert "PAYLOAD" not in text and "\\x00" not in text and "\x00" not in text
        await store.aclose()
        sync.close()
    finally:
        server.stop()


def test_describe_error_keeps_the_server_message_and_drops_a_pipeline_command_s_arguments() -> None:
    exc = redis.ResponseError("Command # 1 (HSET k payload b'\\x00\\x01PAYLOAD' tokens 5) of pipeline caused error: "
                              "('OOM command not allowed when used memory > 'maxmemory'.',)")
    text = describe_error(exc)
    assert text.startswith("ResponseError: OOM command not allowed") and "PAYLOAD" not in text and "HSET" not in text
    assert describe_error(ConnectionError("x" * 500 + "\x00")).endswith("...")
    assert "\x00" not in describe_error(ConnectionError("a\x00b"))


async def test_a_write_refused_for_itself_does_not_stop_other_writes(caplog: pytest.LogCaptureFixture) -> None:
    """WRONGTYPE is about one key, not the server: the write is a miss, logged once, and other writes go on."""
    server = start_redis()
    try:
        client = DramClient(RedisDb(server.host, server.port, 0).dram_config)
        await client.call(lambda r: r.set("switchyard:wrong", "a string"), None, "setup")
        with caplog.at_level(logging.DEBUG, logger="switchyard.common.dram"):
            for _ in range(3):
                assert await client.call(lambda r: r.rpush("switchyard:wrong", "x"), "missed", "agent memory record",
                                         grows=True) == "missed"
            assert client.accepts_writes()
            assert await client.call(lambda r: r.rpush("switchyard:right", "x"), "missed", "agent memory record",
                                     grows=True) == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "WRONGTYPE" in warnings[0], warnings
        await client.close()
    finally:
        server.stop()


async def test_a_call_past_its_bound_is_named_with_the_bound_not_a_bare_timeout_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under load (the field's locust run) a call ran past op_timeout_s + connect_timeout_s (asyncio's timeout, which
    has no message) and the outage read 'failed agent memory record: TimeoutError: .'. It names the bound now; any
    other exception without a message is its class alone."""
    import asyncio

    server = start_redis()
    try:
        config = RedisDb(server.host, server.port, 0).dram_config.model_copy(
            update={"op_timeout_s": 0.05, "connect_timeout_s": 0.05})
        client = DramClient(config)

        async def slow(redis_client):  # an operation that answers after its bound: a loop too busy to read it
            await redis_client.ping()
            await asyncio.sleep(5)

        with caplog.at_level(logging.WARNING, logger="switchyard.common.dram"):
            assert await client.call(slow, "fallback", "agent memory record") == "fallback"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and not client.up, warnings
        assert ("failed agent memory record: no answer within 0.1 s (memory_policy.toml [dram] op_timeout_s + "
                "connect_timeout_s). Work goes on without it") in warnings[0], warnings
        assert describe_error(TimeoutError()) == "TimeoutError"
        assert describe_error(ConnectionError(" ")) == "ConnectionError"
        await client.close()
    finally:
        server.stop()


async def test_more_calls_at_once_than_redis_connections_wait_for_one_and_the_tier_stays_up(
        caplog: pytest.LogCaptureFixture) -> None:
    """redis-py's pool refuses a call beyond its size (100) at once with MaxConnectionsError, a ConnectionError:
    a burst of calls on a healthy Redis read as an outage, the tier skipped for retry_interval_s. A call finding
    every connection in use waits for one ([dram] max_connections)."""
    import asyncio

    server = start_redis()
    try:
        for config in (RedisDb(server.host, server.port, 0).dram_config,
                       RedisDb(server.host, server.port, 0).dram_config.model_copy(update={"max_connections": 2})):
            client = DramClient(config)
            with caplog.at_level(logging.WARNING, logger="switchyard.common.dram"):
                answers = await asyncio.gather(*(client.call(lambda r, n=n: r.set(f"switchyard:burst:{n}", n),
                                                             "missed", "agent memory record") for n in range(400)))
            assert answers == [True] * 400 and client.up
            assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            await client.close()
    finally:
        server.stop()
