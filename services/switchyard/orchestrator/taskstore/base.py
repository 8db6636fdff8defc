"""What every task store does: records, idempotent create, leases and orphans.

A record is written when SubmitTask accepts a task, again when it starts
running and when it finishes. Each orchestrator holds a **lease** (renewed every
``lease_s / 3``); a record names the orchestrator that owns it. A task whose
owner's lease ran out (the process was killed, or its host died) while the task
was RUNNING is an **orphan**: the next reader, or the sweep run every
``lease_s``, marks it FAILED with the reason (it may have generated tokens
already, and is never run twice). A QUEUED task never started: its record keeps
the validated request (``spec``), and one whose owner stopped (it **released**
it: owner :data:`RELEASED`) or lost its lease is **adopted** by a live
orchestrator, which takes it with a compare-and-set on the owner
(:meth:`TaskStore.claim`: one of any number of orchestrators trying at once
gets it) and runs it from its own backlog. A QUEUED record written before
records kept their request (no ``spec``) is failed as an orphan, as before. An owner on the same
host and in the same PID namespace whose process no longer exists is known
dead at once, without waiting for its lease (a restart after ``kill -9``).

Only a task's owner can end it. Another orchestrator asked to cancel it (a
CancelTask load-balanced to the wrong replica) records a **cancel request**
addressed to the owner, which takes its requests every ``cancel_poll_s``
(:meth:`TaskStore.take_cancels`) and cancels the tasks as its own CancelTask
would; the asker reads the outcome from the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Iterator

import grpc
from prometheus_client import Counter, Gauge, Histogram

from switchyard.api import agent_pb2
from switchyard.common.config import TaskStoreConfig
from switchyard.common.children import pid_alive
from switchyard.common.errors import SwitchyardError
from switchyard.common.tenant import DEFAULT_TENANT

log = logging.getLogger(__name__)

def new_instance_id() -> str:
    """A new orchestrator instance id, ``host:pid:tag`` (this host's name, this process's id, 8 random hex
    digits): a record's ``owner``, its lease's key. The host and pid tell the operator where the instance ran; a
    caller reads the tag alone (:data:`OWNER_NAMED`)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


OWNER_NAMED = re.compile(r"\borchestrator (?P<host>[^\s:'\"]+):(?P<pid>\d+):(?P<tag>[0-9a-f]{8})\b")
"""An instance id (:func:`new_instance_id`) where a message names the orchestrator that owns a task
("held by orchestrator ID", "orchestrator ID stopped while ..."): the edge shows its callers the tag alone
(``switchyard.orchestrator.addresses.EdgeText``), the host and pid being internal."""

FINISHED = (agent_pb2.SUCCEEDED, agent_pb2.FAILED)

