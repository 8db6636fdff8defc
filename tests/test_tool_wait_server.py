"""The ToolWait decision on real gRPC servers (127.0.0.1 port 0): an orchestrator's react_loop task announces
its tool calls to the sim dispatcher, whose scheduler decides for the agent's parked step; and the RPC asked
directly about a parked agent (keep for a short wait, move out for a very long one)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import SwitchyardConfig, load_config
from switchyard.common.server import running, start_server
from switchyard.common.tenant import DEFAULT_TENANT, program_key
from switchyard.dispatcher.metrics import (
    RESUMES,
    TOOL_RESUMES,
    TOOL_WAIT_DECISIONS,
    TOOL_WAIT_DECISIONS_BY_TOOL,
    TOOL_WAIT_PREFETCHES,
)
from switchyard.dispatcher.tiers.metrics import RESTORED_TOKENS
from switchyard.dispatcher.service import DispatcherService
from switchyard.orchestrator.metrics import TOOL_WAIT_HINTS
from switchyard.orchestrator.service import OrchestratorService
from test_orchestrator import Downstream
from test_program import _until, _value, collect
from fast_sim import FAST
from orchestrator_fixtures import orchestrator_config
from redis_fixtures import RedisDb, free_port, redis_db, redis_server  # noqa: F401


def _decisions() -> dict[str, float]:
    return {d: _value(TOOL_WAIT_DECISIONS, decision=d) for d in ("keep", "swap", "drop")}


async def test_a_react_loop_tool_call_is_decided_by_the_sim_dispatchers_scheduler():
    """Orchestrator -> sim dispatcher: the model's tool calls park the agent's step, the orchestrator's
    ToolWait reaches the dispatcher while it is parked, and the scheduler's decision is counted."""
    before, hints = _decisions(), _value(TOOL_WAIT_HINTS, outcome="ok")
    dispatcher = DispatcherService(SwitchyardConfig().with_overrides(**FAST))
    retrieval = Downstream()
    base = load_config("config", service="orchestrator")
    async with running([dispatcher], base.server) as disp, running([retrieval], base.server) as retr:
        with orchestrator_config(f"127.0.0.1:{retr.port}", f"127.0.0.1:{disp.port}", base,
                                 **{"orchestrator.program.tool_wait_cold_estimate_s": 2.0}) as cfg:
            orchestrator = OrchestratorService(cfg)
            async with running([orchestrator], cfg.server) as orch:
                channel = open_channel(f"127.0.0.1:{orch.port}")
                events = await collect(agent_pb2_grpc.AgentServiceStub(channel), task_id="tw-sim",
                                       agent_id="agent-sim", payload="How does the with statement work?",
                                       task_type="react_loop")
                await _until(lambda: _value(TOOL_WAIT_HINTS, outcome="ok") > hints, "a ToolWait answered")
                await channel.close()
    assert events[-1].HasField("final")
    after = _decisions()
    decided = sum(after.values()) - sum(before.values())
    # every announcement found the agent's step parked (it parks before its done chunk is sent) and was decided
    assert decided >= 1 and decided == _value(TOOL_WAIT_HINTS, outcome="ok") - hints


@pytest.fixture
async def dispatcher():
    # the sim's own prefill costs (not FAST's: recomputing must cost what a real prefill does), no DRAM tier
    # (without Redis a swap cannot be made: keep or drop)
    service = DispatcherService(SwitchyardConfig().with_overrides(**{"memory.dram.kv_swap": False}))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            yield agent_pb2_grpc.InferenceServiceStub(channel), service
        finally:
            await channel.close()


TOOLS = [agent_pb2.ToolSpec(name="search_docs", description="search", parameters_json='{"type": "object"}')]
QUESTION = agent_pb2.ChatMessage(role="user", content="How does the with statement work in Python?")


async def _park(stub, agent_id: str, task_id: str = "") -> list[agent_pb2.GenerateChunk]:
    """One react_loop step of ``agent_id`` (of its task ``task_id``) that ends in a tool call (the step parks)."""
    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
        request_id=f"{agent_id}:{task_id}:0", agent_id=agent_id, task_id=task_id, task_type="react_loop",
        tools=TOOLS, max_tokens=64, messages=[QUESTION]))]
    assert chunks[-1].done.finish_reason == "tool_calls"
    return chunks


