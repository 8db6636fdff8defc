"""A model step that did not finish reports what it consumed, once, however it ended.

A step cut short by its caller was already answered with its done chunk as it stood (test_cancelled_usage.py). The
other ends lost it: a step the dispatcher's own deadline ended, one whose upstream failed mid-stream, one the
orchestrator's deadline timer gave up on first, all answered an error with no figures, and the task's
``compute_score_used`` and KV peak left that step out. The dispatcher's error now carries what the request used
(``StreamedError.consumed``; Generate's ``switchyard-consumed-bin`` trailer), the orchestrator counts it by the one
``on_consumed`` a cancel's answer takes, and a task that runs out of time on a hung model server names what it
waited on. A cancel the dispatcher never answers leaves the stream's map after the bounded wait; a request
cancelled during its prefill reports the KV that prefill held.

Real servers on 127.0.0.1 port 0: a dispatcher on the sim engine, or on the ``openai`` engine in front of
``switchyard serve sim-openai`` with a fault; an orchestrator with its SQLite task store; the fixed downstream of
test_orchestrator.py where a dispatcher must do what no engine does on cue.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc
import pytest
from fast_sim import FAST
from gateway_fixtures import clean_proxy_env, start_sim  # noqa: F401
from test_cancelled_usage import fake_stack
from test_orchestrator import Downstream
from test_submit_backlog import face_stack, final_state, until

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.channels import open_channel
from switchyard.common.config import load_config
from switchyard.common.generate_protocol import CONSUMED_KEY, RequestFailed
from switchyard.common.server import running
from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines.openai import upstream_words
from switchyard.dispatcher.engines.sim import SimEngine
from switchyard.dispatcher.request import Request
from switchyard.dispatcher.scheduler import make_scheduler
from switchyard.dispatcher.service import DispatcherService
from switchyard.gateway.redact import safe_url
from switchyard.orchestrator.addresses import HIDDEN
from switchyard.orchestrator import generate_stream
from switchyard.orchestrator.generate_stream import GenerateStreamClient
from switchyard.orchestrator.service import OrchestratorService
from switchyard_harness.faults import Fault
from switchyard_harness.testing.scheduling import accept

pytestmark = pytest.mark.no_gpu

SLOW = {**FAST, "sim.decode_base_ms": 500.0}  # a step every ~0.5 s: the sim's answer (a dozen tokens) outlasts a
# deadline of 3 s, which leaves a loaded machine seconds for the first tokens
PROMPT = "Explain the with statement."
MODEL = "claude-sonnet-4-5"  # what sim-openai serves a request naming none


@pytest.fixture(autouse=True)
def patient_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer to a cancel is waited for past any pause of this shared machine (behaviour, not speed)."""
    monkeypatch.setattr(generate_stream, "CANCEL_ANSWER_WAIT_S", 60.0)


@contextlib.asynccontextmanager
async def sim_dispatcher(**overrides: object) -> AsyncIterator[tuple[DispatcherService, grpc.aio.Channel]]:
    """A dispatcher on the sim engine (:data:`SLOW` and ``overrides``) and a channel to it."""
    base = load_config("config")
    dispatcher = DispatcherService(base.with_overrides(**{**SLOW, "dispatcher.engine": "sim", **overrides}))
    async with running([dispatcher], base.server) as disp:
        async with open_channel(f"127.0.0.1:{disp.port}") as channel:
            yield dispatcher, channel


@contextlib.asynccontextmanager
async def openai_dispatcher(base_url: str) -> AsyncIterator[tuple[DispatcherService, int]]:
    """A dispatcher on the openai engine in front of ``base_url`` (no retries: a fault is answered as it is), and
    its port."""
    base = load_config("config")
    cfg = base.with_overrides(**{
        "dispatcher.engine": "openai", "upstream.base_url": base_url, "upstream.api_key_required": False,
        "upstream.max_retries": 0, "upstream.fallback_model": "",
        "upstream.retry_backoff_initial_s": 0.01, "upstream.retry_backoff_max_s": 0.02})
    dispatcher = DispatcherService(cfg)
    async with running([dispatcher], cfg.server) as disp:
        yield dispatcher, disp.port


def request(request_id: str, max_tokens: int = 2000) -> agent_pb2.GenerateRequest:
    return agent_pb2.GenerateRequest(request_id=request_id, prompt=PROMPT, max_tokens=max_tokens)


# --------------------------------------------------------------------------- the dispatcher's side


