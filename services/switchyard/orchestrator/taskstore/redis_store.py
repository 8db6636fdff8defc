"""The task store in Redis (``task_store.backend = "redis"``): one store for every orchestrator replica.

It uses the DRAM tier's Redis (``memory_policy.toml [dram]``). Keys, under
``[dram] key_prefix``:

- ``task:{task_id}``: a hash (fingerprint, state, owner, trace_id, spec, error, result,
  timings, created_at, updated_at, finished_at; a hash written before records kept ``spec`` reads it ''); a finished task's hash expires
  ``retention_s`` after it finished;
- ``agent:{agent_id}:tasks``: a sorted set of the agent's last task_ids by creation time
  (:data:`AGENT_TASKS_KEPT` of them). It has no TTL while one of them is unfinished; when the last of them
  finishes (or is deleted) it expires ``2 * retention_s`` later, after its tasks' records;
- ``tasks:unfinished``: a set of the task_ids not yet finished (the orphan sweep reads it);
- ``tasks:finished``: a sorted set of finished task_ids by finish time (the
  ``max_finished_tasks`` bound);
- ``orchestrators``: a hash of the orchestrators' leases, owner -> JSON (expires_at, host, pid), with no TTL
  of its own (see :data:`LEASES`); an expired entry is removed by the next purge;
- ``cancels:{owner}``: a set of the task_ids other orchestrators asked ``owner`` to cancel
  (``SPOP``-ed by the owner). It has no TTL while ``owner`` holds a lease in ``orchestrators`` (its renewal
  removes one); an owner without a lease (a former build's, or one that stopped), or whose run-out lease the
  purge removes, has its set expire ``3 * lease_s`` later; a clean stop deletes it.

Create, update and the owner's compare-and-set (release, adopt) are Lua scripts, so a check and its write are one atomic step
even with several replicas. For tasks to survive a restart of Redis itself, that
Redis must persist (``appendonly yes``, as the embedded Redis of ``switchyard up`` and
``deploy/k8s/base/redis.yaml`` do).

Nothing a live task or a live orchestrator depends on has a TTL: a Redis full at ``maxmemory`` under a
``volatile-*`` policy (``volatile-lru`` in ``deploy/k8s/base/redis.yaml``) evicts only keys with one (agent
memory, swapped KV state, finished tasks and the task sets of agents with no unfinished task).
"""

from __future__ import annotations

import json
import time
from typing import Any, Awaitable, TypeVar

from redis.exceptions import RedisError

from switchyard.api import agent_pb2
from switchyard.common.config import DramTierConfig, TaskStoreConfig
from switchyard.common.dram import describe_error, redis_client
from switchyard.common.tenant import agent_key
from switchyard.orchestrator.taskstore.base import Lease, TaskRecord, TaskStore, TaskStoreUnavailable

T = TypeVar("T")

LEASES = "orchestrators"
"""The key (under ``key_prefix``) of the hash of every orchestrator's lease. Each lease had been a key of its own
set with a TTL (``orchestrator:{owner}``, PX lease_s), which a full Redis under volatile-lru may evict: another
replica then read a live orchestrator dead, failed its RUNNING tasks as orphans and adopted its QUEUED ones. The
hash has no TTL, so it is never evicted; a lease's own ``expires_at`` says when it ran out."""
LEGACY_LEASE = "orchestrator:"
"""The key prefix of a lease as builds before :data:`LEASES` wrote it, still read (an orchestrator of the former
build, in a rolling upgrade, is alive while its key is)."""

AGENT_TASKS_KEPT = 8
"""Task ids remembered per agent: the latest answers GET /api/v1/agent/{agent_id}/status; the ones before it
stand in while the latest's record is gone (refused before it was queued)."""

# KEYS: task hash, unfinished set, the agent's sorted set (or ''); ARGV: task_id, created_at, kept, fields...
_CREATE = """
local existing = redis.call('HGETALL', KEYS[1])
if #existing > 0 then return existing end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('SADD', KEYS[2], ARGV[1])
if KEYS[3] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -tonumber(ARGV[3]) - 1)
  redis.call('PERSIST', KEYS[3])
end
return {}
"""

# expire_agent_set(agent, unfinished, ttl): the agent's set (its key, or '': none) gets a TTL of ttl ms unless one of
# its tasks is still in the unfinished set: while one is, its agent's status lookup needs the set (no TTL: never
# evicted); once none is, it may go as its finished tasks' records may (it outlives them: ttl is 2 * retention).
_AGENT_SET_EXPIRY = """
local function expire_agent_set(agent, unfinished, ttl)
  if agent == '' then return end
  for _, id in ipairs(redis.call('ZRANGE', agent, 0, -1)) do
    if redis.call('SISMEMBER', unfinished, id) == 1 then return end
  end
  redis.call('PEXPIRE', agent, ttl)
end
"""