async def test_a_parked_agent_is_kept_for_a_short_wait_and_moved_out_for_a_very_long_one(dispatcher):
    stub, service = dispatcher
    await _park(stub, "parked-agent")
    scheduler = service.loop.scheduler
    assert [r.agent_id for r in scheduler.parked] == ["parked-agent"]
    before = _decisions()

    short = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="parked-agent", tool="search_docs",
                                                          expected_wait_s=0.5))
    assert short.decision == agent_pb2.KEEP and short.restore_at_s == 0
    assert [r.agent_id for r in scheduler.parked] == ["parked-agent"]  # still warm in HBM
    assert _value(TOOL_WAIT_DECISIONS, decision="keep") == before["keep"] + 1

    # a day's wait: holding the KV costs more than recomputing it
    long = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="parked-agent", tool="search_docs",
                                                         expected_wait_s=86_400.0))
    assert (long.decision, long.restore_at_s) == (agent_pb2.DROP, 0.0)
    assert scheduler.parked == []  # out of HBM
    assert _value(TOOL_WAIT_DECISIONS, decision="drop") == before["drop"] + 1

    # nothing parked any more: nothing decided (UNSPECIFIED, restore 0), and no decision counted
    again = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="parked-agent", tool="search_docs",
                                                          expected_wait_s=86_400.0))
    assert (again.decision, again.restore_at_s) == (agent_pb2.TOOL_WAIT_DECISION_UNSPECIFIED, 0.0)
    assert sum(_decisions().values()) == sum(before.values()) + 2


async def test_two_tasks_of_one_agent_keep_their_own_parked_state_decisions_and_end(dispatcher):
    """One agent runs two react_loop tasks at once (the field's load test draws each task's agent from 1,000
    ids). Keyed by the agent alone, the second task's step released the first's parked KV, a tool-wait
    decision for one task moved the other's state, and one task's end released the other's."""
    stub, service = dispatcher
    scheduler = service.loop.scheduler
    await _park(stub, "shared-agent", "task-a")
    await _park(stub, "shared-agent", "task-b")
    assert sorted(r.task_id for r in scheduler.parked) == ["task-a", "task-b"]  # both warm

    def announce(task_id: str, wait_s: float, ended: bool = False) -> agent_pb2.ToolWaitReply:
        return stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="shared-agent", task_id=task_id, tool="search_docs",
                                                       expected_wait_s=wait_s, task_ended=ended))

    assert (await announce("task-a", 86_400.0)).decision == agent_pb2.DROP  # a day: task-a's state leaves HBM
    assert [r.task_id for r in scheduler.parked] == ["task-b"]
    assert (await announce("task-b", 0.5)).decision == agent_pb2.KEEP
    await announce("task-a", 0.5, ended=True)  # task-a ends during its wait: task-b's state stays
    assert [r.task_id for r in scheduler.parked] == ["task-b"]
    warm = scheduler.counters.resumes["warm"]
    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
        request_id="shared-agent:task-b:1", agent_id="shared-agent", task_id="task-b", task_type="react_loop",
        tools=TOOLS, max_tokens=8, resume=True, messages=[QUESTION, agent_pb2.ChatMessage(role="tool", content="x")]))]
    assert chunks[-1].HasField("done") and scheduler.counters.resumes["warm"] == warm + 1  # its own state
    await announce("task-b", 0.5, ended=True)
    assert scheduler.parked == [] and scheduler.parking.kv_bytes == 0


async def test_a_tool_the_orchestrator_does_not_register_is_measured_under_its_name_and_counted_as_other(dispatcher):
    """ToolWait is open to any caller's tools: the scheduler times each tool's restores by that tool's own
    returns (before, every unregistered name was measured as one tool, ``other``); the metrics' ``tool``
    label stays the bounded set."""
    stub, service = dispatcher
    scheduler = service.loop.scheduler
    kept_other = _value(TOOL_WAIT_DECISIONS_BY_TOOL, tool="other", decision="keep")
    await _park(stub, "fetching-agent")
    reply = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="fetching-agent", tool="fetch_page",
                                                          expected_wait_s=0.5))
    assert reply.decision == agent_pb2.KEEP
    assert _value(TOOL_WAIT_DECISIONS_BY_TOOL, tool="other", decision="keep") == kept_other + 1
    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
        request_id="fetching-agent:1", agent_id="fetching-agent", task_type="react_loop", tools=TOOLS,
        max_tokens=8, resume=True, messages=[QUESTION, agent_pb2.ChatMessage(role="tool", content="a page")]))]
    assert chunks[-1].HasField("done")
    assert list(scheduler.tool_waits._returns) == ["fetch_page"]  # the turn measured the tool by its name