async def test_a_step_its_dispatchers_deadline_ends_carries_what_it_used_with_its_error():
    """A caller that does not cancel at its deadline (a raw stream): the dispatcher's own deadline ends the request,
    and its error says what it consumed until then."""
    async with sim_dispatcher() as (_, channel):
        call = agent_pb2_grpc.InferenceServiceStub(channel).GenerateStream()
        await call.write(agent_pb2.GenerateStreamRequest(start=[
            agent_pb2.StreamedGenerate(request=request("d:0"), timeout_s=3.0)]))
        tokens, error = 0, None
        async for message in call:
            for streamed in message.chunks:
                if streamed.HasField("error"):
                    error = streamed.error
                elif streamed.chunk.HasField("token"):
                    tokens += max(1, streamed.chunk.token.count)
            if error is not None:
                break
        call.cancel()
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "passed its deadline" in error.details
    used = error.consumed
    assert error.HasField("consumed") and used.usage.completion_tokens == tokens > 0
    assert used.usage.prompt_tokens > 0 and used.usage.total_tokens == used.usage.prompt_tokens + tokens
    assert used.compute_score_used > 0 and used.memory_peak_bytes > 0 and used.finish_reason == ""
    assert used.waited_on == ""  # it was generating on the dispatcher's own engine, waiting on nothing


async def test_a_start_refused_at_once_carries_no_consumed():
    """Refused before it became a request (here: no prompt): nothing ran, nothing is reported."""
    async with sim_dispatcher() as (_, channel):
        call = agent_pb2_grpc.InferenceServiceStub(channel).GenerateStream()
        await call.write(agent_pb2.GenerateStreamRequest(start=[
            agent_pb2.StreamedGenerate(request=agent_pb2.GenerateRequest(request_id="bad:0"))]))
        message = await call.read()
        call.cancel()
    [streamed] = message.chunks
    assert streamed.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not streamed.error.HasField("consumed")


async def test_a_request_cancelled_during_its_prefill_reports_the_kv_its_prefill_held():
    """The reported case: a task cancelled while its prompt was prefilled read a compute score beside a KV peak of
    0 (the engine's count of its KV comes after the step). The prefill's allocation counts while it runs."""
    async with sim_dispatcher(**{"sim.prefill_overhead_ms": 60_000.0, "server.shutdown_grace_s": 0.5}) as (
            dispatcher, channel):
        client = GenerateStreamClient(channel)
        answers: list[agent_pb2.GenerateDone] = []

        async def generate() -> None:
            async for _ in client.generate(request("p:0"), 120, on_consumed=answers.append):
                pass

        task = asyncio.create_task(generate())
        await until(lambda: dispatcher.scheduler.num_running == 1 and dispatcher.scheduler.running[0].step_kv_bytes)
        [prefilling] = dispatcher.scheduler.running
        assert prefilling.num_computed_tokens == 0  # mid-prefill: the engine's own count has nothing yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()
    per_token = dispatcher.config.sim.kv_bytes_per_token
    [done] = answers
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 0
    assert done.memory_peak_bytes == prefilling.prompt_tokens * per_token > 0


# --------------------------------------------------------------------------- the orchestrator's stream client


async def test_a_request_past_its_deadline_on_the_stream_is_counted_once():
    """The caller's timer and the dispatcher's deadline end the request at about the same time; whichever does,
    what it used reaches ``on_consumed`` once before DEADLINE_EXCEEDED is raised."""
    async with sim_dispatcher() as (_, channel):
        client = GenerateStreamClient(channel)
        answers: list[agent_pb2.GenerateDone] = []
        tokens = 0
        with pytest.raises(RequestFailed) as failed:
            async for chunk in client.generate(request("t:0"), 3.0, on_consumed=answers.append):
                tokens += chunk.HasField("token") and max(1, chunk.token.count)
        await client.close()
    assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    [done] = answers
    assert done.usage.completion_tokens >= tokens > 0
    assert done.compute_score_used > 0 and done.memory_peak_bytes > 0


async def test_a_caller_that_stops_reading_a_running_step_counts_what_it_used():
    """A caller that leaves its loop over a running step (an exception of its own) closes the generator: the request
    was cancelled on the stream, but the answer to that cancel went unread and the step was counted nowhere. It
    reaches ``on_consumed`` as a cancelled caller's does."""
    async with sim_dispatcher() as (_, channel):
        client = GenerateStreamClient(channel)
        answers: list[agent_pb2.GenerateDone] = []
        with pytest.raises(LookupError):  # the caller's own failure, mid-answer
            async with contextlib.aclosing(client.generate(request("s:0"), 60.0,
                                                           on_consumed=answers.append)) as chunks:
                async for chunk in chunks:
                    if chunk.HasField("token"):
                        raise LookupError("the caller's own error")
        await client.close()
    [used] = answers
    assert used.finish_reason == "cancelled" and used.usage.completion_tokens > 0
    assert used.compute_score_used > 0 and used.memory_peak_bytes > 0