# KEYS: task hash, unfinished set, finished set, the agent's sorted set (or ''); ARGV: task_id, owner, state, now,
# retention ms, fields...
_UPDATE = _AGENT_SET_EXPIRY + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
local finished = redis.call('HGET', KEYS[1], 'finished_at')
if finished and finished ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updated_at', ARGV[4])
if #ARGV > 5 then redis.call('HSET', KEYS[1], unpack(ARGV, 6)) end
if ARGV[3] == '3' or ARGV[3] == '4' then
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[4])
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  expire_agent_set(KEYS[4], KEYS[2], 2 * tonumber(ARGV[5]))
end
return 1
"""

# KEYS: task hash, unfinished set, the agent's sorted set (or ''); ARGV: task_id, owner, retention ms
_DELETE = _AGENT_SET_EXPIRY + """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return 0 end
local finished = redis.call('HGET', KEYS[1], 'finished_at')
if finished and finished ~= '' then return 0 end
if KEYS[3] ~= '' then redis.call('ZREM', KEYS[3], ARGV[1]) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
expire_agent_set(KEYS[3], KEYS[2], 2 * tonumber(ARGV[3]))
return 1
"""

# KEYS: the leases hash, the owner's cancel set; ARGV: owner, now (unix seconds), ttl ms. The owner's lease is removed,
# and its cancel set given ttl, only if the lease read in the hash now ran out before ``now``: the purge read the
# leases earlier, and a renewal landing since (a live owner back from a stall or an outage) must stay.
_PURGE_LEASE = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local ok, lease = pcall(cjson.decode, raw)
local expires_at = ok and type(lease) == 'table' and tonumber(lease['expires_at']) or nil
if expires_at == nil or expires_at >= tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS: the owner's cancel set, the leases hash; ARGV: task_id, owner, ttl ms
_REQUEST_CANCEL = """
redis.call('SADD', KEYS[1], ARGV[1])
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then redis.call('PERSIST', KEYS[1])
else redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
"""

# KEYS: task hash; ARGV: owner, new owner, QUEUED's state number, now
_REASSIGN = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= ARGV[3] then return 0 end
local finished = redis.call('HGET', KEYS[1], 'finished_at')
if finished and finished ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'updated_at', ARGV[4])
return 1
"""

CANCELS_TAKEN = 1000
"""Most cancel requests one :meth:`RedisTaskStore.take_cancels` takes (the rest wait for the next)."""

_FIELDS = ("fingerprint", "state", "owner", "trace_id", "agent_id", "tenant_id", "spec", "error", "result", "timings",
           "created_at", "updated_at", "finished_at")


def _record(task_id: str, flat: list[bytes] | dict[bytes, bytes]) -> TaskRecord:
    raw = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2]))
    values = {k.decode(): v for k, v in raw.items()}
    finished_at = values.get("finished_at", b"")
    return TaskRecord(
        task_id=task_id,
        fingerprint=values["fingerprint"].decode(),
        state=int(values["state"]),
        owner=values["owner"].decode(),
        trace_id=values.get("trace_id", b"").decode(),
        agent_id=values.get("agent_id", b"").decode(),
        tenant_id=values.get("tenant_id", b"").decode(),
        spec=values.get("spec", b"").decode(),
        error=values.get("error", b"").decode(),
        result=values.get("result", b""),
        timings=values.get("timings", b""),
        created_at=float(values["created_at"]),
        updated_at=float(values["updated_at"]),
        finished_at=float(finished_at) if finished_at else None,
    )


def _read_lease(raw: bytes) -> Lease:
    value = json.loads(raw)
    return Lease(float(value["expires_at"]), str(value["host"]), int(value["pid"]))