async def test_with_a_dram_tier_a_very_long_wait_swaps_and_the_next_step_restores_the_copy(redis_db: RedisDb):
    """SWAP: the KV leaves HBM for the DRAM tier (a real Redis) with a restore plan inside the wait; the
    agent's next step (``resume``) brings the copy back at its admission instead of recomputing it."""
    service = DispatcherService(SwitchyardConfig().with_overrides(**redis_db.overrides))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        first = await _park(stub, "swapped-agent")
        swaps, restored = _value(TOOL_WAIT_DECISIONS, decision="swap"), _value(RESUMES, resume="restored")
        tokens = RESTORED_TOKENS._value.get()
        wait_s = 86_400.0
        reply = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="swapped-agent", tool="search_docs",
                                                              expected_wait_s=wait_s))
        # back in HBM by plan the margin (0.05 s) ahead of the tool's expected return: the round trip fits
        assert reply.decision == agent_pb2.SWAP and reply.restore_at_s == pytest.approx(wait_s - 0.05)
        assert service.loop.scheduler.parked == []
        assert _value(TOOL_WAIT_DECISIONS, decision="swap") == swaps + 1
        call = next(c.tool_call for c in first if c.HasField("tool_call"))
        chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
            request_id="swapped-agent:1", agent_id="swapped-agent", task_type="react_loop", tools=TOOLS,
            max_tokens=64, resume=True, messages=[
                QUESTION,
                agent_pb2.ChatMessage(role="assistant", tool_calls=[agent_pb2.ToolCall(
                    call_id=call.call_id, name=call.name, arguments_json=call.arguments_json)]),
                agent_pb2.ChatMessage(role="tool", tool_call_id=call.call_id, name=call.name,
                                      content="The with statement calls __enter__ and __exit__."),
            ]))]
        await channel.close()
    assert chunks[-1].HasField("done")
    assert _value(RESUMES, resume="restored") == restored + 1
    assert RESTORED_TOKENS._value.get() > tokens


def _by_tool(tool: str) -> dict[str, float]:
    return {
        **{d: _value(TOOL_WAIT_DECISIONS_BY_TOOL, tool=tool, decision=d) for d in ("keep", "swap", "drop")},
        **{r: _value(TOOL_RESUMES, tool=tool, resume=r) for r in ("warm", "cold")},
        **{t: _value(TOOL_WAIT_PREFETCHES, tool=tool, tool_return=t) for t in ("early", "on_time", "late")},
    }


def _resume_request(agent_id: str, first: list[agent_pb2.GenerateChunk]) -> agent_pb2.GenerateRequest:
    call = next(c.tool_call for c in first if c.HasField("tool_call"))
    return agent_pb2.GenerateRequest(
        request_id=f"{agent_id}:1", agent_id=agent_id, task_type="react_loop", tools=TOOLS, max_tokens=64,
        resume=True, messages=[
            QUESTION,
            agent_pb2.ChatMessage(role="assistant", tool_calls=[agent_pb2.ToolCall(
                call_id=call.call_id, name=call.name, arguments_json=call.arguments_json)]),
            agent_pb2.ChatMessage(role="tool", tool_call_id=call.call_id, name=call.name,
                                  content="The with statement calls __enter__ and __exit__."),
        ])