@contextlib.asynccontextmanager
async def ends_with(ending: str) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a dispatcher whose request ends with ``ending``: "done" (the sim engine, a short answer), or
    "failed" (an engine error after its tokens, saying what the step used: :class:`FailsAfterTokens`)."""
    if ending == "done":
        async with sim_dispatcher(**{"sim.decode_base_ms": FAST["sim.decode_base_ms"]}) as (_, channel):
            yield channel
        return
    down = FailsAfterTokens()
    down.words = ["a", "b"]
    base = load_config("config", service="orchestrator")
    async with running([down], base.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            yield channel


@pytest.mark.parametrize("ending", ["done", "failed"])
async def test_a_caller_cancelled_as_its_steps_last_item_arrives_counts_what_the_step_used(monkeypatch, ending):
    """A task's time limit that fires as its step's done (or its error, with what it used) arrives: the caller's
    wake-up was due, the cancellation is raised in its place, and the request had ended (no cancel to answer).
    That last item, never read, was counted nowhere; it reaches ``on_consumed`` now. The moment is made exact by
    cancelling the caller as the stream hands its last item over (on a shared machine it is a race)."""
    consumer: asyncio.Task[None] | None = None
    put = generate_stream._Request.put

    def put_then_cancel(self, item):  # the caller's cancellation comes as its last item does
        put(self, item)
        if isinstance(item, RequestFailed) or item.HasField("done"):
            consumer.cancel()

    monkeypatch.setattr(generate_stream._Request, "put", put_then_cancel)
    answers: list[agent_pb2.GenerateDone] = []
    read: list[agent_pb2.GenerateChunk] = []
    async with ends_with(ending) as channel:
        client = GenerateStreamClient(channel)

        async def consume() -> None:
            async for chunk in client.generate(request(f"{ending}:0", max_tokens=3), 60.0,
                                               on_consumed=answers.append):
                read.append(chunk)

        consumer = asyncio.create_task(consume())
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await client.close()
    assert not any(chunk.HasField("done") for chunk in read)  # the caller never read its end
    [used] = answers
    assert used.usage.prompt_tokens > 0 and used.compute_score_used > 0 and used.memory_peak_bytes > 0


@pytest.mark.parametrize("ending", ["done", "failed"])
async def test_a_callers_deadline_that_fires_as_its_steps_last_item_arrives_hands_over_that_item(monkeypatch, ending):
    """The caller's deadline timer fires, then the step's last item lands before the caller wakes: the request had
    ended (no cancel to send, none to answer), and the caller raised DEADLINE_EXCEEDED with that item unread, the
    step counted nowhere. The item is the caller's now: a done is read as the step's end, a failure is raised with
    what it used handed to ``on_consumed``. The moment is made exact by firing the timer's wake-up as the stream
    hands the last item over (on a shared machine it is a race)."""
    put = generate_stream._Request.put

    def expire_then_put(self, item):  # the deadline's timer fired first, in the same turn of the loop
        if (isinstance(item, RequestFailed) or item.HasField("done")) and self.waiter is not None:
            generate_stream._expire(self.waiter)
        put(self, item)

    monkeypatch.setattr(generate_stream._Request, "put", expire_then_put)
    answers: list[agent_pb2.GenerateDone] = []
    read: list[agent_pb2.GenerateChunk] = []
    async with ends_with(ending) as channel:
        client = GenerateStreamClient(channel)
        failure = contextlib.nullcontext() if ending == "done" else pytest.raises(RequestFailed)
        with failure as failed:
            async for chunk in client.generate(request(f"{ending}:0", max_tokens=3), 60.0,
                                               on_consumed=answers.append):
                read.append(chunk)
        await client.close()
    if ending == "done":
        assert read[-1].HasField("done") and answers == []  # read as its end: the caller counts it
        return
    assert failed.value.code == grpc.StatusCode.INTERNAL  # its own error, not a deadline
    [used] = answers
    assert (used.compute_score_used, used.memory_peak_bytes) == (0.75, 900)


async def test_an_upstream_cut_mid_stream_answers_what_the_step_used_and_what_it_waited_on(clean_proxy_env):
    """The openai engine's upstream cuts the stream after three tokens: over GenerateStream the error's consumed
    reaches ``on_consumed``; over Generate it comes in the switchyard-consumed-bin trailer."""
    with start_sim(faults={"*": Fault(cut_after=3, slow_ms=20)}) as server:
        async with openai_dispatcher(server.base_url) as (_, port):
            async with open_channel(f"127.0.0.1:{port}") as channel:
                client = GenerateStreamClient(channel)
                answers: list[agent_pb2.GenerateDone] = []
                tokens = 0
                with pytest.raises(RequestFailed) as failed:
                    async for chunk in client.generate(request("u:0", 64), 30, on_consumed=answers.append):
                        tokens += chunk.HasField("token") and max(1, chunk.token.count)
                await client.close()
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    async for _ in agent_pb2_grpc.InferenceServiceStub(channel).Generate(request("u:1", 64),
                                                                                       timeout=30):
                        pass
    where = f"the model server at http://127.0.0.1:{server.port} (model {MODEL}) for "
    assert failed.value.code != grpc.StatusCode.OK and failed.value.consumed is not None
    [done] = answers
    assert done == failed.value.consumed  # counted once, by the one callback
    assert done.usage.completion_tokens == tokens == 3 and done.compute_score_used > 0
    assert done.finish_reason == "" and done.waited_on.startswith(where), done.waited_on
    trailers = dict(unary.value.trailing_metadata() or ())
    trailed = agent_pb2.GenerateDone.FromString(trailers[CONSUMED_KEY])
    assert unary.value.code() == failed.value.code
    assert trailed.usage.completion_tokens == 3 and trailed.waited_on.startswith(where)


async def test_a_cancel_the_dispatcher_never_answers_leaves_the_streams_map_after_the_wait(monkeypatch):
    """The entry of a cancelled request stayed until its stream ended (a dispatcher that never answers keeps the
    stream open): it now leaves after CANCEL_ANSWER_WAIT_S, and its id stays apart while the stream takes new
    requests (the dispatcher may still run it under that id)."""
    from test_cancelled_usage import Unanswering

    monkeypatch.setattr(generate_stream, "CANCEL_ANSWER_WAIT_S", 0.05)
    down = Unanswering()
    down.words, down.token_gap_s = ["w"] * 400, 0.01
    base = load_config("config", service="orchestrator")
    async with running([down], base.server) as srv:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            client = GenerateStreamClient(channel)
            answers: list[agent_pb2.GenerateDone] = []
            first = asyncio.Event()

            async def generate(request_id: str) -> None:
                async for _ in client.generate(agent_pb2.GenerateRequest(request_id=request_id, prompt="hi"), 30,
                                               on_consumed=answers.append):
                    first.set()

            task = asyncio.create_task(generate("q:0"))
            await asyncio.wait_for(first.wait(), 30)
            stream = client._stream
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "q:0" not in stream.requests)
            assert answers == [] and stream.holds("q:0")  # unanswered; its id kept apart
            first.clear()
            again = asyncio.create_task(generate("q:0"))
            await asyncio.wait_for(first.wait(), 30)
            assert down.requests[-1].request_id == "q:0~1"  # not under the id the dispatcher may still run
            again.cancel()
            with pytest.raises(asyncio.CancelledError):
                await again
            stream.retire()
            assert not stream.holds("q:0")  # no new request comes to a retired stream: nothing kept
            await client.close()


# --------------------------------------------------------------------------- the task


class FailsAfterTokens(Downstream):
    """A dispatcher whose model step fails after its tokens (an engine's error, INTERNAL), saying what it used."""

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        for i, word in enumerate(self.words):
            yield agent_pb2.GenerateChunk(token=agent_pb2.TokenEvent(text=word, index=i))
        await context.abort(grpc.StatusCode.INTERNAL, "engine failed: RuntimeError: device lost")

    def failed_consumed(self, request, tokens):
        return agent_pb2.GenerateDone(
            usage=agent_pb2.TokenUsage(prompt_tokens=10, completion_tokens=tokens, total_tokens=10 + tokens),
            compute_score_used=0.75, memory_peak_bytes=900, model="fake")


async def test_a_task_whose_step_fails_after_it_ran_counts_what_the_step_used_once(tmp_path):
    async with fake_stack(tmp_path / "tasks.sqlite3", FailsAfterTokens()) as stub:
        await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="f1", payload="hello", task_type="chat"))
        status = await final_state(stub, "f1")
    assert status.state == agent_pb2.FAILED and status.error.startswith("INTERNAL:"), status.error
    assert (status.compute_score_used, status.memory_peak_bytes) == (0.75, 900)  # once, not twice


