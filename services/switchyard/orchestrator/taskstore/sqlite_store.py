"""The task store in a SQLite file (the default): stdlib sqlite3 on one thread of its own.

WAL mode: readers never block the writer, and a commit is one append to the
write-ahead log. With ``synchronous = NORMAL`` a committed transaction survives
the death of the process (``kill -9``), which is what a crashed orchestrator
needs; ``FULL`` also survives a power loss, at one fsync per commit (SQLite's
documentation, "Write-Ahead Logging" and "PRAGMA synchronous"). Every statement
runs on the store's single thread, off the event loop, and the writes that wait
together go in one transaction (group commit). SQLite's automatic checkpoint
is off: it ran inside whichever commit crossed 1000 WAL pages, and that
commit, with every write queued behind it, waited for the whole checkpoint (up
to 145 ms measured on a busy 2-core machine); a passive checkpoint runs instead
on a second connection and thread at most every ``CHECKPOINT_INTERVAL_S``
after a commit, beside the writes (WAL lets a checkpoint and a writer run at
once). The WAL starts over from its
beginning only when a write finds every frame of it copied, which writes during
each checkpoint prevent, and the file would grow without bound; so the next
write batch after each checkpoint first copies the few frames written while it
ran, on the writer's own thread, and no checkpoint starts until it has
(sqlite.org/wal.html, "Avoiding Excessively Large WAL Files"). Where other processes write the same file, their writes keep
that copy from being complete too: past ``RESTART_WAL_PAGES`` the checkpoint
restarts the WAL, holding the writers while it copies what is left. Several
processes on one host may share the file (``busy_timeout`` waits out the
others' writes); hosts must not share it over a network file system, where
SQLite's locks are unsafe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from switchyard.api import agent_pb2
from switchyard.common.config import TaskStoreConfig
from switchyard.common.tenant import DEFAULT_TENANT
from switchyard.orchestrator.taskstore.base import Lease, TaskRecord, TaskStore, TaskStoreUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)

RESTART_WAL_PAGES = 10_000
"""WAL pages (4 KiB each, 40 MiB) past which a checkpoint also restarts the WAL: other processes writing the same
file keep each store's catch-up copy from being complete, and the WAL would grow without bound. RESTART waits for
the write in progress and holds the next ones while it copies what the passive pass left, then the WAL starts
over (sqlite.org/c3ref/wal_checkpoint_v2.html). A store alone on its file never gets there."""
BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another connection's lock on the file (SQLite's busy timeout), seconds; then it
fails, TaskStoreUnavailable, and the orchestrator writes it again later."""
CHECKPOINT_INTERVAL_S = 1.0
"""Least seconds between two passive checkpoints (each copies the WAL's committed pages into the database file;
at 500 writes a second one second of WAL is a few hundred pages, under SQLite's own 1000-page default)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id     TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    state       INTEGER NOT NULL,
    owner       TEXT NOT NULL,
    trace_id    TEXT NOT NULL DEFAULT '',
    agent_id    TEXT NOT NULL DEFAULT '',
    tenant_id   TEXT NOT NULL DEFAULT '',
    spec        TEXT NOT NULL DEFAULT '',
    error       TEXT NOT NULL DEFAULT '',
    result      BLOB NOT NULL DEFAULT x'',
    timings     BLOB NOT NULL DEFAULT x'',
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS tasks_unfinished ON tasks (owner) WHERE finished_at IS NULL;
CREATE INDEX IF NOT EXISTS tasks_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS cancel_requests (
    task_id      TEXT PRIMARY KEY,
    owner        TEXT NOT NULL,
    requested_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    owner      TEXT PRIMARY KEY,
    expires_at REAL NOT NULL,
    host       TEXT NOT NULL,
    pid        INTEGER NOT NULL
);
"""
# A file written before tasks had an agent_id gets the column (ADD COLUMN keeps its rows).
AGENT_COLUMN = "ALTER TABLE tasks ADD COLUMN agent_id TEXT NOT NULL DEFAULT ''"
TENANT_COLUMN = "ALTER TABLE tasks ADD COLUMN tenant_id TEXT NOT NULL DEFAULT ''"
SPEC_COLUMN = "ALTER TABLE tasks ADD COLUMN spec TEXT NOT NULL DEFAULT ''"
"""A file written before records kept the validated request: its records read ``spec`` '' (never adopted)."""
AGENT_INDEX = "CREATE INDEX IF NOT EXISTS tasks_by_agent ON tasks (agent_id, created_at) WHERE agent_id != ''"
COLUMNS = ("task_id", "fingerprint", "state", "owner", "trace_id", "agent_id", "tenant_id", "spec", "error", "result",
           "timings", "created_at", "updated_at", "finished_at")