async def test_a_swap_is_restored_before_the_tools_expected_return_and_counted_per_tool(redis_db: RedisDb):
    """A 2 s tool wait on the sim (a real Redis as the DRAM tier) swaps; the dispatcher brings the copy
    back on its own, shortly before the expected return, and parks the agent's step again; the next
    step finds it warm. Decisions, resumes and the prefetch's timing are exported under the tool's name,
    and a tool the orchestrator does not register is counted as ``other``."""
    # a copy's fixed latency of 0.1 ms (a local link): for this short prompt a 2 s wait is then worth a swap
    service = DispatcherService(SwitchyardConfig().with_overrides(
        **redis_db.overrides, **{"memory.dram.transfer_latency_ms": 0.1}))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        scheduler = service.loop.scheduler
        first = await _park(stub, "prefetched-agent")
        before, other = _by_tool("search_docs"), _by_tool("other")
        reply = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="prefetched-agent", tool="search_docs",
                                                              expected_wait_s=2.0))
        assert reply.decision == agent_pb2.SWAP and 0 < reply.restore_at_s < 2.0
        assert scheduler.parked == []
        await _until(lambda: [r.agent_id for r in scheduler.parked] == ["prefetched-agent"],
                     "the swapped KV back in HBM, parked again")
        assert _by_tool("search_docs")["early"] == before["early"]  # back before the turn
        chunks = [c async for c in stub.Generate(_resume_request("prefetched-agent", first))]
        assert chunks[-1].HasField("done")

        await _park(stub, "unregistered-tool-agent")
        await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="unregistered-tool-agent", tool="web_browser",
                                                      expected_wait_s=0.01))
        await channel.close()
    after = _by_tool("search_docs")
    assert after["swap"] == before["swap"] + 1
    assert after["warm"] == before["warm"] + 1 and after["cold"] == before["cold"]
    # on_time unless this machine stalled past the tool's revisit time (4 s): then late; never early
    assert after["on_time"] + after["late"] == before["on_time"] + before["late"] + 1
    assert after["early"] == before["early"]
    assert _by_tool("other")["keep"] == other["keep"] + 1
    assert _value(TOOL_WAIT_DECISIONS_BY_TOOL, tool="web_browser", decision="keep") == 0  # never a label of its own


async def test_the_orchestrator_records_the_dispatchers_decision_on_the_tools_span():
    """The orchestrator's announcement (InferenceClient.announce_tool_wait, over a real channel) writes the
    dispatcher's answer on the span current when the tool started, while that span is open."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from switchyard.orchestrator.clients import InferenceClient
    from switchyard.orchestrator.validation import TaskSpec

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = DispatcherService(SwitchyardConfig().with_overrides(**{"memory.dram.kv_swap": False}))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        await _park(agent_pb2_grpc.InferenceServiceStub(channel), "announced-agent", "announced-task")
        await channel.close()
        client = InferenceClient(f"127.0.0.1:{srv.port}", service.config.server)
        hints = _value(TOOL_WAIT_HINTS, outcome="ok")
        spec = TaskSpec(task_id="announced-task", payload="", workflow="react_loop", priority=agent_pb2.NORMAL,
                        max_tokens=64, model="", agent_id="announced-agent")
        try:
            with provider.get_tracer("test").start_as_current_span("tool search_docs"):
                client.announce_tool_wait(spec, "search_docs", 0.5)
                await _until(lambda: _value(TOOL_WAIT_HINTS, outcome="ok") > hints, "the ToolWait answered")
        finally:
            await client.close()
            provider.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["switchyard.tool_wait.decision"] == "KEEP"
    assert "switchyard.tool_wait.restore_at_s" not in span.attributes


@pytest.mark.parametrize("field, request_fields", [
    ("agent_id", {"agent_id": "", "tool": "search_docs"}),
    ("agent_id", {"agent_id": "agent\x00one", "tool": "search_docs"}),  # Generate refuses this id: so must ToolWait
    ("task_id", {"agent_id": "agent-1", "task_id": "task\x00one", "tool": "search_docs"}),  # Generate's rule too
    ("tool", {"agent_id": "agent-1", "tool": "search\ndocs"}),
    ("tool", {"agent_id": "agent-1", "tool": "t" * 257}),
    # no tool offered to Generate can have these names (tools[i].name's rule): they were taken
    ("tool", {"agent_id": "agent-1", "tool": "search docs"}),
    ("tool", {"agent_id": "agent-1", "tool": "t" * 65}),
    ("tool", {"agent_id": "agent-1", "tool": "search_docs\u200b"}),
    ("expected_wait_s", {"agent_id": "agent-1", "tool": "search_docs", "expected_wait_s": -1.0}),
    ("expected_wait_s", {"agent_id": "agent-1", "tool": "search_docs", "expected_wait_s": 1.7e308}),  # a sum of +Inf
    ("expected_wait_s", {"agent_id": "agent-1", "tool": "search_docs", "expected_wait_s": 86_400.5}),  # past a day
    ("priority", {"agent_id": "agent-1", "tool": "search_docs", "priority": 7}),
])
async def test_a_malformed_announcement_is_refused_naming_its_field_by_generates_rules(dispatcher, field,
                                                                                      request_fields):
    stub, _ = dispatcher
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ToolWait(agent_pb2.ToolWaitRequest(**request_fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


class _ToolThatHangs(Downstream):
    """The test downstream as retrieval only: its Retrieve (the search_docs tool) waits on ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.called = asyncio.Event(), asyncio.Event()

    async def Retrieve(self, request, context):
        self.called.set()
        await self.gate.wait()
        return await super().Retrieve(request, context)