async def test_a_task_on_a_hung_model_server_names_it_when_its_time_runs_out(tmp_path, clean_proxy_env):
    """The model server takes the call and sends nothing more: the task's time limit ends it, and its error says
    what it waited on and how long (the server's root, its /v1 left out)."""
    with start_sim(faults={"*": Fault(slow_ms=600_000)}) as server:
        async with openai_dispatcher(server.base_url) as (_, port):
            base = load_config("config")
            limits = {"chat": 3.0, "rag_answer": 180.0, "react_loop": 600.0}
            async with face_stack(base, f"127.0.0.1:{port}", tmp_path / "tasks.sqlite3",
                                  **{"orchestrator.task_time_limit_s": limits}) as (stub, _client, _orch):
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="h1", payload="hello", task_type="chat"))
                status = await final_state(stub, "h1")
    assert status.state == agent_pb2.FAILED and status.error.startswith("DEADLINE_EXCEEDED: task 'h1' ran out of time")
    # what it waited on, its address hidden from the caller (the dispatcher's words keep it: the test below)
    assert f" waiting for the model server at {HIDDEN} (model {MODEL}) for " in status.error, status.error
    assert f"127.0.0.1:{server.port}" not in status.error, status.error
    assert status.compute_score_used > 0  # the step it was cut short in is counted too


