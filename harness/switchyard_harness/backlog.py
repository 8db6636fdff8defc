"""The backlog a load generator leaves: the submitted tasks still queued or running when it stops.

A submit is answered once the task is recorded; the task then waits in the orchestrator's backlog and runs after
the load generator has moved on. Left alone, that backlog goes on loading the stack after the generator exits (and
under whatever is measured next). The locustfile (at the test's stop) and ``switchyard bench http`` (after each
submit phase) settle it the same way: each task is cancelled through ``POST /api/v1/tasks/{task_id}/cancel`` (a
finished task is answered unchanged), or with ``keep`` its state is only read (``GET /api/v1/tasks/{task_id}``).
This module reads those answers and words the report; each caller sends the requests with its own client (gevent
and requests in locust, asyncio and aiohttp in the bench).
"""

from __future__ import annotations

from typing import Any

CANCELLED_WHILE = "CANCELLED: cancelled by CancelTask while "
"""How a cancelled task's error begins (then QUEUED or RUNNING: where the cancel found it)."""
SETTLE_CONCURRENCY = 32
"""Cancel (or status) requests in flight at once while a backlog is settled."""
SETTLE_DEADLINE_S = 60.0
"""Seconds the settling may take in all; tasks not asked by then are reported as not asked."""


def task_path(base: str, task_id: str) -> str:
    """``{base}/api/v1/tasks/{task_id}`` with the id quoted."""
    import urllib.parse

    return f"{base.rstrip('/')}/api/v1/tasks/{urllib.parse.quote(task_id, safe='')}"


def outcome(status_code: int, text: str, keep: bool) -> tuple[str, str]:
    """What one cancel (or, with ``keep``, status) answer says of its task.

    Returns:
        (its state when asked: ``queued``, ``running``, ``finished``, ``failed``, or ``""`` when not known; what
        became of it: ``cancelled``, ``kept``, ``done`` (it had ended), or ``error: ...`` naming why it was not
        answered).
    """
    import json

    if status_code != 200:
        return "", f"error: {status_code} {text[:200]}"
    try:
        status: Any = json.loads(text)
        state, error = str(status["state"]), str(status.get("error") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", f"error: not a task status: {text[:200]}"
    if keep:
        return state, "kept" if state in ("queued", "running") else "done"
    if state == "failed" and error.startswith(CANCELLED_WHILE):
        return error[len(CANCELLED_WHILE):].split()[0].strip(",").lower(), "cancelled"
    return state, "done"


def backlog_summary(outcomes: dict[str, tuple[str, str]], cut: int, keep: bool, who: str = "the users",
                    when: str = "at the stop") -> str:
    """One line on a settled backlog (``outcomes``: task_id -> :func:`outcome`) and the ``cut`` submits (cut
    before their answer came: their tasks, if accepted, are not known)."""
    left = [state for state, result in outcomes.values() if result in ("cancelled", "kept")]
    errors = [result for _, result in outcomes.values() if result.startswith("error")]
    settled = (f"({left.count('queued')} queued, {left.count('running')} running): "
               + ("kept (--keep-backlog), they run on" if keep else "cancelled (--keep-backlog keeps them)"))
    if errors:  # their states are not known: not counted among the finished (the orchestrator down at the stop)
        line = (f"backlog {when}: of the {len(outcomes)} tasks {who} submitted, {len(errors)} could not be "
                f"{'read' if keep else 'cancelled'} (first: {errors[0][7:]}), so whether they had finished is not "
                f"known; of the other {len(outcomes) - len(errors)}, {len(left)} had not finished {settled}")
    else:
        line = f"backlog {when}: {len(left)} of the {len(outcomes)} tasks {who} submitted had not finished {settled}"
    if cut:
        line += (f"; {cut} submit(s) cut by the stop before their answer: their tasks, if accepted, are not known "
                 "here")
    return line


def backlog_counts(outcomes: dict[str, tuple[str, str]]) -> dict[str, int]:
    """The settled backlog in numbers: tasks submitted, not finished (queued, running), cancelled or kept,
    errors."""
    results = [result for _, result in outcomes.values()]
    left = [state for state, result in outcomes.values() if result in ("cancelled", "kept")]
    return {"submitted": len(outcomes), "unfinished": len(left), "queued": left.count("queued"),
            "running": left.count("running"), "cancelled": results.count("cancelled"), "kept": results.count("kept"),
            "errors": sum(result.startswith("error") for result in results)}


async def settle(http: str, task_ids: list[str], keep: bool, headers: dict[str, str] | None = None,
                 concurrency: int = SETTLE_CONCURRENCY, deadline_s: float = SETTLE_DEADLINE_S,
                 timeout_s: float = 10.0) -> dict[str, tuple[str, str]]:
    """Cancel (or with ``keep`` read) the tasks ``task_ids`` at the HTTP face ``http``, with aiohttp:
    ``concurrency`` requests at once, each within ``timeout_s`` seconds, all within ``deadline_s``; task_id ->
    :func:`outcome`."""
    import asyncio
    import time

    import aiohttp

    ends = time.monotonic() + deadline_s
    gate = asyncio.Semaphore(concurrency)
    out: dict[str, tuple[str, str]] = {}
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(headers=headers or {}, timeout=client_timeout,
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(task_id: str) -> None:
            async with gate:
                if time.monotonic() > ends:
                    out[task_id] = ("", f"error: not asked within {deadline_s:g} s")
                    return
                path = task_path(http, task_id)
                try:
                    async with (session.get(path) if keep else session.post(f"{path}/cancel")) as reply:
                        out[task_id] = outcome(reply.status, await reply.text(), keep)
                except asyncio.TimeoutError:  # aiohttp's timeout carries no message
                    out[task_id] = ("", f"error: no answer within {timeout_s:g} s")
                except aiohttp.ClientError as exc:
                    out[task_id] = ("", f"error: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(task_id) for task_id in reversed(task_ids)))  # newest first: the queued ones
    return out
