"""tools/request_path.py: the modules one RunTask passes through, recorded on a real in-process stack."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "request_path.py"


def _tool():
    spec = importlib.util.spec_from_file_location("request_path", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


request_path = _tool()
Visit = request_path.Visit


def test_a_return_is_a_visit_of_a_module_visited_before_an_rpc_boundary_counting_as_leaving():
    o, d = "orchestrator", "dispatcher"
    path = [
        Visit(o, "switchyard.orchestrator.service"),
        Visit(o, "switchyard.orchestrator.task"),
        Visit(o, "switchyard.common.channels"),
        None,
        Visit(d, "switchyard.common.channels"),  # the same module across an RPC boundary: a return
        Visit(d, "switchyard.dispatcher.engines.sim"),
        Visit(d, "switchyard.dispatcher.output"),
        Visit(d, "switchyard.dispatcher.engines.sim"),  # a return on the dispatcher side
        None,
        Visit(o, "switchyard.orchestrator.task"),  # a return on the orchestrator side
    ]
    report = request_path.PathReport("chat", path, {}, round_trip_end=7)
    assert [(v.side, v.module.rsplit(".", 1)[-1]) for v in report.returns] == [
        (d, "channels"), (d, "sim"), (o, "task")]
    assert [v.module for v in report.dispatcher_returns] == ["switchyard.common.channels",
                                                             "switchyard.dispatcher.engines.sim"]
    assert report.modules_returned_into == {"switchyard.common.channels", "switchyard.dispatcher.engines.sim",
                                            "switchyard.orchestrator.task"}
    assert (report.visits, report.boundaries) == (8, 2)
    assert len(report.round_trip().returns) == 1
    assert report.collapsed().startswith(
        "orchestrator.service -> orchestrator.task -> common.channels | common.channels -> dispatcher.engines.sim")


def test_helpers_are_not_counted_and_the_generated_modules_neither():
    assert not request_path.counted("switchyard.common.metrics")
    assert not request_path.counted("switchyard.dispatcher.scheduler.metrics")
    assert not request_path.counted("switchyard.api.agent_pb2_grpc")
    assert not request_path.counted("prometheus_client.metrics")
    assert request_path.counted("switchyard.dispatcher.engines.sim")
    assert request_path.is_helper("switchyard.common.telemetry")
    assert not request_path.is_helper("prometheus_client.metrics")


@pytest.mark.slow  # loads the embedding model for a small index
async def test_a_chat_task_runs_from_the_orchestrator_servicer_to_a_dispatcher_engine_and_back(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Starting\n\nRun `make run` to start the three services on this machine.\n")
    index = request_path.build_index([str(doc)], tmp_path / "index")
    [report] = await request_path.measure(index, ["chat"], max_tokens=4)
    visits = [v for v in report.path if v is not None]
    assert (visits[0].side, visits[0].module) == ("orchestrator", "switchyard.orchestrator.service")
    engine = [v for v in visits if v.module.startswith("switchyard.dispatcher.engines.")]
    assert engine and {v.side for v in engine} == {"dispatcher"}
    assert None in report.path  # the RPC boundary to the dispatcher, at least
    assert (visits[-1].side, visits[-1].module) == ("orchestrator", "switchyard.orchestrator.service")
    trip = report.round_trip()
    assert trip.path and any(v is not None and v.module.startswith("switchyard.dispatcher.engines.") for v in trip.path)
    assert not any(request_path.is_helper(v.module) for v in visits)
    # the one callback left on a chat task's path is the token-merge rule's item test (docs/architecture.md):
    # the KV budget reads a hand-over's bytes from the parking that records it, the accounting the one rule of a
    # request's live KV (accounting.held_kv_bytes), and a session tells an end by the item pushed to it, none of
    # them calling back into the scheduler or the request below them on the stack
    assert {str(c) for c in report.callbacks} <= {"common.coalescing -> dispatcher.output:_token_of"}
    # a react_loop task's steps park and are taken over: the parking frees a step's KV by the one release rule
    # (update.release_kv), not through the scheduler; what is left is moving a parked state out (its value and
    # copy are the scheduler's to decide)
    [react] = await request_path.measure(index, ["react_loop"], max_tokens=request_path.MAX_TOKENS)
    assert {str(c) for c in react.callbacks} <= {"common.coalescing -> dispatcher.output:_token_of",
                                                 "dispatcher.scheduler.parking -> dispatcher.scheduler.kv_memory:"
                                                 "KvMemory._demote_parked"}
    printed = io.StringIO()
    request_path.print_reports([report], show_path=False, out=printed)
    assert printed.getvalue().startswith("chat (1 recorded")


def _module(name: str, source: str) -> dict:
    """A module's namespace named ``name`` (its frames count as that module's), ``source`` run in it."""
    namespace: dict = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - the test's own code
    return namespace


def test_a_callback_is_a_call_into_a_module_waiting_below_and_a_plain_call_and_return_is_not():
    caller = _module("switchyard.dispatcher.fake_caller", """
def hook():
    return 1

def run(callee):
    callee["work"]()            # a call that returns: not a callback
    callee["work"]()            # called again from the same caller: still not one
    callee["call_back"](hook)   # the callee calls hook, in this module, waiting below it: one
""")
    callee = _module("switchyard.dispatcher.fake_callee", """
def work():
    return 2

def call_back(fn):
    return fn()
""")
    recorder = request_path.PathRecorder(caller["run"].__code__)
    with recorder.install():
        caller["run"](callee)
    report = recorder.report("chat")
    assert [str(c) for c in report.callbacks] == ["dispatcher.fake_callee -> dispatcher.fake_caller:hook"]
    assert len(report.returns) >= 3  # the strict count sees every return into the caller


async def test_a_task_continues_the_stack_of_its_waiting_creator_and_a_resuming_coroutine_is_no_call():
    import asyncio

    creator = _module("switchyard.dispatcher.fake_creator", """
import asyncio

def hook():
    return 1

async def serve(worker):
    task = asyncio.create_task(worker["read"](hook))  # the reader runs while serve waits for it
    await task
""")
    worker = _module("switchyard.dispatcher.fake_worker", """
import asyncio

async def read(fn):
    await asyncio.sleep(0)  # resumes later: a resumption, not a call
    await asyncio.sleep(0)
    return fn()             # back into its waiting creator's module: a callback
""")
    original = asyncio.create_task
    creators = request_path.TaskCreators()
    recorder = request_path.PathRecorder(creator["serve"].__code__, creators)
    with creators.install(), recorder.install():
        await creator["serve"](worker)
    report = recorder.report("chat")
    assert [str(c) for c in report.callbacks] == ["dispatcher.fake_worker -> dispatcher.fake_creator:hook"]
    without = request_path.PathRecorder(creator["serve"].__code__)  # no creators recorded: the task stands alone
    with without.install():
        await creator["serve"](worker)
    assert without.report("chat").callbacks == []
    assert asyncio.create_task is original  # the recording wrapper is gone
