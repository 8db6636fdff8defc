"""The orchestrator against small deterministic downstream servers (real gRPC on port 0).

The real retrieval and dispatcher are exercised in test_integration.py and
test_e2e.py; here the downstreams are fixed so each orchestrator behaviour can
be checked on its own: event order, validation, queue limits, the task table,
the react_loop tool loop and downstream failures.
"""

from __future__ import annotations

import asyncio
import re
import contextlib
import json
import logging
import math
from types import SimpleNamespace

import grpc
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import ConfigError, load_config
from switchyard.common.errors import ORIGIN_KEY
from switchyard.common.server import running
from switchyard.orchestrator import prompts, react, tokens
from switchyard.orchestrator.addresses import HIDDEN
from switchyard.orchestrator.service import OrchestratorService
from switchyard.orchestrator.tools import ToolArgumentError, calculate
from switchyard.common.channels import open_channel
from stream_adapter import GenerateStreamFromGenerate
from orchestrator_fixtures import orchestrator_config


class Downstream(GenerateStreamFromGenerate, agent_pb2_grpc.RetrievalServiceServicer,
                 agent_pb2_grpc.InferenceServiceServicer):
    """Retrieval returns one passage; Generate echoes words, or calls tools when offered (served to the
    orchestrator over GenerateStream)."""

    name = "downstream"
    grpc_service_names = ("agent.RetrievalService", "agent.InferenceService")

    def __init__(self) -> None:
        self.requests: list[agent_pb2.GenerateRequest] = []
        self.queries: list[str] = []  # every Retrieve query, in arrival order
        self.gate: asyncio.Event | None = None
        self.cancelled: list[str] = []  # request ids the orchestrator cancelled
        self.deadlines: list[float | None] = []  # time_remaining() each request had on arrival
        self.model = "sim-7b"  # what DescribeModel says the engine serves to a request naming no model
        self.described = 0
        self.prompt_token_ratios: dict[str, float] = {}  # what DescribeModel says the engine measured per model
        self.words = ["The", " answer", "."]  # the tokens of an answer
        self.token_gap_s = 0.0  # time before each token
        self.passages = [agent_pb2.Passage(text="The with statement wraps a block.", score=0.9, source="t:with",
                                           title="with")]  # what Retrieve answers, best-ranked first

    def register(self, server):
        agent_pb2_grpc.add_RetrievalServiceServicer_to_server(self, server)
        agent_pb2_grpc.add_InferenceServiceServicer_to_server(self, server)

    async def start(self):
        pass

    async def stop(self):
        pass

    async def Retrieve(self, request, context):
        self.queries.append(request.query)
        return agent_pb2.RetrieveResponse(passages=self.passages, queue_wait_s=0.001)

    async def DescribeModel(self, request, context):
        self.described += 1
        return agent_pb2.ModelInfo(model=self.model, engine="sim", prompt_token_ratios=self.prompt_token_ratios)

    async def Generate(self, request, context):
        self.requests.append(request)
        self.deadlines.append(context.time_remaining())
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise
        done_tools = {m.name for m in request.messages if m.role == "tool"}
        offered = [t.name for t in request.tools]
        if "search_docs" in offered and "search_docs" not in done_tools:
            yield agent_pb2.GenerateChunk(tool_call=agent_pb2.ToolCall(
                call_id="c1", name="search_docs", arguments_json=json.dumps({"query": "with statement"})))
        elif "calculator" in offered and "calculator" not in done_tools:
            yield agent_pb2.GenerateChunk(tool_call=agent_pb2.ToolCall(
                call_id="c2", name="calculator", arguments_json=json.dumps({"expression": "12*(3+4)"})))
        else:
            for i, word in enumerate(self.words):
                if self.token_gap_s:
                    await asyncio.sleep(self.token_gap_s)
                yield agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text=word, index=i))
        n = len(self.words)
        yield agent_pb2.GenerateChunk(done=agent_pb2.GenerateDone(
            usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=n, total_tokens=10 + n),
            queue_wait_s=0.002, compute_score_used=0.5, memory_peak_bytes=1000, model="fake"))


@contextlib.asynccontextmanager
async def stack(**overrides):
    base = load_config("config", service="orchestrator")  # its own sections only, as `switchyard serve` loads them
    down = Downstream()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base, **overrides) as cfg:
            down.orchestrator = OrchestratorService(cfg)
            async with running([down.orchestrator], cfg.server) as orch:
                channel = open_channel(f"127.0.0.1:{orch.port}")
                try:
                    yield agent_pb2_grpc.AgentServiceStub(channel), down
                finally:
                    await channel.close()


async def collect(stub, **fields):
    return [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(**fields))]


async def test_a_retrieval_that_does_not_answer_in_time_is_named_with_the_bound_it_ran_past():
    """A stalled retrieval (SIGSTOPped, or a GC pause) failed the task with retrieval's hop and gRPC's bare
    "Deadline Exceeded": the bound it ran past, orchestrator.retrieval_timeout_ms, was named nowhere."""
    class Stalled(Downstream):
        async def Retrieve(self, request, context):  # noqa: N802 - gRPC method name
            self.queries.append(request.query)
            await asyncio.sleep(5)
            return agent_pb2.RetrieveResponse()

    base = load_config("config", service="orchestrator")
    down = Stalled()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base, **{"orchestrator.retrieval_timeout_ms": 200}) as cfg:
            async with running([OrchestratorService(cfg)], cfg.server) as orch, \
                    open_channel(f"127.0.0.1:{orch.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await collect(agent_pb2_grpc.AgentServiceStub(channel),
                                  payload="How does the with statement work?", task_type="rag_answer")
        assert down.queries  # it was asked, and did not answer
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert failed.value.details().endswith(
            "): no answer within 200 ms (orchestrator.retrieval_timeout_ms)"), failed.value.details()
        # the hop named, its address hidden from the caller (orchestrator.show_addresses_to_callers)
        assert failed.value.details().startswith(f"retrieval ({HIDDEN}): "), failed.value.details()


async def test_a_payload_past_the_retrieval_query_bound_is_cut_for_the_query_not_refused():
    async with stack() as (stub, down):
        events = await collect(stub, payload="How does with work? " + "x" * 20_000, task_type="rag_answer",
                               max_tokens=4)
    assert events[-1].WhichOneof("event") == "final"
    assert [len(q) for q in down.queries] == [10_000]  # limits.max_query_chars