async def test_the_dispatchers_deadline_error_names_the_model_server_it_waited_on(clean_proxy_env):
    """A caller that does not cancel at its deadline, in front of a hung server: the dispatcher's own DEADLINE_EXCEEDED
    names the server and model (the gateway's words for its call's deadline, or the scheduler's with what the request
    waited on, whichever ends it first), and its consumed says what it waited on and how long."""
    with start_sim(faults={"*": Fault(slow_ms=600_000)}) as server:
        async with openai_dispatcher(server.base_url) as (_, port):
            async with open_channel(f"127.0.0.1:{port}") as channel:
                call = agent_pb2_grpc.InferenceServiceStub(channel).GenerateStream()
                await call.write(agent_pb2.GenerateStreamRequest(start=[
                    agent_pb2.StreamedGenerate(request=request("hd:0", 64), timeout_s=2.0)]))
                error = None
                while error is None:
                    message = await call.read()
                    error = next((c.error for c in message.chunks if c.HasField("error")), None)
                call.cancel()
    where = f"waiting for the model server at http://127.0.0.1:{server.port} (model {MODEL}) for "
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert f"127.0.0.1:{server.port}" in error.details and MODEL in error.details, error.details
    assert ("waiting for " + error.consumed.waited_on).startswith(where), error.consumed.waited_on


def test_a_request_its_deadline_ends_keeps_what_it_waited_on_and_its_error_says_it():
    """The scheduler's own end of a request past its deadline (a step engine's, or an upstream engine's between the
    gateway's checks): running on an upstream call, its error and its waited_on name the server and how long since
    the call was sent or its last token came; never admitted, the queue it waited in."""
    engine = SimEngine(SwitchyardConfig())
    sched = make_scheduler(SwitchyardConfig(), engine)
    streaming = Request("up", prompt="x", prompt_tokens=10, max_tokens=50, arrival=0.0, deadline=2.0)
    accept(sched, [streaming], 0.0)
    assert sched.schedule(now=0.0).admitted == [streaming]
    streaming.upstream, streaming.upstream_sent_at = "the model server at http://10.0.0.5:8000 (model m)", 0.25
    streaming.last_token_at = 0.5  # its last token came then: the wait is since
    queued = Request("q", prompt="x", prompt_tokens=10, max_tokens=5, arrival=1.0, deadline=2.0)
    sched.add_request(queued, now=1.0)
    assert sched.expire_deadlines(now=2.0) == [queued, streaming]
    assert streaming.waited_on == "the model server at http://10.0.0.5:8000 (model m) for 1.5 s"
    assert "before its first token, waiting for the model server at http://10.0.0.5:8000 (model m) for 1.5 s;" in \
        str(streaming.error)
    assert queued.waited_on == "admission to the engine (inference queue) for 1 s"
    assert "waiting for admission;" in str(queued.error)  # said once


