"""An orchestrator's config for tests: its own sections, pointed at the given servers, its task store in a
temporary folder."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Iterator

from switchyard.common.config import SwitchyardConfig, load_config


@contextlib.contextmanager
def orchestrator_config(retrieval_addr: str, dispatcher_addr: str, base: SwitchyardConfig | None = None,
                        **overrides: Any) -> Iterator[SwitchyardConfig]:
    """``base`` (default: the shipped ``config/`` as ``switchyard serve orchestrator`` loads it, the
    orchestrator's own sections only) pointed at ``retrieval_addr`` and ``dispatcher_addr`` (``host:port``),
    its task store SQLite in a temporary folder removed on exit, its CPU work on the event loop (a spawn pool
    costs seconds; a test of the pool overrides ``orchestrator.cpu_executor``), then ``overrides`` (dotted
    keys, as :meth:`SwitchyardConfig.with_overrides`)."""
    base = base or load_config("config", service="orchestrator")
    with tempfile.TemporaryDirectory(prefix="switchyard-tasks-") as store:
        yield base.with_overrides(**{
            "orchestrator.retrieval_addr": retrieval_addr,
            "orchestrator.dispatcher_addr": dispatcher_addr,
            "orchestrator.task_store.sqlite_path": f"{store}/tasks.sqlite3",
            "orchestrator.cpu_executor": "loop",
            **overrides,
        })