class RedisTaskStore(TaskStore):
    """Task records in Redis, shared by orchestrator replicas (see the module docstring)."""

    def __init__(self, config: TaskStoreConfig, dram: DramTierConfig) -> None:
        super().__init__(config, f"redis {dram.host}:{dram.port} db {dram.db}")
        self.prefix = dram.key_prefix
        self.redis = redis_client(dram, socket_timeout=max(dram.op_timeout_s, 1.0), retries=1)
        self._create_script = self.redis.register_script(_CREATE)
        self._update_script = self.redis.register_script(_UPDATE)
        self._delete_script = self.redis.register_script(_DELETE)
        self._reassign_script = self.redis.register_script(_REASSIGN)
        self._request_cancel_script = self.redis.register_script(_REQUEST_CANCEL)
        self._purge_lease_script = self.redis.register_script(_PURGE_LEASE)
        self._unfinished_key = f"{self.prefix}tasks:unfinished"
        self._finished_key = f"{self.prefix}tasks:finished"
        self._agent_prefix = f"{self.prefix}agent:"
        self._leases_key = f"{self.prefix}{LEASES}"

    def _task_key(self, task_id: str) -> str:
        return f"{self.prefix}task:{task_id}"

    def _agent_key(self, agent_id: str, tenant_id: str) -> str:
        return f"{self._agent_prefix}{agent_key(tenant_id, agent_id)}:tasks"

    def _legacy_lease_key(self, owner: str) -> str:
        return f"{self.prefix}{LEGACY_LEASE}{owner}"

    async def _do(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except (RedisError, OSError) as exc:  # the server's message only: a pipeline error quotes its arguments
            raise TaskStoreUnavailable(self.name, describe_error(exc)) from exc

    async def _open(self) -> None:
        try:
            await self.redis.ping()
        except (RedisError, OSError) as exc:  # at start: the setting to change, not only the address that failed
            from switchyard.common.config.loader import set_by_environment

            raise TaskStoreUnavailable(self.name, (
                f"expected a Redis answering at memory_policy.toml [dram] host:port"
                f"{set_by_environment('memory.dram', 'host')} ({describe_error(exc)}); start it, or store tasks in "
                f"SQLite: orchestrator.task_store.backend \"sqlite\" (SWITCHYARD_TASK_STORE=sqlite)")) from exc

    async def _close(self) -> None:
        await self.redis.aclose()

    async def _create(self, record: TaskRecord) -> tuple[TaskRecord, bool]:
        fields: list[Any] = []
        stored = record.fields()
        for name in _FIELDS:
            value = stored[name]
            fields += [name, "" if value is None else value]
        agent_tasks = self._agent_key(record.agent_id, record.tenant_id) if record.agent_id else ""
        existing = await self._do(self._create_script(
            keys=[self._task_key(record.task_id), self._unfinished_key, agent_tasks],
            args=[record.task_id, repr(record.created_at), AGENT_TASKS_KEPT, *fields]))
        if not existing:
            return record, True
        return _record(record.task_id, existing), False

    async def _get(self, task_id: str) -> TaskRecord | None:
        raw = await self._do(self.redis.hgetall(self._task_key(task_id)))
        return _record(task_id, raw) if raw else None

    async def _latest_of_agent(self, agent_id: str, tenant_id: str) -> TaskRecord | None:
        key = self._agent_key(agent_id, tenant_id)
        for raw_id in await self._do(self.redis.zrevrange(key, 0, AGENT_TASKS_KEPT - 1)):
            record = await self._get(raw_id.decode())
            if record is not None:
                return record
            await self._do(self.redis.zrem(key, raw_id))  # its record expired or was deleted
        return None

    async def _update(self, task_id: str, owner: str, state: int, **fields: object) -> bool:
        fields.pop("finished_at", None)  # the script stamps it when the state is final
        flat: list[Any] = []
        for name, value in fields.items():
            flat += [name, value]
        retention_ms = int(self.config.retention_s * 1000)
        agent_tasks = await self._agent_key_of(task_id) if state in (agent_pb2.SUCCEEDED, agent_pb2.FAILED) else ""
        done = await self._do(self._update_script(
            keys=[self._task_key(task_id), self._unfinished_key, self._finished_key, agent_tasks],
            args=[task_id, owner, state, repr(time.time()), retention_ms, *flat]))
        return bool(done)

    async def _agent_key_of(self, task_id: str) -> str:
        """The key of the set of the agent of ``task_id``'s record, '' where it names none or is gone."""
        # Named here, by agent_key's one rule (its tenant's and its id's), from the record's fields, which never
        # change after create; the scripts check the owner and the state.
        agent, tenant = await self._do(self.redis.hmget(self._task_key(task_id), "agent_id", "tenant_id"))
        return self._agent_key(agent.decode(), (tenant or b"").decode()) if agent else ""

    async def _delete(self, task_id: str, owner: str) -> None:
        agent_tasks = await self._agent_key_of(task_id)
        await self._do(self._delete_script(keys=[self._task_key(task_id), self._unfinished_key, agent_tasks],
                                           args=[task_id, owner, int(self.config.retention_s * 1000)]))

    async def _reassign(self, task_id: str, owner: str, new_owner: str) -> bool:
        done = await self._do(self._reassign_script(keys=[self._task_key(task_id)],
                                                    args=[owner, new_owner, agent_pb2.QUEUED, repr(time.time())]))
        return bool(done)

    async def _queued_of_others(self) -> list[tuple[str, str, float]]:
        try:
            ids = [raw async for raw in self.redis.sscan_iter(self._unfinished_key, count=1000)]
            queued = []
            for start in range(0, len(ids), 1000):
                chunk = ids[start:start + 1000]
                async with self.redis.pipeline(transaction=False) as pipe:
                    for raw_id in chunk:
                        key = self._task_key(raw_id.decode())
                        pipe.hmget(key, "owner", "state", "created_at").hstrlen(key, "spec")
                    answers = await pipe.execute()
                for raw_id, (owner, state, created_at), spec_len in zip(chunk, answers[::2], answers[1::2]):
                    if (owner is not None and spec_len and state is not None and int(state) == agent_pb2.QUEUED
                            and owner.decode() != self.owner):
                        queued.append((raw_id.decode(), owner.decode(), float(created_at)))
            return queued
        except (RedisError, OSError) as exc:
            raise TaskStoreUnavailable(self.name, describe_error(exc)) from exc

    async def _renew(self, lease: Lease) -> None:
        value = json.dumps({"expires_at": lease.expires_at, "host": lease.host, "pid": lease.pid})
        async with self.redis.pipeline(transaction=True) as pipe:
            # a cancel asked while this lease was missing (purged as run out after an outage) was given a TTL
            pipe.hset(self._leases_key, self.owner, value).persist(self._cancels_key(self.owner))
            await self._do(pipe.execute())

    async def _release(self) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._leases_key, self.owner).delete(self._cancels_key(self.owner))
            await self._do(pipe.execute())

    async def _lease(self, owner: str) -> Lease | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self._leases_key, owner).get(self._legacy_lease_key(owner))
            raw, legacy = await self._do(pipe.execute())
        raw = raw if raw is not None else legacy
        return None if raw is None else _read_lease(raw)

    def _cancels_key(self, owner: str) -> str:
        return f"{self.prefix}cancels:{owner}"

    @property
    def _stale_cancels_ms(self) -> int:
        """How long the cancel set of an owner without a lease lasts (milliseconds)."""
        return int(3 * self.config.lease_s * 1000)

    async def _request_cancel(self, task_id: str, owner: str) -> None:
        await self._do(self._request_cancel_script(keys=[self._cancels_key(owner), self._leases_key],
                                                   args=[task_id, owner, self._stale_cancels_ms]))

    async def _take_cancels(self) -> list[str]:
        taken = await self._do(self.redis.spop(self._cancels_key(self.owner), CANCELS_TAKEN))
        return [raw.decode() for raw in taken or ()]

    async def _unfinished(self, limit: int) -> list[TaskRecord]:
        _, ids = await self._do(self.redis.sscan(self._unfinished_key, 0, count=limit))
        records = []
        for raw_id in ids[:limit]:
            task_id = raw_id.decode()
            record = await self._get(task_id)
            if record is None:  # its hash is gone: nothing left to report
                await self._do(self.redis.srem(self._unfinished_key, task_id))
            elif record.owner != self.owner and record.state in (agent_pb2.QUEUED, agent_pb2.RUNNING):
                records.append(record)
        return records

    async def _purge(self, now: float) -> int:
        removed = await self._do(self.redis.zremrangebyscore(self._finished_key, "-inf", now - self.config.retention_s))
        excess = await self._do(self.redis.zcard(self._finished_key)) - self.config.max_finished_tasks
        if excess > 0:
            oldest = await self._do(self.redis.zpopmin(self._finished_key, excess))
            if oldest:
                await self._do(self.redis.delete(*(self._task_key(m.decode()) for m, _ in oldest)))
            removed += len(oldest)
        # leases that ran out (their orchestrators stopped without releasing them): read as none already
        leases = await self._do(self.redis.hgetall(self._leases_key))
        expired = [owner for owner, raw in leases.items() if _read_lease(raw).expires_at < now]
        for owner in expired:  # its cancel set expires as a leaseless owner's (a live one's renewal keeps its own)
            # checked again as it is removed: a renewal since the read above (which an HDEL of what was read
            # removed) left a live orchestrator without a lease, read dead by every replica until its next renewal
            await self._do(self._purge_lease_script(keys=[self._leases_key, self._cancels_key(owner.decode())],
                                                    args=[owner, repr(now), self._stale_cancels_ms]))
        return int(removed)