@pytest.mark.parametrize("executor", ["loop", "process"])
async def test_rag_answer_streams_accepted_stages_tokens_final(executor):
    # cpu_inline_max_chars 0: even this short prompt goes through the pool when the pool is tested
    async with stack(**{"orchestrator.cpu_executor": executor, "orchestrator.cpu_inline_max_chars": 0}) as (stub, down):
        events = await collect(stub, task_id="bench-001", payload="summarize this doc")
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "accepted" and kinds[-1] == "final"
    stages = [e.stage.name for e in events if e.HasField("stage")]
    assert stages == ["retrieve", "render_prompt", "infer"]
    assert "".join(e.token.text for e in events if e.HasField("token")) == "The answer."
    final = events[-1].final
    assert final.task_id == "bench-001" and final.output == "The answer."
    assert final.usage.completion_tokens == 3 and final.compute_score_used == 0.5
    assert set(final.timings.queue_wait_s) == {"orchestration", "retrieval", "inference"}
    assert 0 < final.timings.ttft_s <= final.timings.total_s
    assert final.passages[0].title == "with"
    sent = down.requests[0]
    assert "<context>" in sent.prompt and "The with statement wraps a block." in sent.prompt
    assert sent.prompt_tokens > 0 and sent.priority == agent_pb2.NORMAL


async def test_a_pool_orchestrator_loads_the_tokenizer_in_its_own_process_before_serving():
    # A step within cpu_inline_max_chars runs on the event loop whatever the executor: loading the BPE
    # ranks there at the first task blocked the loop for about half a second (HTTP submit P99 563 ms).
    tokens.encoding.cache_clear()
    async with stack(**{"orchestrator.cpu_executor": "process"}):
        assert tokens.encoding.cache_info().currsize == 1


async def test_a_batch_tasks_tokens_after_the_first_leave_merged_per_flush_interval():
    words = [f" w{i}" for i in range(30)]
    async with stack(**{"orchestrator.batch_token_flush_interval_ms": 100.0}) as (stub, down):
        down.words, down.token_gap_s = words, 0.01  # ~300 ms of tokens: ~3 intervals
        batch = await collect(stub, task_id="t-batch", task_type="chat", payload="hi", priority=agent_pb2.BATCH)
        normal = await collect(stub, task_id="t-normal", task_type="chat", payload="hi", priority=agent_pb2.NORMAL)
    for events in (batch, normal):
        tokens = [e.token for e in events if e.HasField("token")]
        assert "".join(t.text for t in tokens) == "".join(words) and sum(t.count or 1 for t in tokens) == 30
        assert (tokens[0].count or 1) == 1  # the first token is never held
        assert events[-1].HasField("final")
    assert len([e for e in batch if e.HasField("token")]) <= 10
    assert len([e for e in normal if e.HasField("token")]) >= 20  # NORMAL's leave as they come


async def test_a_batch_tasks_final_event_cuts_the_flush_interval_short():
    async with stack(**{"orchestrator.batch_token_flush_interval_ms": 10_000.0}) as (stub, down):
        down.token_gap_s = 0.01
        events = await asyncio.wait_for(  # held for the interval, it would take 10 s
            collect(stub, task_id="t-batch", task_type="chat", payload="hi", priority=agent_pb2.BATCH), 5.0)
    assert "".join(e.token.text for e in events if e.HasField("token")) == "The answer."
    assert events[-1].HasField("final")


async def test_accepted_needs_no_queue_trip_and_a_task_takes_one():
    """accepted goes out while the orchestration queue's only worker is busy; the task's CPU work
    (render and count) is then its one trip through that queue."""
    from prometheus_client import REGISTRY

    def trips() -> float:
        return REGISTRY.get_sample_value("switchyard_queue_wait_seconds_count",
                                         {"queue": "orchestration", "outcome": "admitted"}) or 0.0

    one_worker = {"queues.orchestration": {"capacity": 8, "workers": 1, "timeout_ms": 30000}}
    async with stack(**one_worker) as (stub, down):
        queue, release = down.orchestrator._deps.queue, asyncio.Event()
        blocker = queue.submit(release.wait)
        await _until(lambda: queue.busy == 1)
        before = trips()
        for task_type in ("chat", "rag_answer", "react_loop"):
            call = stub.RunTask(agent_pb2.RunTaskRequest(payload="what is 12*(3+4)?", task_type=task_type))
            first = await call.read()
            assert first.HasField("accepted") and first.accepted.queue_position == 0
            release.set()
            events = [first]
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
            assert events[-1].HasField("final")
            assert "orchestration" in events[-1].final.timings.queue_wait_s
            release.clear()
            blocker = queue.submit(release.wait)
            await _until(lambda: queue.busy == 1)
        release.set()
        await blocker.result()
    assert trips() - before == 3 + 3  # one per task, and the three blockers


async def test_user_text_is_data_not_template_code():
    async with stack() as (stub, down):
        await collect(stub, payload="{{ 7 * 7 }} {% for x in range(3) %}x{% endfor %}", task_type="chat")
    prompt = down.requests[0].prompt
    assert "{{ 7 * 7 }}" in prompt and "49" not in prompt


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"payload": "   "}, "payload"),
        ({"payload": "q", "task_type": "nope"}, "task_type"),
        ({"payload": "q", "max_tokens": -1}, "max_tokens"),
        ({"payload": "q", "priority": 9}, "priority"),
    ],
)
async def test_bad_request_names_field(fields, field):
    async with stack() as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


@pytest.mark.parametrize("task_type", ["chat", "rag_answer", "react_loop"])
async def test_a_question_over_the_context_window_is_refused_before_it_is_accepted(task_type):
    """The question alone leaves max_tokens no room: refused at the edge, naming payload, by RunTask (no event
    sent) and by SubmitTask (no task made), not accepted and failed at render_prompt after retrieval."""
    async with stack(**{"limits.context_window_tokens": {"sim-7b": 100}}) as (stub, down):
        call = stub.RunTask(agent_pb2.RunTaskRequest(payload="word " * 80, task_type=task_type, max_tokens=50))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                raise AssertionError("an event was sent: the task was accepted")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert details.startswith("payload") and "context window of sim-7b is 100 tokens" in details
        assert "max_tokens takes 50" in details
        with pytest.raises(grpc.aio.AioRpcError) as submit:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="long-1", payload="word " * 80,
                                                           task_type=task_type, max_tokens=50))
        assert submit.value.code() == grpc.StatusCode.INVALID_ARGUMENT and submit.value.details() == details
        with pytest.raises(grpc.aio.AioRpcError) as status:
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="long-1"))
        assert status.value.code() == grpc.StatusCode.NOT_FOUND
        assert down.requests == []


async def test_a_question_of_more_bytes_than_the_budget_that_fits_in_tokens_is_accepted():
    """The edge's check counts tokens once bytes alone cannot tell: 400 bytes of 'word ' are about 80 tokens."""
    async with stack(**{"limits.context_window_tokens": {"sim-7b": 300}}) as (stub, _):
        events = await collect(stub, payload="word " * 80, task_type="chat", max_tokens=8)
    assert events[-1].HasField("final")