def test_a_request_that_never_left_the_queue_reports_its_wait_there():
    """A request past its deadline, or cancelled, before its admission waited all its life in the inference queue:
    what it consumed (its error's ``consumed``, its cancel's answer) says so in ``queue_wait_s``, which its task adds
    to its ``inference`` wait. It said 0 s (the wait was set only at admission): a task that ran out of time queued
    behind others read no inference wait at all."""
    from switchyard.dispatcher.processor import consumed
    from switchyard.dispatcher.request import RequestStatus

    engine = SimEngine(SwitchyardConfig())
    sched = make_scheduler(SwitchyardConfig(), engine)
    expired = Request("late", prompt="x", prompt_tokens=10, max_tokens=5, arrival=1.0, deadline=3.5)
    cancelled = Request("gone", prompt="x", prompt_tokens=10, max_tokens=5, arrival=1.5)
    sched.add_request(expired, now=1.0)
    sched.add_request(cancelled, now=1.5)
    sched.finish_requests([cancelled], RequestStatus.FINISHED_ABORTED, now=2.0)
    assert sched.expire_deadlines(now=4.0) == [expired]
    assert consumed(expired).queue_wait_s == 3.0 and consumed(cancelled).queue_wait_s == 0.5
    assert consumed(expired).usage.prompt_tokens == 0  # nothing ran: the wait is all it used
    admitted = Request("ran", prompt="x", prompt_tokens=10, max_tokens=5, arrival=5.0)
    accept(sched, [admitted], 5.0)
    assert sched.schedule(now=5.25).admitted == [admitted]
    sched.finish_requests([admitted], RequestStatus.FINISHED_ABORTED, now=9.0)
    assert consumed(admitted).queue_wait_s == 0.25  # until its admission, not its end


def test_the_model_server_is_named_without_credentials_query_or_fragment():
    """The config refuses credentials and a query in model_gateway.base_url; the words a message names a server by
    leave them out all the same (an endpoint's URL may come from elsewhere: DNS, an older config)."""
    assert safe_url("https://u:s3cret@h.example:8443/v1?api-key=s3cret#x") == "https://h.example:8443/v1"
    assert safe_url("http://[::1]:8000/v1") == "http://[::1]:8000/v1"
    assert upstream_words("http://tok@10.0.0.5:8000/v1", "llama") == "the model server at http://10.0.0.5:8000 (model llama)"


async def test_a_rag_task_cancelled_while_its_warm_up_prefills_reports_the_kv_it_held(tmp_path):
    """rag_answer warms its prefix (a prefill_only request) while its retrieval runs: cancelled then, the task read a
    compute score beside a KV peak of 0 (the warm-up's peak was not counted, nor waited for)."""
    from test_cancelled_usage import ToolWaits

    down = ToolWaits()  # its Retrieve waits until released
    base = load_config("config")
    sim = DispatcherService(base.with_overrides(**{**FAST, "dispatcher.engine": "sim",
                                                   "sim.prefill_overhead_ms": 60_000.0,
                                                   "server.shutdown_grace_s": 0.5}))  # its stop cuts that step
    async with running([down], base.server) as retrieval, running([sim], base.server) as disp:
        cfg = base.with_overrides(**{
            "orchestrator.retrieval_addr": f"127.0.0.1:{retrieval.port}",
            "orchestrator.dispatcher_addr": f"127.0.0.1:{disp.port}",
            "orchestrator.task_store.sqlite_path": str(tmp_path / "tasks.sqlite3"), "orchestrator.cpu_executor": "loop"})
        async with running([OrchestratorService(cfg)], cfg.server) as srv:
            async with open_channel(f"127.0.0.1:{srv.port}", cfg.server) as channel:
                stub = agent_pb2_grpc.AgentServiceStub(channel)
                await stub.SubmitTask(agent_pb2.RunTaskRequest(task_id="w1", payload="What does with do?",
                                                               task_type="rag_answer"))
                await asyncio.wait_for(down.retrieving.wait(), 30)
                await until(lambda: sim.scheduler.num_running == 1 and sim.scheduler.running[0].step_kv_bytes)
                [warming] = sim.scheduler.running
                assert warming.prefill_only and warming.num_computed_tokens == 0  # mid-prefill
                cancelled = await stub.CancelTask(agent_pb2.CancelTaskRequest(task_id="w1"))
                down.release.set()
    assert cancelled.error == "CANCELLED: cancelled by CancelTask while RUNNING"
    assert cancelled.memory_peak_bytes == warming.prompt_tokens * sim.config.sim.kv_bytes_per_token > 0