@pytest.mark.parametrize("ending", ["cancelled", "past its deadline", "refused before its next step",
                                    "its next step refused by the dispatcher"])
async def test_a_task_that_ends_during_its_tool_wait_has_its_agents_parked_state_and_plan_released(
        redis_db: RedisDb, ending: str):
    """The orchestrator runs a react_loop task on the sim dispatcher (a real Redis as the DRAM tier); its
    search_docs call hangs. The announcement swaps the agent's KV to DRAM and plans its restore ahead of
    the tool's expected return (3 s). The task then ends during the wait: cancelled (CancelTask), past its
    deadline (the caller's, 1.5 s), refused early before its next step (a measured model step longer
    than its time left), or its next step refused by the dispatcher (INVALID_ARGUMENT: the tool's result
    took the prompt past what the dispatcher takes). The dispatcher was never told: it restored the dead agent's KV into HBM at the
    planned time and held it there until the tool's revisit time, its DRAM copy stayed, and its call
    counted as a running one of search_docs. Now the orchestrator says the task ended (ToolWait with
    task_ended) and the dispatcher releases the parked state, the DRAM copy and the plan at once."""
    # a dispatcher taking prompts of 10,000 characters: the next step refused (the orchestrator keeps the
    # conversation inside the model's window in tokens, not inside another replica's character bound)
    dispatcher = DispatcherService(SwitchyardConfig().with_overrides(
        **redis_db.overrides, **{"batching.flush_interval_ms": 2, "limits.max_prompt_chars": 10_000}))
    tool = _ToolThatHangs()
    base = load_config("config", service="orchestrator")
    async with running([dispatcher], base.server) as disp, running([tool], base.server) as retr:
        with orchestrator_config(f"127.0.0.1:{retr.port}", f"127.0.0.1:{disp.port}", base,
                                 **{"orchestrator.program.tool_wait_cold_estimate_s": 3.0}) as cfg:
            orchestrator = OrchestratorService(cfg)
            async with running([orchestrator], cfg.server) as orch:
                channel = open_channel(f"127.0.0.1:{orch.port}")
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                scheduler, hints = dispatcher.loop.scheduler, _value(TOOL_WAIT_HINTS, outcome="ok")
                request = agent_pb2.RunTaskRequest(task_id="t-ends", agent_id="agent-ends", task_type="react_loop",
                                                   payload="How does the with statement work?")
                if ending == "cancelled":  # a submitted task, cancelled by CancelTask
                    await stub.SubmitTask(request)
                else:
                    run = asyncio.create_task(collect_events(stub, request, 1.5 if ending == "past its deadline" else 60))
                await tool.called.wait()
                await _until(lambda: _value(TOOL_WAIT_HINTS, outcome="ok") > hints, "the tool's announcement")
                waiting = program_key(DEFAULT_TENANT, "agent-ends", "t-ends")  # the task's key
                plan = scheduler.tool_waits.get(waiting)
                assert plan is not None and plan.decision.value == "swap" and plan.restore_at is not None
                redis = redis_db.sync_client()
                assert redis.exists(plan.key)  # the copy is in DRAM, its restore planned
                if ending == "cancelled":
                    await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="t-ends"))
                elif ending == "its next step refused by the dispatcher":
                    tool.passages = [agent_pb2.Passage(text="with " * 3_000, score=0.9, source="t:with",
                                                       title="with")]  # about 3,000 tokens: inside the window
                    tool.gate.set()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await run
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                else:
                    if ending == "refused before its next step":
                        orchestrator._deps.program.steps.observe("react_loop", "model", 10_000.0)
                        tool.gate.set()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await run
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert ("refused early" in (err.value.details() or "")) == (ending != "past its deadline")
                await _until(lambda: scheduler.tool_waits.get(waiting) is None, "the task's plan ended")
                await _until(lambda: not redis.exists(plan.key), "the DRAM copy dropped")
                assert scheduler.parking.entry(waiting) is None and scheduler.parking.kv_bytes == 0
                assert waiting not in scheduler.tool_waits._open.get("search_docs", {})
                tool.gate.set()
                await channel.close()