async def test_a_prompt_over_the_window_with_its_passages_fails_at_render_naming_payload():
    """What the edge cannot know (the passages retrieved) is still checked where the prompt is rendered. The
    question fits, but with its best-ranked passage it fills the window whatever max_tokens: the refusal names
    that least prompt, and quotes the payload's own size (it quoted the passage's tokens as the payload's:
    "payload: ... (got '4188 tokens')" for a short question)."""
    question = "word " * 30
    bare = tokens.count_messages(prompts.bare("rag_answer", question).messages())
    passage = prompts.Snippet("with", "The with statement wraps a block.")  # what Downstream.Retrieve returns
    assert tokens.count_messages(prompts.render("rag_answer", question, [passage]).messages()) > bare + 1
    window = bare + 8 + 1  # the question fits beside max_tokens 8; with the passage it does not
    async with stack(**{"limits.context_window_tokens": {"sim-7b": window}}) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload=question, task_type="rag_answer", max_tokens=8)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith("payload: expected a task whose least prompt (the question with the best-ranked "
                              f"passage) fits the context window of sim-7b, {window} tokens"), details
    assert details.endswith(f"(got '{len(question)} characters')"), details


@pytest.mark.parametrize("ratio", [1.0, 1.5])
async def test_passages_that_do_not_fit_the_window_are_left_out_lowest_ranked_first(ratio):
    """In front of a server with a small window, a rag_answer whose passages do not all fit beside max_tokens
    was accepted and failed at render: the best-ranked passages that fit are sent instead (and the final event
    lists those), down to one. Where the dispatcher measured the server counting ``ratio`` tokens per token
    counted here, they are fitted to the server's count."""
    question = "word " * 30
    texts = [f"Passage {i}: " + "the with statement wraps a block " * 6 for i in range(6)]
    snippets = [prompts.Snippet(f"p{i}", t) for i, t in enumerate(texts)]
    two = tokens.count_messages(prompts.render("rag_answer", question, snippets[:2]).messages())
    three = tokens.count_messages(prompts.render("rag_answer", question, snippets[:3]).messages())
    assert three > two
    window = math.ceil(two * ratio) + 8  # two passages fit beside max_tokens 8, three do not
    assert math.ceil(three * ratio) + 8 > window
    async with stack(**{"limits.context_window_tokens": {"sim-7b": window}}) as (stub, down):
        down.prompt_token_ratios = {"sim-7b": ratio}
        down.passages = [agent_pb2.Passage(text=t, score=1.0 - i / 10, source=f"s:{i}", title=f"p{i}")
                         for i, t in enumerate(texts)]
        events = await collect(stub, payload=question, task_type="rag_answer", max_tokens=8)
    final = events[-1].final
    assert [p.title for p in final.passages] == ["p0", "p1"]
    sent = down.requests[0]
    assert "Passage 1:" in sent.prompt and "Passage 2:" not in sent.prompt
    assert math.ceil(sent.prompt_tokens * ratio) <= window - 8


async def test_a_window_too_small_for_even_the_best_passage_names_the_least_prompt_it_could_send():
    """The refusal names the size of the question with the best-ranked passage alone, not with every passage: the
    caller can pick a max_tokens that fits from it."""
    question = "word " * 30
    texts = [f"Passage {i}: " + "the with statement wraps a block " * 6 for i in range(4)]
    snippets = [prompts.Snippet(f"p{i}", t) for i, t in enumerate(texts)]
    one = tokens.count_messages(prompts.render("rag_answer", question, snippets[:1]).messages())
    bare = tokens.count_messages(prompts.bare("rag_answer", question).messages())
    window = one + 8 - 1  # one passage beside max_tokens 8 is one token too many; the question alone fits
    assert bare + 8 <= window
    async with stack(**{"limits.context_window_tokens": {"sim-7b": window}}) as (stub, down):
        down.passages = [agent_pb2.Passage(text=t, score=1.0 - i / 10, source=f"s:{i}", title=f"p{i}")
                         for i, t in enumerate(texts)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload=question, task_type="rag_answer", max_tokens=8)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    # the question fits: what does not is max_tokens beside it and the best passage, so max_tokens is named
    assert details.startswith(f"max_tokens: expected at most {window - one}: the least prompt this task can send "
                              f"(the question with the best-ranked passage) is {one} tokens"), details
    assert details.endswith("(got 8)"), details


async def test_that_refusal_of_a_default_max_tokens_says_it_was_the_default_not_a_number_sent():
    """max_tokens left 0 (the default, 128): the refusal said '(got 128)', a number the caller never sent."""
    question = "word " * 30
    texts = [f"Passage {i}: " + "the with statement wraps a block " * 6 for i in range(4)]
    one = tokens.count_messages(prompts.render("rag_answer", question, [prompts.Snippet("p0", texts[0])]).messages())
    window = one + 100  # the question fits beside the default answer (check_question_fits); with a passage it does not
    async with stack(**{"limits.context_window_tokens": {"sim-7b": window}}) as (stub, down):
        down.passages = [agent_pb2.Passage(text=t, score=1.0 - i / 10, source=f"s:{i}", title=f"p{i}")
                         for i, t in enumerate(texts)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload=question, task_type="rag_answer")
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("max_tokens: expected at most 100: the least prompt this task can send"), details
    default = load_config("config", service="orchestrator").limits.default_for(window)
    assert details.endswith(f"(got 0, which asks for the default, {default}: send a max_tokens that fits)"), details


@pytest.mark.parametrize(
    ("fields", "field", "bound"),
    [
        # the dispatcher allows 8192: the orchestrator used to accept up to 32768 and fail three stages later
        ({"max_tokens": 10000}, "max_tokens", "limits.max_tokens (8192)"),
        ({"max_tokens": 30000}, "max_tokens", "limits.max_tokens (8192)"),
        ({"max_tokens": 4096}, "max_tokens", "context window of sim-7b, 4096 tokens"),
        ({"metadata": {f"k{i}": "v" for i in range(20000)}}, "metadata", "at most 64 entries"),
        ({"metadata": {"k": "v" * 20000}}, "metadata", "at most 16384 bytes"),
        ({"agent_id": "a" * 300}, "agent_id", "at most 256 characters"),
        ({"model": "m" * 300}, "model", "at most 256 characters"),
    ],
)
async def test_limits_are_checked_before_accepted(fields, field, bound):
    async with stack() as (stub, _):
        call = stub.RunTask(agent_pb2.RunTaskRequest(payload="what is a list?", task_type="chat", **fields))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                raise AssertionError("an event was sent: the task was accepted")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field) and bound in err.value.details()


async def _refused_over_small_models_window(stub) -> None:
    """A chat task of 100 tokens is refused INVALID_ARGUMENT before any event: small-model's window is 64 tokens."""
    call = stub.RunTask(agent_pb2.RunTaskRequest(payload="what is a list?", task_type="chat", max_tokens=100))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            raise AssertionError("an event was sent: the task was accepted")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context window of small-model, 64 tokens" in err.value.details()


