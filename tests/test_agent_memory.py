"""Agent memory in a real Redis (the DRAM tier), and what a Redis outage does: tasks go on without it."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client import REGISTRY
from redis_fixtures import RedisOutage, redis_db, redis_server, start_redis  # noqa: F401
from test_orchestrator import collect, stack

from switchyard.api import agent_pb2
from switchyard.common.dram import DramClient
from switchyard.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError

pytestmark = pytest.mark.no_gpu


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_an_agents_memory_carries_into_its_next_task(redis_db):
    async with stack(**{f"memory.{k}": v for k, v in _dram(redis_db).items()}) as (stub, down):
        first = await collect(stub, payload="What does with do, and what is 12*(3+4)?", task_type="react_loop",
                              agent_id="agent-7")
        assert {"recall", "remember"} <= {e.stage.name for e in first if e.HasField("stage")}
        before = len(down.requests)
        await collect(stub, payload="And what did the calculator say?", task_type="chat", agent_id="agent-7")
        await collect(stub, payload="Who am I?", task_type="chat", agent_id="someone-else")
    second, other = down.requests[before], down.requests[before + 1]
    roles = [(m.role, m.content) for m in second.messages]
    assert roles[0][0] == "system" and roles[-1] == ("user", "<question>And what did the calculator say?</question>")
    assert ("user", "What does with do, and what is 12*(3+4)?") in roles
    assert ("assistant", "The answer.") in roles
    assert ("system", "Earlier tool result from calculator: 12*(3+4) = 84") in roles
    assert not other.messages and other.prompt  # another agent recalls nothing: a plain prompt
    async with redis_db.client() as client:
        stored = [json.loads(m) for m in await client.lrange("switchyard:agent:agent-7:memory", 0, -1)]
        ttl = await client.pttl("switchyard:agent:agent-7:memory")
    assert [m["role"] for m in stored] == ["user", "tool", "tool", "assistant", "user", "assistant"]
    assert 0 < ttl <= 3600 * 1000


def _dram(db) -> dict:
    return {"dram.embedded": False, "dram.host": db.host, "dram.port": db.port, "dram.db": db.db}


async def test_memory_is_trimmed_cut_and_bounded_in_the_prompt(redis_db):
    overrides = {f"memory.{k}": v for k, v in _dram(redis_db).items()}
    overrides.update({"memory.agent_memory.max_entries": 4, "memory.agent_memory.max_entry_chars": 20,
                      "memory.agent_memory.recall_chars": 30})
    async with stack(**overrides) as (stub, down):
        for i in range(3):
            await collect(stub, payload=f"question number {i} " + "x" * 50, task_type="chat", agent_id="a")
    async with redis_db.client() as client:
        stored = [json.loads(m) for m in await client.lrange("switchyard:agent:a:memory", 0, -1)]
    assert len(stored) == 4 and all(len(m["content"]) <= 20 for m in stored)
    assert stored[0]["content"].startswith("question number 1")
    recalled = [m for m in down.requests[-1].messages if m.role in ("user", "assistant")][:-1]
    assert sum(len(m.content) for m in recalled) <= 30 and recalled  # newest first within recall_chars


async def test_memory_that_would_overflow_the_context_window_is_left_out(redis_db):
    overrides = {f"memory.{k}": v for k, v in _dram(redis_db).items()}
    overrides.update({"limits.context_window_tokens": {"sim-7b": 400}})
    async with stack(**overrides) as (stub, down):
        await collect(stub, payload="word " * 200, task_type="chat", agent_id="big", max_tokens=100)
        events = await collect(stub, payload="word " * 200, task_type="chat", agent_id="big", max_tokens=100)
    assert events[-1].HasField("final")  # memory never fails a task
    assert not down.requests[-1].messages  # it ran without its memory
    assert REGISTRY.get_sample_value("switchyard_agent_memory_recalls_total", {"outcome": "dropped"}) >= 1


@pytest.mark.parametrize("ratio", [1.0, 2.5])
async def test_memory_is_left_out_where_the_servers_count_of_the_prompt_would_overflow_the_window(redis_db, ratio):
    """The dispatcher measured the model server counting ``ratio`` of its tokens per token of the orchestrator's
    count: memory that fits the window as counted here, but not as the server counts, is left out."""
    overrides = {f"memory.{k}": v for k, v in _dram(redis_db).items()}
    overrides.update({"limits.context_window_tokens": {"sim-7b": 800}})
    async with stack(**overrides) as (stub, down):
        down.prompt_token_ratios = {"sim-7b": ratio}
        agent = f"ratio-{ratio}"
        await collect(stub, payload="word " * 150, task_type="chat", agent_id=agent, max_tokens=100)
        events = await collect(stub, payload="word " * 150, task_type="chat", agent_id=agent, max_tokens=100)
    assert events[-1].HasField("final")
    recalled = [m.content for m in down.requests[-1].messages if m.role == "user"][:-1]
    assert recalled == ([] if ratio > 1 else ["word " * 150])  # ~320 tokens with it: 800 of the server's at 2.5


async def test_a_redis_outage_degrades_logs_once_and_tasks_still_succeed(caplog):
    server = start_redis()
    outage = RedisOutage(server)
    try:
        overrides = {"memory.dram.embedded": False, "memory.dram.host": server.host, "memory.dram.port": server.port,
                     "memory.dram.retry_interval_s": 3600}
        async with stack(**overrides) as (stub, down):
            await collect(stub, payload="remember me", task_type="chat", agent_id="o")
            outages, degraded = _metric("switchyard_dram_outages_total"), _metric("switchyard_dram_degraded_operations_total")
            outage.begin()
            caplog.set_level(logging.WARNING, logger="switchyard.common.dram")
            for _ in range(3):
                events = await collect(stub, payload="still there?", task_type="chat", agent_id="o")
                assert events[-1].final.output == "The answer."
            assert not down.requests[-1].messages  # no memory while Redis is down
            assert _metric("switchyard_dram_outages_total") == outages + 1
            assert _metric("switchyard_dram_degraded_operations_total") >= degraded + 6  # recall + remember x 3
            assert _metric("switchyard_dram_up") == 0
            lines = [r.getMessage() for r in caplog.records if "DRAM tier unavailable" in r.getMessage()]
            assert len(lines) == 1 and f"Redis at {server.host}:{server.port}" in lines[0]
    finally:
        server.stop()


async def test_the_tier_comes_back_after_an_outage(caplog):
    server = start_redis()
    outage = RedisOutage(server)
    try:
        from switchyard.common.config import DramTierConfig

        client = DramClient(DramTierConfig(embedded=False, host=server.host, port=server.port, retry_interval_s=0.01))
        assert await client.call(lambda r: r.set("k", "v"), False)
        outage.begin()
        assert await client.call(lambda r: r.get("k"), "fallback") == "fallback" and not client.up
        outage.end()
        caplog.set_level(logging.WARNING, logger="switchyard.common.dram")
        for _ in range(100):  # the next try after retry_interval_s reaches the restarted server
            if await client.call(lambda r: r.ping(), False):
                break
            await asyncio.sleep(0.02)
        assert client.up and _metric("switchyard_dram_up") == 1
        assert any("DRAM tier back" in r.getMessage() for r in caplog.records)
        await client.close()
    finally:
        server.stop()


async def test_an_idle_service_reports_an_outage_and_the_return_without_a_call(caplog):
    """switchyard_dram_up moved only with calls: an idle service read 1 through a whole outage (no alert, no
    log line), and once a call had found the outage, 0 after Redis was back until the next call."""
    from switchyard.common.config import DramTierConfig

    async def until_up(value: float) -> None:
        for _ in range(200):
            if _metric("switchyard_dram_up") == value:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"switchyard_dram_up never read {value}")

    server = start_redis()
    outage = RedisOutage(server)
    client = DramClient(DramTierConfig(embedded=False, host=server.host, port=server.port, retry_interval_s=0.05,
                                       op_timeout_s=0.2, connect_timeout_s=0.2))
    try:
        caplog.set_level(logging.WARNING, logger="switchyard.common.dram")
        assert await client.start() and _metric("switchyard_dram_up") == 1
        outages, degraded = _metric("switchyard_dram_outages_total"), _metric("switchyard_dram_degraded_operations_total")
        outage.begin()
        await until_up(0)  # no call made: the service's own ping found it
        assert not client.up and _metric("switchyard_dram_outages_total") == outages + 1
        assert any("DRAM tier unavailable" in r.getMessage() and "failed ping" in r.getMessage() for r in caplog.records)
        outage.end()
        await until_up(1)
        assert client.up and any("DRAM tier back" in r.getMessage() for r in caplog.records)
        assert _metric("switchyard_dram_degraded_operations_total") == degraded  # a ping is no work skipped
    finally:
        await client.close()
        server.stop()


def test_embedded_redis_refuses_a_port_where_a_redis_already_answers(redis_server):
    """It said only "set [dram] embedded = false to use it", which for another stack's embedded Redis leads to
    the next clash; it names that Redis's pid and folder and the way out (--free-ports)."""
    with pytest.raises(EmbeddedRedisError, match=r"a Redis already answers at .*\[dram\] embedded = false") as taken:
        EmbeddedRedis(redis_server.host, redis_server.port).start()
    assert "redis-server pid " in str(taken.value) and "--free-ports" in str(taken.value)


