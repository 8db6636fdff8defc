"""The agent-program policies on a real dispatcher: ``switchyard bench agents --policies P --stack``.

:mod:`~switchyard_harness.bench.program_policies` drives the scheduler itself on a simulated
clock. This run serves a real dispatcher instead and drives it as the orchestrator does, on
the real clock:

- the dispatcher: :class:`~switchyard.dispatcher.service.DispatcherService` in its own
  process (spawned), on a gRPC server on 127.0.0.1 (port 0): its step loop, scheduler,
  parking, memory tiers (the DRAM tier a real Redis: ``--dram``) and tool-wait decisions as
  shipped. Its engine (``--stack-engine``) is the sim's
  (:class:`~switchyard.dispatcher.engines.sim.SimEngine`: each step sleeps its modelled time)
  with the workload's reply lengths (:class:`PlannedSimEngine`), or the ``openai`` engine in
  front of a ``sim-openai`` process (its own continuous batching and prefix cache; the
  dispatcher's upstream admission). Either replies as each step's plan states (a tool call
  of the planned tokens, or the answer): the plan rides in the prompt's last line
  (:class:`~switchyard_harness.testing.step_plan.StepPlan`);
- the callers: one asyncio task per agent over one gRPC channel. Each model step is a
  ``Generate`` stream (``agent_id``, ``tenant_id``, the class, ``prompt_tokens`` of the
  conversation so far, ``resume`` after a tool); each tool call sleeps its drawn duration,
  and under ``switchyard`` the tool start is announced first (``ToolWait`` with the tool's
  expected duration, :meth:`~switchyard.orchestrator.program.ToolDurations.expected_s`) and
  every step carries the task's time left and expected remaining work, as the orchestrator's
  :class:`~switchyard.orchestrator.program.Program` sends them;
- the workload: :class:`~switchyard_harness.bench.program_policies.Workload`, the same agents,
  tools, tokens and seed as the simulated run (``--tool-time-scale`` shortens every tool
  alike, in both runs, for quick ones). Agents start tasks for ``--seconds``; the tasks under
  way then finish (up to ``--drain-limit`` windows).

The anchors' waiting orders (llm-d's per-session fairness, Autellix's program-level least
attained service, Continuum's program FCFS) are the same classes as in the simulated run,
handed to the dispatcher's scheduler (``DispatcherService(queue=...)``); their ledger is
charged, in the dispatcher's process, from each result the scheduler takes in
(``update_from_output``, where the fair policy charges its own).

The same row as the simulated run (:func:`~switchyard_harness.bench.program_policies.summarize`)
per policy: TTFT, tokens and preemptions from each step's ``GenerateDone``; the tool resumes
(warm, restored, recomputed) and recomputed tokens from the requests the sim engine served
(none for an upstream, whose KV is not seen), and HBM held idle integrating the scheduler's
parked KV bytes (sampled every :data:`SAMPLE_S`), sent back by the dispatcher's process when
the run ends. Wall-clock figures on a shared machine: compare policies of one run, not runs
of different days.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import multiprocessing.process
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import DramTierConfig, SwitchyardConfig
from switchyard.common.priority import PriorityClass
from switchyard.common.server import running
from switchyard.dispatcher.engines.base import StepBatch, StepResult
from switchyard.dispatcher.engines.sim import SimEngine, SimReply, sim_seq
from switchyard.dispatcher.request import Request, RequestOutput
from switchyard.dispatcher.scheduler.base import REACT_TASK_TYPE
from switchyard.dispatcher.scheduler.fair import charge_service
from switchyard.dispatcher.scheduler.slack import CANNOT_MEET_DEADLINE
from switchyard.dispatcher.scheduler.tool_wait import Decision
from switchyard.dispatcher.engines import make_engine
from switchyard.dispatcher.service import DispatcherService
from switchyard_harness.bench.program_policies import (
    MAX_TOKENS,
    LOST,
    POLICIES,
    UNDECIDED,
    Agent,
    PolicyResult,
    PolicyRun,
    Workload,
    anchor_queue,
    summarize,
)
from switchyard_harness import sim_openai
from switchyard_harness.bench.sched_bench import quiet_score_log
from switchyard_harness.testing.step_plan import StepPlan

STACK_CLOCK = "a real dispatcher over gRPC on the real clock (--stack)"
"""How :class:`StackPolicyRun` drives the scheduler (the table's heading)."""
PROCESS_TIMEOUT_S = 120.0
"""Longest wait for the dispatcher process's answer (its start, its figures): a bound on a stuck process."""
ENGINES = ("sim", "openai")
"""The dispatcher engines a stack run serves with (``--stack-engine``)."""
SAMPLE_S = 0.05
"""How often the run samples the scheduler's parked KV bytes (HBM held idle), seconds."""
TOOL_WAIT_TIMEOUT_S = 1.0
"""The ToolWait announcement's deadline (the orchestrator's is as short: it is fire-and-forget)."""


class PlannedSimEngine(SimEngine):
    """The sim engine (real clock: each step sleeps its modelled time) whose replies follow each step's plan.

    A request whose prompt ends with a :class:`~switchyard_harness.testing.step_plan.StepPlan` generates its
    planned tokens and ends in a tool call (``tool_calls``) or an answer (``stop``); others get the sim's
    own reply. ``served[request_id]`` is each request the engine computed (its recomputed and restored
    tokens are read at the end).
    """

    def __init__(self, config: SwitchyardConfig) -> None:
        super().__init__(config)
        self.served: dict[str, Request] = {}

    def reply_for(self, req: Request) -> SimReply:
        seq = sim_seq(req)
        if seq.reply is None and (plan := StepPlan.parse(req.prompt)) is not None:
            seq.reply = plan.reply(f"call-{req.request_id}")  # planned once, kept until it finishes (as the sim's)
        return super().reply_for(req)

    async def execute_model(self, batch: StepBatch) -> StepResult:
        for req in batch.requests:
            self.served[req.request_id] = req
        return await super().execute_model(batch)


# --------------------------------------------------------------------------- the dispatcher's process


def _dispatcher_main(policy: str, config: SwitchyardConfig, conn: Connection) -> None:
    """The dispatcher process: serve ``policy`` until told to stop, then send back what it measured."""
    with quiet_score_log():
        asyncio.run(_dispatcher(policy, config, conn))


def generated_tokens(batch: StepBatch, result: StepResult) -> int:
    """Output tokens a step engine's step (one per prefill and decode entry) or an upstream's stream item (its
    token texts; none for a tool call or the final usage) gave ``batch``'s requests."""
    tokens = len(batch.prefill)
    for req in batch.decode:
        seq = result.outputs.get(req.seq_id)
        tokens += 1 if seq is None else len(seq.texts) if seq.texts else 0 if seq.tool_calls or seq.usage else 1
    return tokens


def _task_started(req: Request) -> float:
    plan = StepPlan.parse(req.prompt)
    return plan.task_started if plan is not None else req.arrival


async def _dispatcher(policy: str, config: SwitchyardConfig, conn: Connection) -> None:
    """Messages: sends ("ready", port, scheduler class, queue class); receives ("start", load window's end,
    monotonic s); receives ("stop",); sends the figures (a dict)."""
    engine = PlannedSimEngine(config) if config.dispatcher.engine == "sim" else make_engine(config)
    queue, ledger = anchor_queue(POLICIES[policy], config, _task_started)
    service = DispatcherService(config, engine=engine, policy=POLICIES[policy].scheduler, queue=queue)
    sched = service.scheduler
    figures: dict[str, Any] = {"window_tokens": 0, "idle_byte_s": 0.0, "prefetches_started": 0,
                               "prefetches_landed": 0}
    window_end = math.inf
    update_from_output, prefetched, load_back = sched.update_from_output, sched.prefetched, sched.tiers.prefetch

    async def restore_started(req: Request) -> int:
        """The step loop's planned restore of a swapped agent's KV, counted as its copy starts."""
        figures["prefetches_started"] += 1
        return await load_back(req)

    def taken_in(batch: StepBatch, result: StepResult, now: float) -> list[RequestOutput]:
        """Each engine step's (or upstream stream item's) result, as the scheduler takes it in: tokens
        generated in the load window, and the anchor's attained service (by the fair policy's own rule)."""
        if now < window_end:
            figures["window_tokens"] += generated_tokens(batch, result)
        if ledger is not None:
            charge_service(ledger, batch, result, now)
        return update_from_output(batch, result, now)

    def restore_ended(req: Request, restored: int, now: float) -> bool:
        """The step loop's planned restore of a swapped agent's KV ended: counted, and whether it landed."""
        landed = prefetched(req, restored, now)
        figures["prefetches_landed"] += int(landed)
        return landed

    async def sample_parked() -> None:  # HBM held by agents waiting on a tool, integrated over time
        last = time.monotonic()
        while True:
            await asyncio.sleep(SAMPLE_S)
            now = time.monotonic()
            figures["idle_byte_s"] += sched.parked_kv_bytes * (now - last)
            last = now

    sched.update_from_output = taken_in  # type: ignore[method-assign]
    sched.prefetched = restore_ended  # type: ignore[method-assign]
    sched.tiers.prefetch = restore_started  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    async with running([service], config.server) as srv:
        conn.send(("ready", srv.port, type(sched).__name__, type(sched.queue).__name__))
        _, window_end = await loop.run_in_executor(None, conn.recv)
        sampler = asyncio.create_task(sample_parked())
        await loop.run_in_executor(None, conn.recv)
        sampler.cancel()
        counters = sched.counters
        served = engine.served if isinstance(engine, PlannedSimEngine) else {}
        figures.update(
            busy_s=getattr(engine, "busy_seconds", 0.0),
            served={rid: (req.recomputed_tokens, req.restored_tokens) for rid, req in served.items()},
            scheduler_decisions={d.value: int(counters.tool_wait_decisions[d.value]) for d in Decision},
            prefetch_returns=[(timing, int(n)) for (_, timing), n in counters.tool_prefetches.items()],
        )
        conn.send(figures)


def _receive(conn: Connection, proc: multiprocessing.process.BaseProcess, timeout_s: float) -> Any:
    """The dispatcher process's next message.

    Raises:
        RuntimeError: none within ``timeout_s`` (a bound on a stuck process, not a speed), or the process ended.
    """
    if not conn.poll(timeout_s):
        raise RuntimeError(f"the dispatcher process sent nothing in {timeout_s:g} s (exit code {proc.exitcode})")
    try:
        return conn.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the dispatcher process ended (exit code {proc.exitcode})") from None


# --------------------------------------------------------------------------- the callers


class StackPolicyRun(PolicyRun):
    """One policy's run of the workload on a real dispatcher process, real clock (see the module docstring).

    Args:
        policy: one of :data:`~switchyard_harness.bench.program_policies.POLICY_NAMES`.
        workload: the agents and their tasks (``seconds``: the load window, wall seconds).
        config: the dispatcher's config (``sim`` its latency model).
        dram: the DRAM tier's Redis (None: no tier; swapped state is recomputed).
        engine: ``sim`` (the dispatcher's sim engine) or ``openai`` (the dispatcher's openai engine in front
            of a ``sim-openai`` process this run starts: the upstream's own continuous batching and prefix
            cache, the dispatcher's upstream admission; prompts are text of the conversation's length).

    Raises:
        ValueError: unknown ``policy`` or ``engine``.
    """

    def __init__(self, policy: str, workload: Workload, config: SwitchyardConfig,
                 dram: DramTierConfig | None = None, engine: str = "sim") -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
        super().__init__(policy, workload, config, dram)
        self.engine = engine
        memory = self.config.memory
        tier = dram if dram is not None else memory.dram.model_copy(update={"kv_swap": False})
        # The workload's longest conversation (by default 3,000 prompt tokens, 4 calls of up to 460, a
        # 512-token answer: 5,352) may pass the sim model's 4,096: served whole, as the simulated run serves it.
        w = self.w
        longest = (w.prompt_tokens[1] + w.tool_calls[1] * (w.call_tokens[1] + w.result_tokens[1])
                   + MAX_TOKENS)  # each step asks for up to MAX_TOKENS
        windows = {**self.config.limits.context_window_tokens,
                   self.sim.model: max(longest, self.config.limits.context_window_tokens.get(self.sim.model, 0))}
        self.config = self.config.model_copy(update={
            "memory": memory.model_copy(update={"dram": tier}),
            "limits": self.config.limits.model_copy(update={"context_window_tokens": windows}),
        })
        self.t0 = 0.0
        self.steps: list[tuple[str, str]] = []
        """Each tool-return step: (its request id, its tool wait's decision, "" when none was announced)."""

    def _now(self) -> float:
        """Seconds since the run started (the workload's clock)."""
        return time.monotonic() - self.t0

    def run(self) -> PolicyResult:
        """Run the workload; returns what was measured.

        Raises:
            RuntimeError: the dispatcher process failed, or a step failed other than by an early refusal.
        """
        with contextlib.ExitStack() as stack:
            config = self.config.with_overrides(**{"dispatcher.engine": "sim"})  # whatever a --config-dir names
            if self.engine == "openai":
                upstream = sim_openai.spawn(["--model", self.sim.model])
                stack.callback(upstream.kill)
                config = config.with_overrides(**{
                    "dispatcher.engine": "openai", "upstream.base_url": upstream.base_url,
                    "upstream.default_model": self.sim.model, "upstream.fallback_model": "",
                    "upstream.api_key_required": False,
                })
            return self._run_dispatcher(config)

    def _run_dispatcher(self, config: SwitchyardConfig) -> PolicyResult:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no state of this process's loop
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_dispatcher_main, args=(self.policy, config, child), daemon=True,
                           name=f"dispatcher-{self.policy}")
        proc.start()
        child.close()
        try:
            _, port, self.result.scheduler, self.result.queue = _receive(conn, proc, PROCESS_TIMEOUT_S)
            asyncio.run(self._run(port, conn))
            figures = _receive(conn, proc, PROCESS_TIMEOUT_S)
        finally:
            proc.join(PROCESS_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
        self._take(figures)
        return self.result

    async def _run(self, port: int, conn: Connection) -> None:
        result = self.result
        result.window_s = self.w.seconds
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            self.t0 = time.monotonic()
            conn.send(("start", self.t0 + self.w.seconds))
            agents = [asyncio.create_task(self._agent(agent, stub)) for agent in self.agents]
            try:  # to the drain limit, or the first agent that failed
                _, late = await asyncio.wait(agents, timeout=self.w.seconds * self.w.drain_limit,
                                             return_when=asyncio.FIRST_EXCEPTION)
                for task in late:
                    task.cancel()
                await asyncio.gather(*agents, return_exceptions=True)
                result.makespan = self._now()
            finally:
                conn.send(("stop",))  # the dispatcher's process sends its figures and ends, whatever happened
        for task in agents:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        result.unfinished = sum(1 for a in self.agents if a.in_task)

    def _take(self, figures: dict[str, Any]) -> None:
        """What the dispatcher measured: tokens in the window, HBM held idle, engine time, the scheduler's
        counts, and how each tool-return step found its prefix (read from the request the engine served)."""
        result = self.result
        result.window_tokens = figures["window_tokens"]
        result.idle_byte_s = figures["idle_byte_s"]
        result.busy_s = figures["busy_s"]
        result.stall_s = None  # the engine's restores sleep inside its steps: not told apart here
        result.prefetches_started, result.prefetches_landed = figures["prefetches_started"], figures["prefetches_landed"]
        result.scheduler_decisions = figures["scheduler_decisions"]
        for timing, n in figures["prefetch_returns"]:
            result.prefetch_returns[timing] += n
        served: dict[str, tuple[int, int]] = figures["served"]
        result.recomputed_tokens = sum(recomputed for recomputed, _ in served.values())
        if self.engine != "sim":  # the upstream's KV is not seen: nothing parked or recomputed is measured here
            result.idle_byte_s = result.recomputed_tokens = None
        for request_id, decision in self.steps:
            self._count_resume(decision, *served.get(request_id, (0, 0)))

    async def _agent(self, agent: Agent, stub: agent_pb2_grpc.InferenceServiceStub) -> None:
        """One agent: tasks one after another while the load window is open, each to its end."""
        result = self.result
        while True:
            await asyncio.sleep(max(0.0, agent.next_at - self._now()))
            if not agent.in_task and agent.next_at >= self.w.seconds:
                return
            agent.in_task = True
            length, ending = self._next_step(agent)
            request_id = self._request_id(agent)
            sent = self._now()
            plan = StepPlan(length, ending, self.t0 + agent.task_started)
            request = agent_pb2.GenerateRequest(
                request_id=request_id, prompt=plan.prompt(self._conversation(agent)),
                prompt_tokens=agent.context,
                max_tokens=MAX_TOKENS, priority=agent.cls.proto, task_type=REACT_TASK_TYPE, agent_id=agent.name,
                resume=agent.resume, tenant_id=agent.tenant,
            )
            if (hints := self._hints(agent, sent)) is not None:
                request.task_time_left_s, request.expected_remaining_work_s = hints
            done = await self._generate(stub, request)
            now = self._now()
            if done is None:  # refused early, by name: the task ends here
                result.refused_early += 1
                self._end_task(agent, now, refused=True)
                continue
            self._settle(agent, done, request_id, sent, now)
            if done.finish_reason != "tool_calls":
                self._end_task(agent, now)
                continue
            await self._tool(agent, stub, done.usage.completion_tokens)

    def _conversation(self, agent: Agent) -> str:
        """The step's prompt text: for the sim engine a line (``prompt_tokens`` carries the length); for an
        upstream, which counts what it is sent, the conversation so far as ``agent.context`` word pieces,
        each step's text a prefix of the next's."""
        opening = f"{agent.name} task {agent.task_started:.3f}:"
        return opening if self.engine == "sim" else opening + " w" * agent.context

    async def _generate(self, stub: agent_pb2_grpc.InferenceServiceStub,
                        request: agent_pb2.GenerateRequest) -> agent_pb2.GenerateDone | None:
        """One model step's stream to its end: its GenerateDone, or None when refused early.

        Raises:
            RuntimeError: the stream failed otherwise, or ended without a done chunk.
        """
        try:
            async for chunk in stub.Generate(request):
                if chunk.WhichOneof("chunk") == "done":
                    return chunk.done
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and CANNOT_MEET_DEADLINE in (exc.details() or ""):
                return None
            raise RuntimeError(f"step {request.request_id}: {exc.code().name}: {exc.details()}") from exc
        raise RuntimeError(f"step {request.request_id}: the stream ended without its done chunk")

    def _settle(self, agent: Agent, done: agent_pb2.GenerateDone, request_id: str, sent: float, now: float) -> None:
        """What the finished step measured: TTFT, tokens; a tool-return step is kept for :meth:`_take`."""
        result = self.result
        result.ttft.append(done.ttft_s)
        if agent.cls is PriorityClass.CORE:
            result.core_ttft.append(done.ttft_s)
        result.generated += done.usage.completion_tokens
        result.preemptions += done.preemptions
        if agent.steps_done > 0 and self.engine == "sim":  # a tool-return step (an upstream's KV is unseen)
            self.steps.append((request_id, agent.decision))
            agent.decision = ""
        agent.steps_done += 1
        self.program.steps.observe(REACT_TASK_TYPE, "model", now - sent)

    async def _tool(self, agent: Agent, stub: agent_pb2_grpc.InferenceServiceStub, output_tokens: int) -> None:
        """The step ended in a tool call after ``output_tokens``: announce it (switchyard), wait the tool out,
        measure it."""
        tool, tool_s = self._tool_call(agent, output_tokens)
        announced = None
        if self.spec.hints:  # the orchestrator announces the tool wait at its start, fire-and-forget
            announced = asyncio.ensure_future(stub.ToolWait(agent_pb2.ToolWaitRequest(
                agent_id=agent.name, tool=tool, expected_wait_s=self.program.tools.expected_s(tool),
                tenant_id=agent.tenant, priority=agent.cls.proto), timeout=TOOL_WAIT_TIMEOUT_S))
        await asyncio.sleep(tool_s)
        if announced is not None:
            try:
                reply = await announced
            except grpc.aio.AioRpcError:  # as the orchestrator: a lost announcement leaves the KV parked
                self.result.decisions[LOST] += 1
            else:
                if reply.decision == agent_pb2.TOOL_WAIT_DECISION_UNSPECIFIED:
                    self.result.decisions[UNDECIDED] += 1
                else:
                    decided = Decision[agent_pb2.ToolWaitDecision.Name(reply.decision)]
                    self.result.decisions[decided.value] += 1
                    agent.decision = decided.value
        self.program.tools.observe(tool, tool_s)
        self.program.steps.observe(REACT_TASK_TYPE, "tool", tool_s)
        agent.next_at = self._now()


def run_stack_policies(policies: list[str], workload: Workload, config: SwitchyardConfig,
                       dram: DramTierConfig | None = None, engine: str = "sim",
                       progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Run ``workload`` under each policy on a real dispatcher (``engine``: :data:`ENGINES`), one after
    another; one summary row each."""
    rows = []
    for policy in policies:
        rows.append(summarize(StackPolicyRun(policy, workload, config, dram, engine).run()))
        progress(policy)
    return rows


__all__ = ["STACK_CLOCK", "PlannedSimEngine", "StackPolicyRun", "run_stack_policies"]