async def test_the_window_of_a_request_naming_no_model_is_the_dispatchers_models():
    """The orchestrator holds no dispatcher settings: the model comes from DescribeModel, asked once."""
    async with stack(**{"limits.context_window_tokens": {"big-model": 100_000, "small-model": 64}}) as (stub, down):
        down.model = "small-model"
        await _refused_over_small_models_window(stub)
        events = await collect(stub, payload="what is a list?", task_type="chat", max_tokens=8, model="big-model")
        assert events[-1].HasField("final")
        assert down.described == 1  # kept after the first answer
        with pytest.raises(ConfigError, match="not among the sections the orchestrator reads"):
            _ = load_config("config", service="orchestrator").dispatcher.engine


async def test_what_the_dispatcher_serves_is_asked_again_once_its_answer_is_old(monkeypatch):
    """A dispatcher replaced behind one address (a rolling update readiness never sees down) by a build serving
    another model is known once the answer kept is MODEL_INFO_MAX_AGE_S old: it was kept for good."""
    from switchyard.orchestrator import clients

    async with stack(**{"limits.context_window_tokens": {"big-model": 100_000, "small-model": 64}}) as (stub, down):
        down.model = "big-model"
        events = await collect(stub, payload="what is a list?", task_type="chat", max_tokens=100)
        assert events[-1].HasField("final") and down.described == 1
        down.model = "small-model"  # the build behind the address now serves a 64-token window
        monkeypatch.setattr(clients, "MODEL_INFO_MAX_AGE_S", 0.0)
        await _refused_over_small_models_window(stub)
        assert down.described == 2


async def test_two_tasks_under_one_task_id_at_once_reach_two_dispatchers_under_two_request_ids():
    """The field's ghz command runs task_id bench-001 from every worker. Over two dispatcher replicas both calls
    went out as ``bench-001:0``, one to each, and on to the model server behind them under one X-Request-Id,
    which ``transformers serve`` died of (its batching worker; every later request 503 'CB worker is dead')."""
    base = load_config("config", service="orchestrator")
    downs = [Downstream(), Downstream()]
    for down in downs:
        down.gate = asyncio.Event()  # both calls stay in flight
    async with running([downs[0]], base.server) as first, running([downs[1]], base.server) as second:
        target = f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
        with orchestrator_config(f"127.0.0.1:{first.port}", target, base) as cfg:
            async with running([OrchestratorService(cfg)], cfg.server) as orch:
                async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                    stub = agent_pb2_grpc.AgentServiceStub(channel)
                    runs = [asyncio.ensure_future(collect(stub, payload="hi", task_type="chat", task_id="bench-001"))
                            for _ in range(2)]
                    while sum(len(d.requests) for d in downs) < 2:
                        await asyncio.sleep(0.01)
                    for down in downs:
                        down.gate.set()
                    results = await asyncio.gather(*runs)
    assert all(events[-1].HasField("final") for events in results)
    assert [len(d.requests) for d in downs] == [1, 1], "the two calls went to one replica: the test shows nothing"
    ids = [d.requests[0].request_id for d in downs]
    assert sorted(ids) == ["bench-001:0", "bench-001:0~1"], ids


async def test_full_orchestration_queue_rejects_naming_queue():
    overrides = {
        "queues.orchestration": {"capacity": 1, "workers": 1, "timeout_ms": 3000},
        "orchestrator.inference_mode": "inline",
    }
    async with stack(**overrides) as (stub, down):
        down.gate = asyncio.Event()
        first = asyncio.create_task(collect(stub, payload="one", task_type="chat"))
        while not down.requests:  # the first task holds the only worker, inside Generate
            await asyncio.sleep(0.01)
        second = asyncio.create_task(collect(stub, payload="two", task_type="chat"))
        queue = down.orchestrator._deps.queue
        while not queue.depth:  # the second waits in the queue (capacity 1); a fixed 0.1 s was not always enough
            await asyncio.sleep(0.01)  # on a loaded machine for its call to arrive, and the third took the place
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload="three", task_type="chat")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "orchestration queue full" in err.value.details()
        down.gate.set()
        assert (await first)[-1].HasField("final") and (await second)[-1].HasField("final")


async def test_wait_past_timeout_gives_deadline_exceeded_naming_queue():
    overrides = {
        "queues.orchestration": {"capacity": 8, "workers": 1, "timeout_ms": 50},
        "orchestrator.inference_mode": "inline",
    }
    async with stack(**overrides) as (stub, down):
        down.gate = asyncio.Event()
        first = asyncio.create_task(collect(stub, payload="one", task_type="chat"))
        while not down.requests:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, payload="two", task_type="chat")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "orchestration queue" in err.value.details()
        down.gate.set()
        await first


async def test_submit_then_poll_status():
    async with stack() as (stub, down):
        accepted = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="async-1", payload="hello"))
        assert accepted.task_id == "async-1" and accepted.queue_position >= 0
        for _ in range(200):
            status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="async-1"))
            if status.state in (agent_pb2.SUCCEEDED, agent_pb2.FAILED):
                break
            await asyncio.sleep(0.02)
        assert status.state == agent_pb2.SUCCEEDED, status.error
        assert status.result.output == "The answer."
        assert status.compute_score_used == 0.5 and status.memory_peak_bytes == 1000
        assert status.timings.total_s > 0
        generates = len(down.requests)
        again = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="async-1", payload="hello",
                                                               priority=agent_pb2.NORMAL))
        assert again.task_id == "async-1" and len(down.requests) == generates  # the same task, not run twice
        with pytest.raises(grpc.aio.AioRpcError) as dup:
            await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="async-1", payload="again"))
        assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "task_id: 'async-1' already exists with a different request" in dup.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="nope"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in missing.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as cancel_missing:
            await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="nope"))
        assert cancel_missing.value.code() == grpc.StatusCode.NOT_FOUND
        for refused in (dup, missing, cancel_missing):  # the one error path: each names its hop
            assert (ORIGIN_KEY, "orchestrator") in tuple(refused.value.trailing_metadata())


class _GarbageUpstream(Downstream):
    """A dispatcher whose model server sent a chunk that is not JSON: INTERNAL, its origin the upstream model."""

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.abort(grpc.StatusCode.INTERNAL, "upstream sent a stream chunk that is not JSON",
                            trailing_metadata=((ORIGIN_KEY, "upstream model"),))
        yield  # an async generator


def _failure_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "switchyard.orchestrator.service" and "failed" in r.getMessage()]


async def final_status(stub, task_id: str) -> agent_pb2.TaskStatus:
    """``task_id``'s status once SUCCEEDED or FAILED, read by GetTaskStatus every 20 ms (a hang guard of 10 s)."""
    for _ in range(500):
        status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id))
        if status.state in (agent_pb2.SUCCEEDED, agent_pb2.FAILED):
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"{task_id} did not finish: {status}")