UPDATABLE = frozenset({"error", "result", "timings", "finished_at"})
CREATE = (f"INSERT INTO tasks ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
          "ON CONFLICT (task_id) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in COLUMNS[1:])
          + " WHERE tasks.finished_at IS NOT NULL AND tasks.finished_at < ?")
"""A task's record, or a finished one past its retention under the same task_id taken over (params: COLUMNS'
values, then the created_at before which a finished record counts as expired)."""


def _record(row: tuple[Any, ...]) -> TaskRecord:
    values = dict(zip(COLUMNS, row))
    values["result"], values["timings"] = bytes(values["result"]), bytes(values["timings"])
    return TaskRecord(**values)


class SqliteTaskStore(TaskStore):
    """Task records in ``task_store.sqlite_path`` (see the module docstring)."""

    def __init__(self, config: TaskStoreConfig) -> None:
        super().__init__(config, f"sqlite {config.sqlite_path}")
        self.path = Path(config.sqlite_path)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="task-store")
        self._db: sqlite3.Connection | None = None
        self._checkpointer = ThreadPoolExecutor(1, thread_name_prefix="task-store-checkpoint")
        self._checkpoint_db: sqlite3.Connection | None = None
        self._checkpoint: asyncio.Future[None] | None = None
        """The passive checkpoint running now, if any."""
        self._checkpointed_at = 0.0
        """time.monotonic() of the last checkpoint's start."""
        self._catch_up = False
        """A checkpoint has ended: the next write batch first copies the frames written while it ran, and no
        checkpoint starts until that batch has committed (see :meth:`_maybe_checkpoint`)."""
        self._closing = False
        """:meth:`_close` has begun: no checkpoint starts."""
        self._writes: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any]]] = []
        """Writes waiting for the batch on the store's thread to end (group commit, :meth:`_write`)."""
        self._writing = False
        """A batch of writes is on the store's thread."""

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` on the store's thread.

        Raises:
            TaskStoreUnavailable: SQLite failed, or the store is not open (closed, or closing past this call).
        """
        def call() -> T:
            if self._db is None:
                raise sqlite3.ProgrammingError("the task store is not open")
            return fn(self._db)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, call)
        except sqlite3.Error as exc:
            raise TaskStoreUnavailable(self.name, exc) from exc
        except RuntimeError as exc:  # the store's thread was shut down: closed
            raise TaskStoreUnavailable(self.name, f"the task store is closed ({exc})") from exc

    async def _open(self) -> None:
        def connect() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
            db.execute("PRAGMA journal_mode = WAL")
            db.execute(f"PRAGMA synchronous = {self.config.sqlite_synchronous}")
            db.executescript(SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(tasks)")}
            if "agent_id" not in columns:
                db.execute(AGENT_COLUMN)
            if "tenant_id" not in columns:
                db.execute(TENANT_COLUMN)
            if "spec" not in columns:
                db.execute(SPEC_COLUMN)
            db.execute(AGENT_INDEX)
            db.execute("PRAGMA wal_autocheckpoint = 0")  # see the module docstring
            self._db = db

        def connect_checkpointer() -> None:
            self._checkpoint_db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                                  timeout=BUSY_TIMEOUT_S)

        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, connect)
            await asyncio.get_running_loop().run_in_executor(self._checkpointer, connect_checkpointer)
        except OSError as exc:  # its folder cannot be made (a file there, no permission): a setting to change
            why = "a file is there" if self.path.parent.is_file() else exc.strerror
            raise TaskStoreUnavailable(self.name, (
                f"orchestrator.task_store.sqlite_path (SWITCHYARD_TASK_STORE_SQLITE_PATH, switchyard up --data-dir) "
                f"{str(self.path)!r}: expected a file in a folder this user can make or write ({why})")) from exc
        except sqlite3.Error as exc:  # a folder at the path, a file that is no database, one this user cannot write
            why = "a folder is there" if self.path.is_dir() else str(exc)
            raise TaskStoreUnavailable(self.name, (
                f"orchestrator.task_store.sqlite_path (SWITCHYARD_TASK_STORE_SQLITE_PATH, switchyard up --data-dir) "
                f"{str(self.path)!r}: expected an SQLite database file this user can write, or no file yet "
                f"({why})")) from exc

    async def _close(self) -> None:
        def close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        def close_checkpointer() -> None:
            if self._checkpoint_db is not None:
                self._checkpoint_db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                self._checkpoint_db.close()
                self._checkpoint_db = None

        self._closing = True
        loop = asyncio.get_running_loop()
        if self._checkpoint is not None:
            with contextlib.suppress(Exception):
                await self._checkpoint
        with contextlib.suppress(sqlite3.Error):
            await loop.run_in_executor(self._checkpointer, close_checkpointer)
        self._checkpointer.shutdown(wait=True)
        await loop.run_in_executor(self._thread, close)
        self._thread.shutdown(wait=True)

    def _maybe_checkpoint(self) -> None:
        """Start a passive checkpoint on the checkpoint thread, unless one runs, one started within
        ``CHECKPOINT_INTERVAL_S``, or the catch-up after the last one has not committed yet: a checkpoint
        beside the catch-up holds the checkpoint lock and read-mark 0, the catch-up copies nothing, and the
        WAL does not start over (with checkpoints slowed by a busy disk's fsync, hardly ever: 25 MB in CI).
        A failed checkpoint is logged and tried again after the next commit: the WAL keeps every committed
        write meanwhile."""
        now = time.monotonic()
        if (self._closing or self._checkpoint is not None or self._catch_up
                or now - self._checkpointed_at < CHECKPOINT_INTERVAL_S):
            return
        self._checkpointed_at = now

        def done(future: asyncio.Future[None]) -> None:
            self._checkpoint = None
            if not future.cancelled() and future.exception() is not None:
                log.warning("task store: checkpoint of %s failed: %s", self.path, future.exception())
            else:
                self._catch_up = True

        self._checkpoint = asyncio.get_running_loop().run_in_executor(self._checkpointer, self._checkpoint_pass)
        self._checkpoint.add_done_callback(done)

    def _checkpoint_pass(self) -> None:
        """One checkpoint, on the checkpoint thread: passive, then a restart past ``RESTART_WAL_PAGES``."""
        assert self._checkpoint_db is not None, "task store not open"
        _, wal_pages, _ = self._checkpoint_db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if wal_pages > RESTART_WAL_PAGES:
            self._checkpoint_db.execute("PRAGMA wal_checkpoint(RESTART)")

    async def _write(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Group commit: writes that arrive while one batch is on the store's thread wait and go together, in
        one transaction (one commit, one thread hop) when it is done, in arrival order; each is answered after
        that commit. One trip per batch, not per write: every trip waits for the GIL from a busy event loop
        (up to ``sys.getswitchinterval()``, 5 ms, per hand-over), and a create queued behind the running
        tasks' updates, one trip each, waited for all of them. A batch of one write is one statement, with no
        BEGIN and COMMIT around it (two hand-overs fewer).

        Raises:
            TaskStoreUnavailable: the batch's transaction failed (every write of it fails, none is recorded).
        """
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._writes.append((op, future))
        if not self._writing:
            self._write_batch()
        return await future

    def _write_batch(self) -> None:
        """Send the writes waiting now to the store's thread as one transaction; the next batch starts when
        it is done."""
        batch, self._writes = self._writes, []
        self._writing = True
        catch_up = self._catch_up

        def write_all(db: sqlite3.Connection) -> list[Any]:
            if catch_up:  # a few frames, with no write beside it: every frame is copied, so this batch's write
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # starts the WAL over (module docstring)
            if len(batch) == 1:  # one statement is its own transaction: two statements (two GIL hand-overs) fewer
                return [batch[0][0](db)]
            db.execute("BEGIN IMMEDIATE")
            try:
                results = [op(db) for op, _ in batch]
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return results

        def answer(done: asyncio.Task[list[Any]]) -> None:
            # every caller is answered first: nothing that follows can leave one waiting
            error = None if done.cancelled() else done.exception()
            for i, (_, future) in enumerate(batch):
                if future.done():  # its caller went away
                    continue
                if done.cancelled():
                    future.cancel()
                elif error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(done.result()[i])
            self._writing = False
            if catch_up and error is None and not done.cancelled():
                self._catch_up = False  # the WAL has started over: a checkpoint may run beside writes again
            if self._writes:
                self._write_batch()
            if error is None and not done.cancelled():
                self._maybe_checkpoint()

        asyncio.ensure_future(self._run(write_all)).add_done_callback(answer)

    async def _create(self, record: TaskRecord) -> tuple[TaskRecord, bool]:
        expired_before = record.created_at - self.config.retention_s
        stored = record.fields()
        params = [*(stored[c] for c in COLUMNS), expired_before]

        def create(db: sqlite3.Connection) -> tuple[TaskRecord, bool]:
            # Insert, or take over a finished record past its retention that the purge has not removed.
            if db.execute(CREATE, params).rowcount == 1:
                return record, True
            row = db.execute(f"SELECT {', '.join(COLUMNS)} FROM tasks WHERE task_id = ?", (record.task_id,)).fetchone()
            return _record(row), False

        return await self._write(create)

    async def _get(self, task_id: str) -> TaskRecord | None:
        expired_before = time.time() - self.config.retention_s

        def get(db: sqlite3.Connection) -> TaskRecord | None:
            row = db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM tasks WHERE task_id = ? AND (finished_at IS NULL OR finished_at >= ?)",
                (task_id, expired_before),
            ).fetchone()
            return None if row is None else _record(row)

        return await self._run(get)

    async def _latest_of_agent(self, agent_id: str, tenant_id: str) -> TaskRecord | None:
        expired_before = time.time() - self.config.retention_s
        tenants = ("", DEFAULT_TENANT) if tenant_id == DEFAULT_TENANT else (tenant_id, tenant_id)

        def latest(db: sqlite3.Connection) -> TaskRecord | None:
            row = db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM tasks WHERE agent_id = ? AND tenant_id IN (?, ?) "
                "AND (finished_at IS NULL OR finished_at >= ?) ORDER BY created_at DESC LIMIT 1",
                (agent_id, *tenants, expired_before),
            ).fetchone()
            return None if row is None else _record(row)

        return await self._run(latest)

    async def _update(self, task_id: str, owner: str, state: int, **fields: object) -> bool:
        unknown = set(fields) - UPDATABLE
        assert not unknown, f"not updatable: {unknown}"
        assignments = ", ".join(f"{name} = ?" for name in fields)
        sql = (f"UPDATE tasks SET state = ?, updated_at = ?{', ' if fields else ''}{assignments} "
               "WHERE task_id = ? AND owner = ? AND finished_at IS NULL")
        params = [state, time.time(), *fields.values(), task_id, owner]
        return await self._write(lambda db: db.execute(sql, params).rowcount == 1)

    async def _delete(self, task_id: str, owner: str) -> None:
        await self._write(lambda db: db.execute(
            "DELETE FROM tasks WHERE task_id = ? AND owner = ? AND finished_at IS NULL", (task_id, owner)))

    async def _reassign(self, task_id: str, owner: str, new_owner: str) -> bool:
        # one statement: SQLite's write lock makes the check and the write one step across processes
        return await self._write(lambda db: db.execute(
            "UPDATE tasks SET owner = ?, updated_at = ? WHERE task_id = ? AND owner = ? AND state = ? "
            "AND finished_at IS NULL", (new_owner, time.time(), task_id, owner, agent_pb2.QUEUED)).rowcount == 1)

    async def _queued_of_others(self) -> list[tuple[str, str, float]]:
        return await self._run(lambda db: db.execute(
            "SELECT task_id, owner, created_at FROM tasks WHERE finished_at IS NULL AND state = ? AND spec != '' "
            "AND owner != ?", (agent_pb2.QUEUED, self.owner)).fetchall())

    async def _renew(self, lease: Lease) -> None:
        await self._run(lambda db: db.execute(
            "INSERT INTO leases (owner, expires_at, host, pid) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at",
            (self.owner, lease.expires_at, lease.host, lease.pid)))

    async def _release(self) -> None:
        await self._run(lambda db: db.execute("DELETE FROM leases WHERE owner = ?", (self.owner,)))

    async def _lease(self, owner: str) -> Lease | None:
        row = await self._run(lambda db: db.execute(
            "SELECT expires_at, host, pid FROM leases WHERE owner = ?", (owner,)).fetchone())
        return None if row is None else Lease(*row)

    async def _unfinished(self, limit: int) -> list[TaskRecord]:
        rows = await self._run(lambda db: db.execute(
            f"SELECT {', '.join(COLUMNS)} FROM tasks WHERE finished_at IS NULL AND owner != ? LIMIT ?",
            (self.owner, limit)).fetchall())
        return [_record(row) for row in rows]

    async def _request_cancel(self, task_id: str, owner: str) -> None:
        await self._write(lambda db: db.execute(
            "INSERT OR IGNORE INTO cancel_requests (task_id, owner, requested_at) VALUES (?, ?, ?)",
            (task_id, owner, time.time())))

    async def _take_cancels(self) -> list[str]:
        # A read first: the poll finds none nearly always, and a read takes no write lock.
        if not await self._run(lambda db: db.execute(
                "SELECT 1 FROM cancel_requests WHERE owner = ? LIMIT 1", (self.owner,)).fetchone()):
            return []
        rows = await self._write(lambda db: db.execute(
            "DELETE FROM cancel_requests WHERE owner = ? RETURNING task_id", (self.owner,)).fetchall())
        return [task_id for (task_id,) in rows]

    async def _purge(self, now: float) -> int:
        def purge(db: sqlite3.Connection) -> int:
            removed = db.execute("DELETE FROM tasks WHERE finished_at IS NOT NULL AND finished_at < ?",
                                 (now - self.config.retention_s,)).rowcount
            removed += db.execute(
                "DELETE FROM tasks WHERE task_id IN (SELECT task_id FROM tasks WHERE finished_at IS NOT NULL "
                "ORDER BY finished_at DESC LIMIT -1 OFFSET ?)", (self.config.max_finished_tasks,)).rowcount
            db.execute("DELETE FROM cancel_requests WHERE requested_at < ?",  # a dead owner's, never taken
                       (now - 3 * self.config.lease_s,))
            db.execute("DELETE FROM leases WHERE expires_at < ? AND owner NOT IN "
                       "(SELECT DISTINCT owner FROM tasks WHERE finished_at IS NULL)", (now,))
            return removed

        return await self._run(purge)