async def test_two_tenants_agents_of_one_id_never_read_each_others_memory(redis_db):
    """An agent is its tenant's and its id's: tenant zeta's agent "victim" remembers a secret, and tenant
    acme's agent "victim" recalls none of it (its memory was read from one key for both)."""
    async with stack(**{f"memory.{k}": v for k, v in _dram(redis_db).items()}) as (stub, down):
        async def ask(tenant: str, payload: str) -> None:
            async for _ in stub.RunTask(agent_pb2.RunTaskRequest(payload=payload, task_type="chat", agent_id="victim"),
                                        metadata=(("x-tenant-id", tenant),)):
                pass

        await ask("zeta", "The zeta vault code is 4242.")
        before = len(down.requests)
        await ask("acme", "What is the vault code?")
        await ask("zeta", "And the code again?")
        await ask("default", "Anything?")
    acme, zeta, default = down.requests[before:before + 3]
    assert not acme.messages and "4242" not in acme.prompt  # recalls nothing: a plain prompt
    assert any("4242" in m.content for m in zeta.messages)  # its own tenant's agent still remembers
    assert not default.messages
    async with redis_db.client() as client:
        assert await client.exists("switchyard:agent:zeta\x1fvictim:memory")
        assert await client.exists("switchyard:agent:acme\x1fvictim:memory")
        assert await client.exists("switchyard:agent:victim:memory")  # the default tenant's keeps the bare id


async def test_a_dispatcher_with_a_dram_tier_reports_it_up_from_its_start(redis_db):
    """switchyard_dram_up read 0 on a fresh dispatcher, Redis up, until the tier was first used (a swap): an
    alert on it fired for every idle dispatcher."""
    from switchyard.common.config import SwitchyardConfig
    from switchyard.common.dram import DRAM_UP
    from switchyard.dispatcher.service import DispatcherService

    DRAM_UP.set(0)  # the process's gauge, as a fresh dispatcher process has it
    service = DispatcherService(SwitchyardConfig().with_overrides(**redis_db.overrides))
    assert service.tiers.store is not None
    await service.start()
    try:
        assert _metric("switchyard_dram_up") == 1
    finally:
        await service.stop()