async def test_an_internal_error_of_another_hop_is_one_warning_line_not_this_services_traceback(
        monkeypatch, caplog):
    """A model server that sends garbage fails the task INTERNAL with origin `upstream model`: the orchestrator
    logs one WARNING line naming that hop, on RunTask and on a submitted task alike. It logged an ERROR with the
    traceback of its own client code on RunTask (an operator read a model server's garbage as a Switchyard
    bug), and nothing on a submitted task."""
    monkeypatch.setitem(globals(), "Downstream", _GarbageUpstream)  # what stack() serves
    caplog.set_level(logging.INFO, "switchyard")
    async with stack() as (stub, _down):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await collect(stub, payload="hello", task_type="chat", task_id="garbage-run")
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="garbage-sub", payload="hello", task_type="chat"))
        status = await final_status(stub, "garbage-sub")
    assert status.error.startswith("INTERNAL: ") and "not JSON" in status.error
    lines = _failure_lines(caplog)
    assert [(r.levelno, r.exc_info) for r in lines] == [(logging.WARNING, None)] * 2, \
        [(r.levelname, r.getMessage()) for r in lines]
    for record, task_id in zip(lines, ("garbage-run", "garbage-sub")):
        assert task_id in record.getMessage() and "upstream model" in record.getMessage()


async def test_a_fault_of_the_orchestrator_itself_is_logged_with_its_traceback_on_both_paths(monkeypatch, caplog):
    """A bug in the orchestrator's own code (an exception no hop answered) is INTERNAL and logged at ERROR with
    its traceback, for a RunTask and for a submitted task: the submitted task's was recorded in its status and
    logged nowhere."""
    async def broken(task):
        raise TypeError("a bug in a workflow")

    monkeypatch.setitem(__import__("switchyard.orchestrator.workflows", fromlist=["WORKFLOWS"]).WORKFLOWS,
                        "chat", broken)
    caplog.set_level(logging.INFO, "switchyard")
    async with stack() as (stub, _down):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await collect(stub, payload="hello", task_type="chat", task_id="bug-run")
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="bug-sub", payload="hello", task_type="chat"))
        status = await final_status(stub, "bug-sub")
    assert status.error == "INTERNAL: TypeError: a bug in a workflow"
    lines = _failure_lines(caplog)
    assert [r.levelno for r in lines] == [logging.ERROR] * 2, [(r.levelname, r.getMessage()) for r in lines]
    for record, task_id in zip(lines, ("bug-run", "bug-sub")):
        assert task_id in record.getMessage() and record.exc_info is not None
        assert isinstance(record.exc_info[1], TypeError)


async def test_a_status_asked_by_task_id_and_another_agents_id_is_not_found():
    async with stack() as (stub, _down):
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="owned-1", payload="hello", agent_id="agent-a"))
        mine = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="owned-1", agent_id="agent-a"))
        assert mine.task_id == "owned-1"
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="owned-1", agent_id="agent-b"))
        assert other.value.code() == grpc.StatusCode.NOT_FOUND
        assert other.value.details().startswith("agent_id: no task 'owned-1' of agent 'agent-b'")
        # another tenant's agent of the same id is another agent (auth off: the header names the tenant)
        with pytest.raises(grpc.aio.AioRpcError) as tenant:
            await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="owned-1", agent_id="agent-a"),
                                     metadata=(("x-tenant-id", "zeta"),))
        assert tenant.value.code() == grpc.StatusCode.NOT_FOUND
        assert tenant.value.details().startswith("agent_id: no task 'owned-1' of agent 'agent-a'")


async def test_a_task_cancelled_while_streaming_keeps_its_first_token_and_the_time_in_its_stages():
    """Seen in front of transformers serve: a task cancelled after 3 s of tokens read ttft_s 0 and had no
    inference stage in its status."""
    async with stack() as (stub, down):
        down.words, down.token_gap_s = ["w"] * 400, 0.01  # about 4 s of tokens
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="cut-1", payload="hello", task_type="chat"))
        for _ in range(200):
            if down.requests:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the inference stage runs on: at least this long by the cancel
        for _ in range(200):  # tokens are streaming (on a loaded machine the first may reach the task after 0.3 s)
            running = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="cut-1"))
            if running.timings.ttft_s > 0:
                break
            await asyncio.sleep(0.02)
        assert running.state == agent_pb2.RUNNING and running.timings.ttft_s > 0  # shown while it runs too
        await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="cut-1"))
        for _ in range(200):
            status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="cut-1"))
            if status.state == agent_pb2.FAILED:
                break
            await asyncio.sleep(0.02)
    assert status.error == "CANCELLED: cancelled by CancelTask while RUNNING"
    assert 0 < status.timings.ttft_s < status.timings.total_s
    assert status.timings.stage_s["infer"] >= 0.2, dict(status.timings.stage_s)
    assert {"submitted", "orchestration"} <= set(status.timings.queue_wait_s), dict(status.timings.queue_wait_s)


async def test_react_loop_calls_both_tools_and_streams_them():
    async with stack() as (stub, down):
        events = await collect(stub, payload="What does with do, and what is 12*(3+4)?", task_type="react_loop")
    calls = [e.tool_call.name for e in events if e.HasField("tool_call")]
    results = {e.tool_result.name: e.tool_result for e in events if e.HasField("tool_result")}
    assert calls == ["search_docs", "calculator"]
    assert "with statement" in results["search_docs"].content
    assert results["calculator"].content == "12*(3+4) = 84" and not results["calculator"].is_error
    assert [r.resume for r in down.requests] == [False, True, True]
    assistant, tool = down.requests[1].messages[-2:]
    assert assistant.role == "assistant" and [c.name for c in assistant.tool_calls] == ["search_docs"]
    assert tool.role == "tool" and tool.tool_call_id == assistant.tool_calls[0].call_id
    assert all(r.agent_id == down.requests[0].agent_id for r in down.requests)
    assert events[-1].final.output == "The answer."
    assert events[-1].final.compute_score_used == pytest.approx(1.5)
    assert [p.title for p in events[-1].final.passages] == ["with"]  # what search_docs returned


