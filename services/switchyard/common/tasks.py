"""Background asyncio tasks whose outcome nobody awaits: retrieved when they end, never left to the GC.

asyncio logs "Task exception was never retrieved", with a traceback, when a
task that ended with an exception is collected before anyone read it: a RunTask
whose caller's deadline cancelled the handler just as the task itself ended
DEADLINE_EXCEEDED (both fire at the same instant), a stream's reader whose
stream was dropped, a re-resolution replaced by the next one. :func:`settle`
reads the outcome when the task ends, so the exception is either expected (the
caller who would have read it is gone: logged at DEBUG) or logged once, by
name, at ERROR.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


def settle(task: asyncio.Future[Any], expected: Callable[[BaseException], bool] | None = None) -> asyncio.Future[Any]:
    """Retrieve ``task``'s outcome when it ends (at once when it has ended); returns ``task``. An exception it
    ended with is logged at DEBUG (the outcome had no reader left).

    Args:
        expected: exceptions for which this returns False are logged at ERROR with their traceback instead (a
            bug, not an outcome); None: all are expected.
    """

    def retrieve(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            return
        exc = done.exception()
        if exc is None:
            return
        name = done.get_name() if isinstance(done, asyncio.Task) else repr(done)
        if expected is not None and not expected(exc):
            log.error("%s failed: %s", name, exc, exc_info=exc)
        else:
            log.debug("%s ended with %s: %s (nobody was waiting for it)", name, type(exc).__name__, exc)

    task.add_done_callback(retrieve)
    return task
