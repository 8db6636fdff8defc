"""The scheduler is a pure state machine: no module of ``switchyard.dispatcher.scheduler`` imports a metrics,
tracing or event-loop library; the step loop owns time and telemetry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import switchyard.dispatcher.scheduler as scheduler_package

pytestmark = pytest.mark.no_gpu

FORBIDDEN = ("prometheus_client", "opentelemetry", "asyncio")
"""Top-level packages the scheduler may not import (directly, or lazily inside a function)."""

PACKAGE = Path(scheduler_package.__file__).parent


def imported(source: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` statement in ``source`` names, anywhere in it
    (function bodies and ``TYPE_CHECKING`` blocks included); ``importlib.import_module("x")`` calls with a
    literal name count too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("import_module", "__import__") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def forbidden(source: str) -> set[str]:
    return {name for name in imported(source) if name.split(".")[0] in FORBIDDEN}


def test_the_scan_finds_every_form_of_import() -> None:
    source = (
        "import asyncio\n"
        "from prometheus_client import Counter\n"
        "import opentelemetry.trace as t\n"
        "def f():\n"
        "    from opentelemetry import context\n"
        "    importlib.import_module('prometheus_client.core')\n"
        "    __import__('asyncio.tasks')\n"
        "from switchyard.common.metrics import bounded\n"
        "from . import base\n"
    )
    assert forbidden(source) == {"asyncio", "prometheus_client", "opentelemetry.trace", "opentelemetry",
                                 "prometheus_client.core", "asyncio.tasks"}
    assert forbidden("import asyncio_extras\nfrom prometheus import x\n") == set()


def test_no_scheduler_module_imports_prometheus_opentelemetry_or_asyncio() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert {path.name for path in modules} >= {"core.py", "parking.py", "admission.py", "compute_score.py"}
    found = {str(path.relative_to(PACKAGE)): sorted(names)
             for path in modules if (names := forbidden(path.read_text(encoding="utf-8")))}
    assert found == {}, f"the scheduler records plain data; the step loop publishes it: {found}"


def test_every_count_the_scheduler_keeps_is_published_by_the_loop_once() -> None:
    from dataclasses import fields

    from prometheus_client import REGISTRY

    from switchyard.common.config import SwitchyardConfig
    from switchyard.common.errors import QueueFullError
    from switchyard.dispatcher import metrics
    from switchyard.dispatcher.request import Request
    from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler
    from switchyard.dispatcher.scheduler.base import SchedulerCounters

    published = {name for name, _ in metrics._LABELLED} | {name for name, _ in metrics._PLAIN} | {"queue_rejections"}
    assert {f.name for f in fields(SchedulerCounters)} == published

    config = SwitchyardConfig().with_overrides(**{"queues.inference.capacity": 1})
    sched = make_scheduler(config, monitor=ComputeScoreMonitor(config.scheduler, nvml=False))

    def rejected() -> float:
        return REGISTRY.get_sample_value("switchyard_queue_rejected_total", {"queue": "inference", "reason": "full"})

    metrics.publish_stats(sched.make_stats())
    before = rejected()
    sched.add_request(Request(request_id="a", prompt_tokens=4, max_tokens=2, arrival=0.0), 0.0)
    with pytest.raises(QueueFullError):
        sched.add_request(Request(request_id="b", prompt_tokens=4, max_tokens=2, arrival=0.0), 0.0)
    assert sched.counters.queue_rejections["full"] == 1 and rejected() == before  # plain data until published
    metrics.publish_stats(sched.make_stats())
    assert rejected() == before + 1
    metrics.publish_stats(sched.make_stats())  # a second report counts only what happened since the first
    assert rejected() == before + 1 and sched.counters.queue_rejections["full"] == 1


def test_a_report_made_after_two_flushes_holds_each_batchs_own_members() -> None:
    """The loop may publish a report some steps after a flush (engine_loop.STATS_INTERVAL_S): each flushed
    batch in it keeps its own members, though the double buffer reuses its lists at every swap."""
    from switchyard.common.config import SwitchyardConfig
    from switchyard.dispatcher.double_buffer import FlushReason
    from switchyard.dispatcher.request import Request
    from switchyard.dispatcher.scheduler import ComputeScoreMonitor, make_scheduler

    config = SwitchyardConfig()
    sched = make_scheduler(config, monitor=ComputeScoreMonitor(config.scheduler, nvml=False))
    sched.make_stats()
    batches = [[Request(request_id=f"{n}-{i}", prompt_tokens=4, max_tokens=2, arrival=0.0) for i in range(k)]
               for n, k in enumerate((2, 3, 1))]
    for at, batch in enumerate(batches):
        for req in batch:
            sched.add_request(req, float(at))
        sched.flush(FlushReason.STEP, float(at))
    flushed = sched.make_stats().events.flushed
    assert [[req.request_id for req in f.members] for f in flushed] == [[r.request_id for r in b] for b in batches]
    assert [f.at for f in flushed] == [0.0, 1.0, 2.0]


def _scheduler_uses(source: str) -> set[str]:
    """The attributes ``source`` reads or calls on a scheduler: ``scheduler.X`` or ``<anything>.scheduler.X``, but
    ``config.scheduler`` (the config section of that name)."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "scheduler":
            used.add(node.attr)
        elif isinstance(owner, ast.Attribute) and owner.attr == "scheduler":
            config = owner.value
            if not ((isinstance(config, ast.Name) and config.id == "config")
                    or (isinstance(config, ast.Attribute) and config.attr == "config")):
                used.add(node.attr)
    return used


def test_the_scheduler_interface_declares_what_the_loops_and_the_service_use() -> None:
    """``Scheduler`` is the one interface: every attribute the engine loops, the service and the processor use on
    their scheduler is declared there, so a policy written against it runs in the dispatcher (it listed the turn's
    calls only, while the loops also called admit_core, on_idle, on_oom, tool_wait, prefetched and read the
    double buffer, the tiers and the monitor)."""
    from switchyard.dispatcher.scheduler.base import Scheduler

    assert _scheduler_uses("scheduler.schedule(1)\nself.scheduler.intake.closed\nconfig.scheduler.x\n"
                           "self.config.scheduler.y\n") == {"schedule", "intake"}
    declared = {name for name in vars(Scheduler) if not name.startswith("_")} | set(Scheduler.__annotations__)
    dispatcher = PACKAGE.parent
    used: dict[str, set[str]] = {}
    for path in sorted(dispatcher.glob("*.py")):
        for name in _scheduler_uses(path.read_text(encoding="utf-8")):
            used.setdefault(name, set()).add(path.name)
    assert {"schedule", "admit_core", "intake"} <= set(used)  # the scan sees the loops
    missing = {name: sorted(where) for name, where in used.items() if name not in declared}
    assert not missing, f"used on the scheduler but not declared on Scheduler: {missing}"