@pytest.mark.parametrize("ratio", [1.0, 1.8])
async def test_a_react_loop_whose_tool_result_fills_the_context_window_cuts_it_and_answers(ratio):
    """A search whose result (5,000 words) is longer than the model's window (sim-7b: 4096 tokens): the next step
    asked max_tokens beside a prompt past the window, and the dispatcher refused it INVALID_ARGUMENT naming
    prompt_tokens, a field the caller never chose, after the tool had run. The result is cut to leave the task's
    max_tokens, marked where it was cut, and the next step answers, offered no tools. Where the dispatcher
    measured the model server counting ``ratio`` tokens per token counted here, the cut is to the server's count."""
    async with stack() as (stub, down):
        down.prompt_token_ratios = {"sim-7b": ratio}
        down.passages = [agent_pb2.Passage(text=" ".join(["word"] * 5000), score=0.9, source="t:long", title="long")]
        events = await collect(stub, payload="What does with do, and what is 12*(3+4)?", task_type="react_loop",
                               max_tokens=300)
    assert events[-1].final.output == "The answer."
    window = 4096  # limits.context_window_tokens of sim-7b
    assert [r.max_tokens for r in down.requests] == [300, 300]
    assert all(math.ceil(r.prompt_tokens * ratio) + r.max_tokens <= window for r in down.requests), [
        (r.prompt_tokens, r.max_tokens) for r in down.requests]
    assert down.requests[1].prompt_tokens * ratio > window - 400  # cut only as far as the answer needs
    tool = next(m for m in down.requests[1].messages if m.role == "tool")
    assert re.search(r"\[\d+ tokens of this result cut: the conversation reached the model's context window\]$",
                     tool.content), tool.content[-200:]
    assert not down.requests[1].tools  # the last step: no second round of tools could fit
    full = next(e.tool_result for e in events if e.HasField("tool_result"))
    assert "tokens of this result cut" not in full.content  # the caller sees what the tool returned


async def test_dispatcher_down_is_unavailable_naming_service():
    base = load_config("config")
    async with running([OrchestratorService(base.with_overrides(**{
        "orchestrator.dispatcher_addr": "127.0.0.1:1", "orchestrator.cpu_executor": "loop",  # a pool costs seconds
    }))], base.server) as orch:
        async with open_channel(f"127.0.0.1:{orch.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(agent_pb2_grpc.AgentServiceStub(channel), payload="q", task_type="chat")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"dispatcher service unavailable at {HIDDEN}" in err.value.details()  # its address hidden from callers
    assert "127.0.0.1:1" not in err.value.details()


def test_calculator_is_safe_arithmetic():
    assert calculate("12*(3+4)") == 84 and calculate("2**10") == 1024
    for bad in ("__import__('os')", "9**99999", "1/0", "a+1", "[1]*9"):
        with pytest.raises(ToolArgumentError):
            calculate(bad)


async def test_an_arithmetic_overflow_is_the_callers_mistake_said_once_not_retried():
    """(10.0**60)**6 raised OverflowError ("Numerical result out of range"), which the tool call retried three
    times over 4 s of backoff as if it might pass; 1e400 read as inf and 1e400-1e400 answered nan. Each is an
    argument error now, said once."""
    from switchyard.common.config import ReactConfig
    from switchyard.orchestrator.tools import CALCULATOR, call_tool

    for bad in ("(10.0**60)**6", "10**60 * 10**60 / 3.0", "1e400", "1e400 - 1e400", "-1e400"):
        with pytest.raises(ToolArgumentError, match="out of range"):
            calculate(bad)
    policy = ReactConfig(tool_attempts=3, tool_backoff_initial_ms=1, tool_backoff_max_ms=2, tool_timeout_ms=500)
    outcome = await call_tool(CALCULATOR, '{"expression": "(10.0**60)**6"}', policy)
    assert outcome.is_error and outcome.attempts == 1 and "result out of range" in outcome.content
    assert calculate("1e100 / 2") == 5e99  # the bound itself is still a number


async def test_tool_call_retries_with_backoff_then_succeeds():
    from switchyard.common.config import ReactConfig
    from switchyard.orchestrator.tools import Tool, call_tool

    attempts = []

    async def flaky(args):
        attempts.append(args)
        if len(attempts) < 3:
            raise ConnectionError("upstream hiccup")
        return "ok"

    tool = Tool("flaky", "fails twice", {"type": "object"}, flaky)
    policy = ReactConfig(tool_attempts=3, tool_backoff_initial_ms=1, tool_backoff_max_ms=2, tool_timeout_ms=500)
    outcome = await call_tool(tool, '{"x": 1}', policy)
    assert (outcome.content, outcome.is_error, outcome.attempts) == ("ok", False, 3)
    assert attempts == [{"x": 1}] * 3


async def test_tool_call_times_out_per_attempt_and_reports_error():
    from switchyard.common.config import ReactConfig
    from switchyard.orchestrator.tools import Tool, call_tool

    calls = 0

    async def hangs(args):
        nonlocal calls
        calls += 1
        await asyncio.sleep(10)

    policy = ReactConfig(tool_attempts=2, tool_backoff_initial_ms=1, tool_backoff_max_ms=1, tool_timeout_ms=20)
    outcome = await call_tool(Tool("slow", "", {}, hangs), "{}", policy)
    assert outcome.is_error and "timed out after 20 ms" in outcome.content
    assert calls == 2 and outcome.attempts == 2


async def test_a_task_cancelled_while_its_tool_runs_stops_at_once_and_the_tool_is_not_called_again():
    """CancelTask, or a caller gone, during a tool call: the cancellation is not a tool failure to retry
    (tenacity's retry_if_not_exception_type retried CancelledError, and the task ran to its end)."""
    from switchyard.common.config import ReactConfig
    from switchyard.orchestrator.tools import Tool, call_tool

    calls = 0
    started = asyncio.Event()

    async def slow(args):
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.sleep(10)

    policy = ReactConfig(tool_attempts=3, tool_backoff_initial_ms=1, tool_backoff_max_ms=1, tool_timeout_ms=5000)
    running = asyncio.create_task(call_tool(Tool("slow", "", {}, slow), "{}", policy))
    await started.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running, 2)
    assert calls == 1


@pytest.mark.parametrize("code, tried", [(grpc.StatusCode.INVALID_ARGUMENT, 1), (grpc.StatusCode.NOT_FOUND, 1),
                                         (grpc.StatusCode.UNAVAILABLE, 3), (grpc.StatusCode.RESOURCE_EXHAUSTED, 3)])
async def test_a_downstream_refusal_the_same_call_gets_again_is_not_retried(code, tried):
    """search_docs retried retrieval's "query: expected at most 10000 characters" three times."""
    from switchyard.common.config import ReactConfig
    from switchyard.common.errors import SwitchyardError
    from switchyard.orchestrator.tools import Tool, call_tool

    calls = 0

    async def refuses(args):
        nonlocal calls
        calls += 1
        raise SwitchyardError("retrieval: no", code)

    policy = ReactConfig(tool_attempts=3, tool_backoff_initial_ms=1, tool_backoff_max_ms=1, tool_timeout_ms=500)
    outcome = await call_tool(Tool("refuses", "", {}, refuses), "{}", policy)
    assert outcome.is_error and calls == outcome.attempts == tried