STORE_OPS = ("create", "get", "update", "delete", "request_cancel", "take_cancels")
STORE_DURATION = Histogram(
    "switchyard_task_store_duration_seconds",
    "Time of one task-store operation, by operation (request_cancel: a cancel asked of another orchestrator; "
    "take_cancels: an orchestrator's poll for the cancels asked of it, every cancel_poll_s).", ["operation"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
STORE_UP = Gauge(
    "switchyard_task_store_up",
    "1 while the task store answers, 0 from an operation it failed (Redis down, the SQLite file unwritable) until "
    "one works again: SubmitTask, GetTaskStatus and CancelTask answer UNAVAILABLE meanwhile (RunTask needs no "
    "store). Read at least every cancel_poll_s.",
)
TASKS_ORPHANED = Counter(
    "switchyard_tasks_orphaned_total",
    "RUNNING tasks reported FAILED because the orchestrator that ran them stopped (its lease ran out).",
)
TASK_RECORDS_WRITTEN_AGAIN = Counter(
    "switchyard_task_records_written_again_total",
    "Records of tasks this orchestrator held (queued or running) that the task store no longer had when it went to "
    "record their start or outcome (a Redis restarted without persistence, a flushed database), written again from "
    "what it holds.",
)
TASKS_ADOPTED = Counter(
    "switchyard_tasks_adopted_total",
    "QUEUED tasks this orchestrator took over from one that stopped (released them) or lost its lease, to run "
    "them from its own backlog.",
)
RELEASED = ""
"""A record's ``owner`` once its orchestrator gave it up unstarted (a graceful stop): any live orchestrator
may adopt it at once (:meth:`TaskStore.claim`)."""
for _op in STORE_OPS:
    STORE_DURATION.labels(_op)


class OutageLog:
    """A poller's failed tries logged as one outage: a warning at the first, one line when a try works again (how
    many failed, over how long), nothing in between. Each try had logged its own warning: a store down for an hour
    wrote thousands of lines (the cancel poller's one every cancel_poll_s, 0.25 s, where a try failed at once)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self.what = what
        self._since: float | None = None
        self._failures = 0

    def failed(self, exc: BaseException, retry_s: float) -> None:
        self._failures += 1
        if self._since is None:
            self._since = time.monotonic()
            self._log.warning("%s failed, retrying every %.3g s (logged again once it works): %s", self.what, retry_s,
                              exc)

    def worked(self) -> None:
        if self._since is not None:
            self._log.warning("%s works again after %d failed tries over %.1f s", self.what, self._failures,
                              time.monotonic() - self._since)
            self._since, self._failures = None, 0


class TaskStoreUnavailable(SwitchyardError):
    """The task store cannot be read or written (UNAVAILABLE, naming the store)."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, store: str, detail: object) -> None:
        super().__init__(f"task store unavailable ({store}): {detail}; SubmitTask, GetTaskStatus and CancelTask need it")


def fingerprint(fields: dict[str, object]) -> str:
    """SHA-256 (hex) of a request's validated fields: equal for the same request, whatever field order."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def host_id() -> str:
    """This host and PID namespace: owners with the same host_id share process ids."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{pidns}"


@dataclass
class TaskRecord:
    """One task as stored. ``result`` is a serialized FinalEvent, ``timings`` a serialized Timings."""

    task_id: str
    fingerprint: str
    state: int
    owner: str
    trace_id: str = ""
    agent_id: str = ""
    """The agent that submitted the task (empty: none named); :meth:`TaskStore.latest_of_agent` looks it up."""
    tenant_id: str = ""
    """The task's tenant (empty: a record written before tasks had one, answered as ``default``)."""
    spec: str = ""
    """The validated request (``TaskSpec``'s fields, JSON) another orchestrator starts the task from when it
    adopts it; empty in a record written before records kept it (never adopted: failed as an orphan)."""
    error: str = ""
    result: bytes = b""
    timings: bytes = b""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def fields(self) -> dict[str, Any]:
        """Every stored field by name (``task_id`` first, then as declared): what a store writes. Every
        field is a str, int, float, bytes or None, so a shallow read is the record (``asdict`` would copy
        each value deeply, about 10x the cost, on every SubmitTask). A dataclass's instance dict holds
        its fields in declaration order."""
        return dict(vars(self))

    def to_status(self) -> agent_pb2.TaskStatus:
        """GetTaskStatus's answer: state, result, error, compute_score_used, memory_peak_bytes, timings."""
        timings = agent_pb2.Timings()
        if self.timings:
            timings.ParseFromString(self.timings)
        return task_status(self.task_id, self.state, self.error, self.tenant_id, timings, self.result)


def task_status(task_id: str, state: int, error: str, tenant_id: str, timings: agent_pb2.Timings,
                result: bytes) -> agent_pb2.TaskStatus:
    """A finished task's TaskStatus from what is recorded of it (the store's record, or the outcome an
    orchestrator answers until the store has it). ``result`` is a serialized FinalEvent: a SUCCEEDED task's
    answer, the status's ``result``; a FAILED task's holds only what it consumed before it failed (usage,
    compute score, KV peak, timings), read into the status's compute_score_used and memory_peak_bytes, with no
    ``result``. Empty: nothing recorded (a task that failed before it ran)."""
    status = agent_pb2.TaskStatus(task_id=task_id, state=state, error=error, tenant_id=tenant_id or DEFAULT_TENANT,
                                  timings=timings)
    if result:
        final = agent_pb2.FinalEvent.FromString(result)
        status.compute_score_used = final.compute_score_used
        status.memory_peak_bytes = final.memory_peak_bytes
        status.timings.CopyFrom(final.timings)
        if state == agent_pb2.SUCCEEDED:
            status.result.CopyFrom(final)
    return status


@dataclass(frozen=True)
class Lease:
    """An orchestrator's lease: valid until ``expires_at`` (wall-clock seconds), held by ``pid`` on ``host``."""

    expires_at: float
    host: str
    pid: int


class TaskStore(ABC):
    """Durable task records shared by SubmitTask and GetTaskStatus.

    Args:
        config: ``orchestrator.task_store``.
        name: how errors name the store, e.g. ``sqlite data/tasks.sqlite3``.

    Every method may raise :class:`TaskStoreUnavailable` when the store cannot be reached.
    """

    def __init__(self, config: TaskStoreConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.owner = new_instance_id()
        self.host = host_id()
        self._maintenance: asyncio.Task[None] | None = None
        self.adopt: Callable[[], Awaitable[None]] | None = None
        """Started after each sweep (every ``lease_s``) unless the last one still runs: the orchestrator adopts
        the QUEUED tasks its backlog has room for (:meth:`adoptable`, :meth:`claim`). It runs beside maintenance,
        not in it: thousands of claims must not hold up the lease's renewal (a lease run out meanwhile lets the
        others adopt this one's tasks). Its errors are logged."""
        self._adopting: asyncio.Task[None] | None = None
        self._store_failing = False
        self._store_back_at: float | None = None
        """When the store answered again after an operation of this process failed (monotonic seconds); None
        while it never failed. For ``lease_s`` from then no owner is judged dead by its lease (:meth:`_owner_dead`):
        every lease ran out with the store, and the live owners renew theirs within ``lease_s / 3``."""
        self._lost_warned_at: float | None = None
        """When a lost record was last logged at WARNING (:meth:`_write_again`): at most one a minute."""

    # ------------------------------------------------------------------ backend

    @abstractmethod
    async def _open(self) -> None: ...

    @abstractmethod
    async def _close(self) -> None: ...

    @abstractmethod
    async def _create(self, record: TaskRecord) -> tuple[TaskRecord, bool]:
        """Insert ``record`` unless a live record with its task_id exists; returns (the stored record, created).
        A finished record past its retention counts as absent."""

    @abstractmethod
    async def _get(self, task_id: str) -> TaskRecord | None:
        """The record, or None when absent or finished past its retention."""

    @abstractmethod
    async def _latest_of_agent(self, agent_id: str, tenant_id: str) -> TaskRecord | None:
        """The record ``tenant_id``'s agent ``agent_id`` created last (by ``created_at``), or None; records past
        retention count as absent. ``tenant_id`` is never "": :data:`DEFAULT_TENANT` also finds records stored
        with no tenant."""

    @abstractmethod
    async def _update(self, task_id: str, owner: str, state: int, **fields: object) -> bool:
        """Set ``state`` and ``fields`` if the record is unfinished and owned by ``owner``. Returns whether it was."""

    @abstractmethod
    async def _delete(self, task_id: str, owner: str) -> None:
        """Remove an unfinished record owned by ``owner`` (a task refused before it was accepted)."""

    @abstractmethod
    async def _renew(self, lease: Lease) -> None:
        """Write this orchestrator's lease."""

    @abstractmethod
    async def _release(self) -> None:
        """Drop this orchestrator's lease (a clean stop)."""

    @abstractmethod
    async def _lease(self, owner: str) -> Lease | None:
        """The lease of ``owner``, or None when it has none."""

    @abstractmethod
    async def _unfinished(self, limit: int) -> list[TaskRecord]:
        """Up to ``limit`` unfinished records of owners other than this one."""

    @abstractmethod
    async def _reassign(self, task_id: str, owner: str, new_owner: str) -> bool:
        """Set the owner of ``task_id`` to ``new_owner`` if it is ``owner`` and the task is QUEUED, in one atomic
        step (a compare-and-set); returns whether it was."""

    @abstractmethod
    async def _queued_of_others(self) -> list[tuple[str, str, float]]:
        """(task_id, owner, created_at) of every QUEUED record that keeps its request (``spec``) and is owned by
        another orchestrator than this one, or :data:`RELEASED`."""

    @abstractmethod
    async def _request_cancel(self, task_id: str, owner: str) -> None:
        """Record a cancel request for ``task_id`` addressed to ``owner`` (recording it twice is one request)."""

    @abstractmethod
    async def _take_cancels(self) -> list[str]:
        """Remove and return the task ids of the cancel requests addressed to this orchestrator."""

    @abstractmethod
    async def _purge(self, now: float) -> int:
        """Delete finished records past retention and beyond max_finished_tasks (oldest first); returns how many."""

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Open the store, take a lease, fail the orphans left by dead orchestrators, start maintenance."""
        await self._open()
        await self._renew(self._new_lease())
        STORE_UP.set(1)
        await self.sweep()
        self._maintenance = asyncio.create_task(self._maintain(), name="task-store-maintenance")

    async def close(self) -> None:
        """Stop maintenance and release the lease (the caller has finished or failed its own tasks)."""
        for task in (self._maintenance, self._adopting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._maintenance = self._adopting = None
        with contextlib.suppress(TaskStoreUnavailable):
            await self._release()
        await self._close()

    @contextlib.contextmanager
    def _timed(self, operation: str) -> Iterator[None]:
        """One operation of :data:`STORE_OPS`: its time (``switchyard_task_store_duration_seconds``), and whether
        the store answered it (``switchyard_task_store_up``)."""
        with STORE_DURATION.labels(operation).time():
            try:
                yield
            except TaskStoreUnavailable:
                self._store_failed()
                raise
        self._store_answered()

    def _store_failed(self) -> None:
        STORE_UP.set(0)
        self._store_failing = True

    def _store_answered(self) -> None:
        STORE_UP.set(1)
        if self._store_failing:
            self._store_failing = False
            self._store_back_at = time.monotonic()

    def _new_lease(self) -> Lease:
        return Lease(time.time() + self.config.lease_s, self.host, os.getpid())

    async def _maintain(self) -> None:
        interval = self.config.lease_s / 3
        last_sweep = last_purge = time.monotonic()
        outage = OutageLog(log, "task store: maintenance (the lease, orphans, retention)")
        while True:
            await asyncio.sleep(interval)
            try:
                await self._renew(self._new_lease())
                now = time.monotonic()
                if now - last_sweep >= self.config.lease_s:
                    last_sweep = now
                    await self.sweep()
                    if self.adopt is not None and (self._adopting is None or self._adopting.done()):
                        self._adopting = asyncio.create_task(self._adopt(), name="task-store-adoption")
                if now - last_purge >= min(60.0, self.config.retention_s):
                    last_purge = now
                    await self._purge(time.time())
            except TaskStoreUnavailable as exc:
                self._store_failed()
                outage.failed(exc, interval)
            else:
                self._store_answered()
                outage.worked()

    async def _adopt(self) -> None:
        assert self.adopt is not None
        try:
            await self.adopt()
        except TaskStoreUnavailable as exc:  # the maintenance's own outage log says the store is down
            log.debug("task store: adoption stopped by the store: %s", exc)
        except Exception:  # noqa: BLE001 - tried again at the next sweep
            log.exception("task store: adopting the QUEUED tasks of stopped orchestrators failed")

    # ------------------------------------------------------------------ operations

    async def create(self, task_id: str, fp: str, trace_id: str, agent_id: str = "",
                     tenant_id: str = "", spec: str = "") -> tuple[TaskRecord, bool]:
        """Record a QUEUED task owned by this orchestrator, or return the live record under ``task_id``.

        ``agent_id`` (empty: none) makes the task the agent's latest (:meth:`latest_of_agent`). ``spec``: the
        validated request, JSON (:attr:`TaskRecord.spec`), what an orchestrator that adopts it starts it from.

        Returns:
            (record, created): ``created`` is False when ``task_id`` was already taken (compare
            ``record.fingerprint`` with ``fp`` to tell a resubmission from a conflict).
        """
        with self._timed("create"):
            return await self._create(TaskRecord(task_id, fp, agent_pb2.QUEUED, self.owner, trace_id=trace_id,
                                                 agent_id=agent_id, tenant_id=tenant_id, spec=spec))

    async def latest_of_agent(self, agent_id: str, tenant_id: str = DEFAULT_TENANT) -> TaskRecord | None:
        """The task ``tenant_id``'s agent ``agent_id`` submitted last (None when it submitted none within
        retention): an agent is its tenant's and its id's (:func:`switchyard.common.tenant.agent_key`), so two
        tenants' agents of one id each have their own latest. An orphan is failed first, as by :meth:`get`. An
        empty ``agent_id`` names no agent: None; an empty ``tenant_id`` is :data:`DEFAULT_TENANT`."""
        if not agent_id:
            return None
        with self._timed("get"):
            record = await self._latest_of_agent(agent_id, tenant_id or DEFAULT_TENANT)
        if record is not None and not record.finished and record.owner != self.owner:
            if await self._fail_if_orphan(record):
                record = await self._get(record.task_id)
        return record

    async def get(self, task_id: str) -> TaskRecord | None:
        """The record of ``task_id`` (None when unknown or past retention); an orphan is failed first."""
        with self._timed("get"):
            record = await self._get(task_id)
        if record is not None and not record.finished and record.owner != self.owner:
            if await self._fail_if_orphan(record):
                record = await self._get(task_id)
        return record

    async def mark_running(self, task_id: str, recorded: TaskRecord | None = None) -> bool:
        """Record RUNNING; False when the record is no longer this orchestrator's (another adopted it while this
        one's lease had run out): the task must not run here.

        ``recorded``: the record this orchestrator wrote or adopted for the task. Where the store has no record
        under ``task_id`` at all (a Redis restarted without persistence, a flushed database), it is written again
        from ``recorded``, RUNNING, and the task runs (:meth:`_write_again`): read as adopted by another, the task
        was dropped unrun, and GetTaskStatus answered NOT_FOUND "never submitted"."""
        with self._timed("update"):
            if await self._update(task_id, self.owner, agent_pb2.RUNNING):
                return True
            return await self._write_again(recorded, agent_pb2.RUNNING)

    async def _write_again(self, recorded: TaskRecord | None, state: int, **fields: object) -> bool:
        """Write ``recorded`` again, owned by this orchestrator, and set ``state`` and ``fields`` on it, where the
        store has no record under its task_id (an update found none to check the owner of); False where it has
        one (another orchestrator's), or ``recorded`` is None. Counted in
        ``switchyard_task_records_written_again_total``; a WARNING at most once a minute says why."""
        if recorded is None or await self._get(recorded.task_id) is not None:
            return False
        again = replace(recorded, state=agent_pb2.QUEUED, owner=self.owner, error="", result=b"", timings=b"",
                        updated_at=time.time(), finished_at=None)
        _, created = await self._create(again)
        if not created or not await self._update(recorded.task_id, self.owner, state, **fields):
            return False
        TASK_RECORDS_WRITTEN_AGAIN.inc()
        now = time.monotonic()
        if self._lost_warned_at is None or now - self._lost_warned_at >= 60.0:
            self._lost_warned_at = now
            log.warning("task store (%s) had no record of task %s, which this orchestrator holds: written again "
                        "(a store restarted without persistence, or flushed, lost the records of every task in it; "
                        "those of tasks no orchestrator held are gone; switchyard_task_records_written_again_total "
                        "counts the records written again, this line is logged at most once a minute)",
                        self.name, recorded.task_id)
        return True

    async def release(self, task_id: str) -> bool:
        """Give up a QUEUED task of this orchestrator's unstarted (a graceful stop): its owner becomes
        :data:`RELEASED` and any live orchestrator may adopt it at once. False when it was not this one's or not
        QUEUED."""
        with self._timed("update"):
            return await self._reassign(task_id, self.owner, RELEASED)

    async def claim(self, record: TaskRecord) -> bool:
        """Take ``record``'s task for this orchestrator if its owner is still ``record.owner`` and it is still
        QUEUED (a compare-and-set: of orchestrators claiming one task at once, one gets it). The caller checked
        that it is adoptable (:meth:`adoptable_now`)."""
        with self._timed("update"):
            taken = await self._reassign(record.task_id, record.owner, self.owner)
        if taken:
            record.owner = self.owner
        return taken

    async def adoptable_now(self, record: TaskRecord) -> bool:
        """Whether ``record`` is a task another orchestrator may adopt: QUEUED, keeping its request, and
        released or of an orchestrator whose lease ran out (or whose process is gone, on this host)."""
        return (record.state == agent_pb2.QUEUED and bool(record.spec) and record.owner != self.owner
                and (record.owner == RELEASED or await self._owner_dead(record.owner)))

    async def adoptable(self, limit: int) -> list[TaskRecord]:
        """Up to ``limit`` records of QUEUED tasks this orchestrator may adopt (:meth:`adoptable_now`), the
        earliest submitted first; not yet claimed (:meth:`claim` each)."""
        if limit <= 0:
            return []
        with self._timed("get"):
            queued = await self._queued_of_others()
        dead: dict[str, bool] = {RELEASED: True}
        found = []
        for task_id, owner, created_at in sorted(queued, key=lambda q: q[2]):
            if owner not in dead:
                dead[owner] = await self._owner_dead(owner)
            if dead[owner]:
                found.append(task_id)
        records = []
        for task_id in found:
            if len(records) >= limit:
                break
            record = await self._get(task_id)
            if record is not None and record.state == agent_pb2.QUEUED and record.spec:
                records.append(record)
        return records

    async def finish(self, task_id: str, state: int, result: bytes = b"", error: str = "", timings: bytes = b"",
                     recorded: TaskRecord | None = None) -> bool:
        """Record SUCCEEDED (with ``result``) or FAILED (with ``error``); False when the record was not ours.
        ``recorded``: as :meth:`mark_running`'s, written again with the outcome where the store lost the record
        (the outcome had been dropped, and the task answered NOT_FOUND)."""
        fields: dict[str, object] = {"result": result, "error": error, "timings": timings, "finished_at": time.time()}
        with self._timed("update"):
            if await self._update(task_id, self.owner, state, **fields):
                return True
            return await self._write_again(recorded, state, **fields)

    async def delete(self, task_id: str) -> None:
        with self._timed("delete"):
            await self._delete(task_id, self.owner)

    async def request_cancel(self, record: TaskRecord) -> None:
        """Ask ``record.owner``, another orchestrator, to cancel ``record``'s task: it takes the request within
        ``cancel_poll_s`` (:meth:`take_cancels`) and records the task's outcome, which :meth:`get` then reads."""
        with self._timed("request_cancel"):
            await self._request_cancel(record.task_id, record.owner)

    async def take_cancels(self) -> list[str]:
        """The task ids other orchestrators asked this one to cancel since the last call, each once."""
        with self._timed("take_cancels"):  # apart from "get": a poll, nearly always of none
            return await self._take_cancels()

    async def sweep(self, limit: int = 1000) -> int:
        """Fail up to ``limit`` orphans; returns how many were failed."""
        failed = 0
        for record in await self._unfinished(limit):
            failed += await self._fail_if_orphan(record)
        return failed

    async def _owner_dead(self, owner: str) -> bool:
        """Whether ``owner`` stopped: its process is gone (on this host and PID namespace), or its lease ran out
        (or is gone). Not by its lease within ``lease_s`` of the store coming back from an outage this process saw
        (:attr:`_store_back_at`): every lease ran out during it, and a replica that swept or read a task first
        after the store's return had failed the running tasks of live replicas as orphans and adopted their
        queued ones."""
        lease = await self._lease(owner)
        if lease is not None and lease.host == self.host and lease.pid != os.getpid() and not pid_alive(lease.pid):
            return True
        if self._store_back_at is not None and time.monotonic() - self._store_back_at < self.config.lease_s:
            return False
        return lease is None or lease.expires_at < time.time()

    async def _fail_if_orphan(self, record: TaskRecord) -> bool:
        """Fail ``record`` if it is an orphan: RUNNING, or QUEUED with no request kept (a record written before
        records kept it), under an owner whose lease ran out. A QUEUED task that keeps its request is adopted
        instead (:meth:`adoptable`); one released is no orphan."""
        if record.state == agent_pb2.QUEUED and (record.spec or record.owner == RELEASED):
            return False
        if not await self._owner_dead(record.owner):
            return False
        state = agent_pb2.TaskState.Name(record.state)
        reason = (
            f"UNAVAILABLE: orchestrator {record.owner} stopped while the task was {state} (its lease ran out; "
            f"orchestrator.task_store.lease_s = {self.config.lease_s:g}) and recorded no result; "
            "resubmit it under a new task_id"
        )
        updated = await self._update(record.task_id, record.owner, agent_pb2.FAILED, error=reason,
                                     finished_at=time.time())
        if updated:
            if record.state == agent_pb2.RUNNING:
                TASKS_ORPHANED.inc()
            log.warning("task %s: %s", record.task_id, reason)
        return updated