async def collect_events(stub, request: agent_pb2.RunTaskRequest, timeout: float) -> list[agent_pb2.TaskEvent]:
    return [e async for e in stub.RunTask(request, timeout=timeout)]


async def test_a_swap_decided_for_a_prefix_cheaper_to_recompute_than_to_copy_twice_is_made_and_restored(
        redis_db: RedisDb):
    """The tool wait's cost model prices a swap as the copy beside compute and a drop as a recompute in front
    of the turn (:func:`tool_wait.decide`), so it swaps a short prefix on an engine that prefills fast. The
    copy then went through the eviction's own rule (two transfers against one recompute), which refused it:
    the KV was dropped, while the reply said SWAP with a restore time, the swap was counted, and the next
    step recomputed the prefix. The decision is now what is done: the copy is made and the turn restores it."""
    service = DispatcherService(SwitchyardConfig().with_overrides(
        **redis_db.overrides, **{"sim.prefill_per_token_ms": 0.001, "sim.prefill_overhead_ms": 0.5}))
    async with running([service], service.config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        stub = agent_pb2_grpc.InferenceServiceStub(channel)
        tiers = service.loop.scheduler.tiers
        first = await _park(stub, "fast-prefill-agent")
        parked = service.loop.scheduler.parking.entry("fast-prefill-agent")
        assert parked is not None
        tokens, nbytes = parked.req.num_computed_tokens, parked.kv_bytes
        assert not tiers.worth_swapping(tokens, nbytes)  # a round trip costs more than one recompute here
        swaps, drops = _value(TOOL_WAIT_DECISIONS, decision="swap"), _value(TOOL_WAIT_DECISIONS, decision="drop")
        restored = _value(RESUMES, resume="restored")
        reply = await stub.ToolWait(agent_pb2.ToolWaitRequest(agent_id="fast-prefill-agent", tool="search_docs",
                                                              expected_wait_s=600.0))
        assert reply.decision == agent_pb2.SWAP and reply.restore_at_s > 0
        assert _value(TOOL_WAIT_DECISIONS, decision="swap") == swaps + 1
        assert _value(TOOL_WAIT_DECISIONS, decision="drop") == drops
        redis = redis_db.sync_client()
        await _until(lambda: redis.exists(tiers.parked_key("fast-prefill-agent")), "the copy in DRAM")
        chunks = [c async for c in stub.Generate(_resume_request("fast-prefill-agent", first))]
        await channel.close()
    assert chunks[-1].HasField("done")
    assert _value(RESUMES, resume="restored") == restored + 1  # restored from DRAM, not recomputed


async def test_a_dispatcher_restarted_during_a_tool_wait_serves_the_agents_next_step():
    """The only dispatcher stops while a react_loop task's tool runs and a new one starts on its address
    before the tool returns. The orchestrator's channel was then waiting out its reconnect backoff: the next
    step, and both of its retries, failed at once UNAVAILABLE ("Connection refused; is it running") though a
    dispatcher was serving there. A retry on the address already tried (no other replica) now waits for the
    channel to connect again, within the reconnect backoff's bound and the task's time: the step runs on the
    new dispatcher (its prefix recomputed there) and the task ends with its answer."""
    tool = _ToolThatHangs()
    base = load_config("config", service="orchestrator")
    config = SwitchyardConfig().with_overrides(**FAST)
    port = free_port()
    first = await start_server([DispatcherService(config)], "127.0.0.1", port, config.server)
    async with running([tool], base.server) as retr:
        with orchestrator_config(f"127.0.0.1:{retr.port}", f"127.0.0.1:{port}", base) as cfg:
            orchestrator = OrchestratorService(cfg)
            async with running([orchestrator], cfg.server) as orch:
                channel = open_channel(f"127.0.0.1:{orch.port}")
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                run = asyncio.create_task(collect_events(stub, agent_pb2.RunTaskRequest(
                    task_id="t-restart", agent_id="agent-restart", task_type="react_loop",
                    payload="How does the with statement work?"), 60))
                await tool.called.wait()
                await first.stop(0.5)
                to_dispatcher = orchestrator._deps.inference.channel
                while (state := to_dispatcher.get_state(try_to_connect=True)) is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                    await to_dispatcher.wait_for_state_change(state)  # it tried the closed port: backing off
                second = DispatcherService(config)
                restarted = await start_server([second], "127.0.0.1", port, config.server)
                try:
                    tool.gate.set()
                    events = await run
                finally:
                    await restarted.stop(0.5)
                await channel.close()
    assert events[-1].HasField("final")
    assert any(e.HasField("tool_result") for e in events)


@pytest.mark.parametrize("how", ["RunTask", "SubmitTask"])
async def test_an_orchestrator_stopped_during_a_tool_wait_tells_the_dispatcher_the_task_ended(how: str):
    """The orchestrator stops (SIGTERM: its server's stop) while a react_loop task waits on its tool: after the
    grace the task is cancelled, and its end is sent to the dispatcher (ToolWait with task_ended). That end was
    a hint like the others, and the stop cancelled every hint in flight as it closed the dispatcher's client:
    the dispatcher never heard it, and held the dead agent's parked KV and its tool-wait plan until the tool's
    revisit time (unless the end happened to be answered before the client closed: a dispatcher a hop away,
    answering in 0.3 s here, never got it). The stop now lets the ToolWait calls in flight finish, each within
    its hint timeout, before it closes the client."""

    class AnswersEndsSlowly(DispatcherService):
        async def ToolWait(self, request, context):
            if request.task_ended:
                await asyncio.sleep(0.3)  # within the hint timeout (5 s here), as a remote dispatcher's answer
            return await super().ToolWait(request, context)

    dispatcher = AnswersEndsSlowly(SwitchyardConfig().with_overrides(**{**FAST, "memory.dram.kv_swap": False}))
    tool = _ToolThatHangs()
    base = load_config("config", service="orchestrator")
    async with running([dispatcher], base.server) as disp, running([tool], base.server) as retr:
        with orchestrator_config(f"127.0.0.1:{retr.port}", f"127.0.0.1:{disp.port}", base,
                                 **{"orchestrator.program.tool_wait_cold_estimate_s": 600.0,
                                    "orchestrator.program.tool_wait_hint_timeout_ms": 5000,
                                    # a submitted task's grace, as the stream's below (else config's, seconds)
                                    "server.shutdown_grace_s": 0.2}) as cfg:
            orchestrator = OrchestratorService(cfg)
            orch = await start_server([orchestrator], "127.0.0.1", 0, cfg.server)
            channel = open_channel(f"127.0.0.1:{orch.port}")
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            scheduler, hints = dispatcher.loop.scheduler, _value(TOOL_WAIT_HINTS, outcome="ok")
            request = agent_pb2.RunTaskRequest(task_id="t-stop", agent_id="agent-stop", task_type="react_loop",
                                               payload="How does the with statement work?")
            run = None
            if how == "SubmitTask":
                await stub.SubmitTask(request)
            else:
                run = asyncio.create_task(collect_events(stub, request, 60))
            await tool.called.wait()
            await _until(lambda: _value(TOOL_WAIT_HINTS, outcome="ok") > hints, "the tool's announcement")
            waiting = program_key(DEFAULT_TENANT, "agent-stop", "t-stop")
            assert scheduler.tool_waits.get(waiting) is not None  # a plan for the wait, the step parked
            assert waiting in scheduler.tool_waits._open.get("search_docs", {})
            await orch.stop(0.2)  # the task is cancelled after the grace
            if run is not None:
                with pytest.raises(grpc.aio.AioRpcError):
                    await run
            await channel.close()
            assert scheduler.tool_waits.get(waiting) is None, "the dispatcher still holds the task's plan"
            assert scheduler.parking.entry(waiting) is None and scheduler.parking.kv_bytes == 0
            assert waiting not in scheduler.tool_waits._open.get("search_docs", {})
            tool.gate.set()