async def test_the_search_tools_query_is_cut_to_the_retrieval_bound_as_rag_answers_is():
    """The react_loop's search_docs sent the model's query uncut: retrieval refused it past 10,000 characters."""
    from switchyard.orchestrator.tools import call_tool

    async with stack() as (stub, down):
        task = SimpleNamespace(spec=SimpleNamespace(workflow="react_loop"), deps=down.orchestrator._deps,
                               passages=[], add_wait=lambda *_: None)
        search = next(t for t in react.tools_for(task) if t.name == "search_docs")
        policy = down.orchestrator.config.orchestrator.react
        outcome = await call_tool(search, json.dumps({"query": "x" * 12_500}), policy)
    assert not outcome.is_error and [len(q) for q in down.queries] == [10_000], outcome


async def test_bad_tool_arguments_are_not_retried():
    from switchyard.common.config import ReactConfig
    from switchyard.orchestrator.tools import CALCULATOR, call_tool

    policy = ReactConfig(tool_attempts=5, tool_backoff_initial_ms=1, tool_timeout_ms=100)
    outcome = await call_tool(CALCULATOR, '{"expression": "import os"}', policy)
    assert outcome.is_error and outcome.attempts == 1 and "expression" in outcome.content
    outcome = await call_tool(CALCULATOR, "not json", policy)
    assert outcome.is_error and "expected a JSON object" in outcome.content


# --------------------------------------------------------------------------- task lifetime

LIMITS = {"chat": 0.5, "rag_answer": 180.0, "react_loop": 600.0}


def _count(metric, **labels) -> float:
    return metric.labels(**labels)._value.get()


async def _until(condition, seconds: float = 30.0) -> None:
    """Poll ``condition`` (behaviour, not speed: the bound is far past the time it should take)."""
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_a_dropped_call_ends_at_the_task_time_limit_and_releases_everything():
    """A client that drops its RunTask without cancelling (grpcio does not cancel a collected aio call)
    no longer holds a slot until generation ends: the task's time limit ends it and its downstream call."""
    import gc

    from switchyard.orchestrator.metrics import AGENTS_CONCURRENT, TASKS

    async with stack(**{"orchestrator.task_time_limit_s": LIMITS}) as (stub, down):
        down.gate = asyncio.Event()  # generation never ends on its own
        before = _count(TASKS, task_type="chat", code="DEADLINE_EXCEEDED")
        concurrent = AGENTS_CONCURRENT._value.get()
        call = stub.RunTask(agent_pb2.RunTaskRequest(task_id="dropped", payload="hi", task_type="chat"))
        assert (await call.read()).HasField("accepted")
        await _until(lambda: down.requests)
        del call
        gc.collect()
        await _until(lambda: down.cancelled)
        await _until(lambda: _count(TASKS, task_type="chat", code="DEADLINE_EXCEEDED") == before + 1)
        assert AGENTS_CONCURRENT._value.get() == concurrent
        assert down.cancelled == ["dropped:0"]
        # the task's deadline reached the dispatcher call (grpc-timeout's encoding rounds up a little)
        assert 0 < down.deadlines[0] <= LIMITS["chat"] + 0.1


async def test_a_runtask_whose_callers_deadline_passed_is_counted_deadline_exceeded_not_cancelled():
    """The caller's gRPC deadline is the task's deadline: grpc cancels the handler as it passes, and the task is
    counted as the caller saw it end (DEADLINE_EXCEEDED), not as a caller that left (CANCELLED)."""
    from switchyard.orchestrator.metrics import TASKS

    async with stack() as (stub, down):
        down.gate = asyncio.Event()  # generation never ends on its own
        before = {code: _count(TASKS, task_type="chat", code=code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"), timeout=0.5):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _until(lambda: _count(TASKS, task_type="chat", code="DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1)
        assert _count(TASKS, task_type="chat", code="CANCELLED") == before["CANCELLED"]
        down.gate.set()


async def test_a_downstream_deadline_that_fires_with_the_tasks_own_is_the_task_running_out_of_time():
    """The dispatcher call's gRPC deadline is the task's time left: when it fires a moment before the task's own
    timer, the answer names the task and its limit, not the hop's bare "Deadline Exceeded"."""
    async with stack(**{"orchestrator.task_time_limit_s": LIMITS}) as (stub, down):
        async def generate_until_the_deadline(request, context):
            down.requests.append(request)
            await asyncio.sleep(max(0.0, context.time_remaining() - 0.02))
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            yield  # pragma: no cover - an async generator, as Generate is

        down.Generate = generate_until_the_deadline
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, task_id="raced", payload="hi", task_type="chat")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "task 'raced' ran out of time" in err.value.details(), err.value.details()


async def test_task_past_its_time_limit_ends_deadline_exceeded_naming_the_limit():
    async with stack(**{"orchestrator.task_time_limit_s": LIMITS}) as (stub, down):
        down.gate = asyncio.Event()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            # an id that reads as a host and port: RunTask's error quotes it back whole (it read '[address hidden]')
            await collect(stub, task_id="run.2024:0001", payload="hi", task_type="chat")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "task 'run.2024:0001' ran out of time" in err.value.details(), err.value.details()
        assert "orchestrator.task_time_limit_s.chat = 0.5" in err.value.details()
        accepted = await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="bg", payload="hi", task_type="chat"))
        assert accepted.task_id == "bg"
        status = None
        for _ in range(500):
            status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="bg"))
            if status.state == agent_pb2.FAILED:
                break
            await asyncio.sleep(0.02)
        assert status.state == agent_pb2.FAILED and "DEADLINE_EXCEEDED" in status.error
        assert down.cancelled == ["run.2024:0001:0", "bg:0"]


async def test_the_callers_earlier_deadline_bounds_every_downstream_call():
    async with stack() as (stub, down):
        events = [e async for e in stub.RunTask(agent_pb2.RunTaskRequest(payload="hi", task_type="chat"), timeout=20)]
    assert events[-1].HasField("final")
    # not the 120 s chat limit: the caller's 20 s (gRPC's grpc-timeout header rounds up a little)
    assert 0 < down.deadlines[0] <= 21


def test_time_limits_name_every_task_type():
    from switchyard.common.config import ConfigError

    base = load_config("config")
    with pytest.raises(ConfigError, match="no time limit for task type"):
        base.with_overrides(**{"orchestrator.task_time_limit_s": {"chat": 5}})
    with pytest.raises(ConfigError, match="unknown task type"):
        base.with_overrides(**{"orchestrator.task_time_limit_s": {**LIMITS, "summarise": 5}})
    with pytest.raises(ConfigError, match=r"\(0, 86400\]"):
        base.with_overrides(**{"orchestrator.task_time_limit_s": {**LIMITS, "chat": 0}})


async def test_cpu_work_on_short_text_runs_on_the_loop_and_long_text_in_the_pool():
    import os
    from concurrent.futures import ProcessPoolExecutor

    from switchyard.common.config import SwitchyardConfig
    from switchyard.common.queues import WorkQueue
    from switchyard.orchestrator.task import Deps, Task
    from switchyard.orchestrator.validation import TaskSpec

    config = SwitchyardConfig().with_overrides(**{"orchestrator.cpu_inline_max_chars": 1000})
    queue = WorkQueue("orchestration", config.queues.orchestration)
    queue.start()
    pool = ProcessPoolExecutor(1)
    try:
        deps = Deps(config=config, queue=queue, executor=pool, retrieval=None, inference=None)  # type: ignore[arg-type]
        spec = TaskSpec(task_id="t", payload="hi", workflow="chat", priority=0, max_tokens=8, model="", agent_id="")
        task = Task(spec, deps, emit=lambda _: None, deadline_s=float("inf"), deadline_source="test")
        assert await task.cpu(os.getpid, size_chars=1000) == os.getpid()  # at the bound: the loop
        assert await task.cpu(os.getpid, size_chars=1001) != os.getpid()  # past it: a pool process
        assert await task.cpu(os.getpid) != os.getpid()  # size unknown: the executor
    finally:
        pool.shutdown()
        await queue.stop()


async def test_a_dead_cpu_worker_gets_the_pool_replaced_and_the_job_run_on_the_new_one():
    """A process pool refuses every job once one of its workers has died (BrokenProcessPool); the orchestrator
    builds a fresh pool, runs the job there, and counts the restart, instead of failing every large task."""
    import os
    import signal
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from switchyard.common.config import SwitchyardConfig
    from switchyard.common.queues import WorkQueue
    from switchyard.orchestrator.metrics import CPU_POOL_RESTARTS
    from switchyard.orchestrator.task import Deps, Task
    from switchyard.orchestrator.validation import TaskSpec

    config = SwitchyardConfig()
    queue = WorkQueue("orchestration", config.queues.orchestration)
    queue.start()
    pools = [ProcessPoolExecutor(1)]

    async def fresh() -> ProcessPoolExecutor:
        pools.append(ProcessPoolExecutor(1))
        return pools[-1]

    try:
        deps = Deps(config=config, queue=queue, executor=pools[0], retrieval=None,  # type: ignore[arg-type]
                    inference=None, new_executor=fresh)  # type: ignore[arg-type]
        spec = TaskSpec(task_id="t", payload="hi", workflow="chat", priority=0, max_tokens=8, model="", agent_id="")
        task = Task(spec, deps, emit=lambda _: None, deadline_s=float("inf"), deadline_source="test")
        first = await task.cpu(os.getpid)
        os.kill(first, signal.SIGKILL)  # the worker dies (the OOM killer, a stray kill)
        restarts = CPU_POOL_RESTARTS._value.get()
        second = await task.cpu(os.getpid)
        assert second not in (first, os.getpid()) and deps.executor is pools[1]
        assert CPU_POOL_RESTARTS._value.get() == restarts + 1
        assert await task.cpu(os.getpid) == second  # the fresh pool serves on
        deps.new_executor = None
        os.kill(second, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):  # nothing to build a new one with: the error, by name
            await task.cpu(os.getpid)
    finally:
        for pool in pools:
            pool.shutdown()
        await queue.stop()


async def test_a_task_is_refused_at_once_only_for_a_service_it_cannot_run_without():
    """With retrieval down, react_loop (which reads a search tool's failure as its observation) and chat run;
    rag_answer is refused at once, naming retrieval."""
    import socket

    base = load_config("config", service="orchestrator")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    down = Downstream()
    async with running([down], base.server) as downstream:
        with orchestrator_config(dead, f"127.0.0.1:{downstream.port}", base) as cfg:
            down.orchestrator = OrchestratorService(cfg)
            async with running([down.orchestrator], cfg.server) as orch:
                async with open_channel(f"127.0.0.1:{orch.port}") as channel:
                    stub = agent_pb2_grpc.AgentServiceStub(channel)
                    for task_type in ("chat", "react_loop"):
                        events = await collect(stub, payload="what is 2+2", task_type=task_type, max_tokens=16)
                        assert events[-1].HasField("final"), task_type
                    # react_loop's search tool failed, its error result naming retrieval, its address hidden
                    failed = [e.tool_result.content for e in events if e.HasField("tool_result")
                              and e.tool_result.is_error]
                    assert failed and all(f"retrieval service unavailable at {HIDDEN}" in text and dead not in text
                                          for text in failed), failed
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await collect(stub, payload="what is 2+2", task_type="rag_answer", max_tokens=16)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert (refused.value.details() or "").startswith(f"retrieval service unavailable at {HIDDEN}")
                    assert dead not in (refused.value.details() or "")


async def test_a_running_submitted_task_s_status_shows_the_timings_its_task_has_so_far():
    """The status of a RUNNING submitted task is the task's own timings: the waits and stages so far. It was a
    second Timings, fed from the task's stage events: the orchestration and retrieval waits were missing until
    the task ended, and a stage run twice (react_loop's 'infer', once per step) showed its last run, not the sum."""
    async with stack() as (stub, down):
        down.gate = asyncio.Event()  # generation never ends on its own
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="live-1", payload="hello", task_type="rag_answer"))
        await _until(lambda: down.requests)
        running = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id="live-1"))
        down.gate.set()
    assert running.state == agent_pb2.RUNNING
    assert {"submitted", "orchestration", "retrieval"} <= set(running.timings.queue_wait_s), \
        dict(running.timings.queue_wait_s)
    assert {"retrieve", "render_prompt"} <= set(running.timings.stage_s), dict(running.timings.stage_s)


async def test_a_run_tasks_timings_count_from_its_arrival_its_validation_included():
    """A RunTask's ttft_s and total_s counted from after its validation, which may ask the dispatcher what it
    serves (DescribeModel: the first task's, one every MODEL_INFO_MAX_AGE_S) and count a long question's tokens:
    that time was its caller's wait but in neither (the dispatcher counts its own validation in its TTFT)."""
    class SlowToDescribe(Downstream):
        async def DescribeModel(self, request, context):  # noqa: N802 - gRPC method name
            await asyncio.sleep(0.3)
            return await super().DescribeModel(request, context)

    base = load_config("config", service="orchestrator")
    down = SlowToDescribe()
    async with running([down], base.server) as downstream:
        addr = f"127.0.0.1:{downstream.port}"
        with orchestrator_config(addr, addr, base) as cfg:
            async with running([OrchestratorService(cfg)], cfg.server) as orch:
                channel = open_channel(f"127.0.0.1:{orch.port}")
                try:
                    stub = agent_pb2_grpc.AgentServiceStub(channel)
                    events = await collect(stub, payload="what is a list?", task_type="chat")
                finally:
                    await channel.close()
    final = events[-1].final
    assert down.described == 1 and 0.3 <= final.timings.ttft_s <= final.timings.total_s, final.timings
