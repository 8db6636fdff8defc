"""The state of one generation request inside the dispatcher, and what the scheduler decides each step.

A :class:`Request` is built by the request processor when a GenerateStream start (or a Generate call,
a stream of one) arrives (:func:`~switchyard.dispatcher.processor.to_request`), handed to
the scheduler (its double buffer, then its waiting set), admitted (and maybe
preempted and resumed) by the scheduling policy, and stepped by the engine.
The engine reads it and returns what a step produced
(:class:`~switchyard.dispatcher.engines.base.StepResult`); the scheduler alone
writes that into the request (``update_from_output``: tokens, computed prefix,
the one stop check, its :class:`RequestStatus`) and hands back a
:class:`RequestOutput` per request; the engine loop pushes those to the
request's :class:`~switchyard.dispatcher.output.OutputStream` (``request.output``),
which the session that carries the request
(:class:`~switchyard.dispatcher.generate_stream.GenerateSession`) sends to its caller.

Token bookkeeping follows vLLM's ``num_computed_tokens`` convention: the
prefix whose KV state is held by the engine. After any step it equals
``prompt_tokens + len(output_tokens) - 1`` (the newest token's KV is computed by
the next step). Preemption drops the KV state (``num_computed_tokens = 0``):
either a copy waits in the DRAM tier (``swap_key``) and comes back before the
next step (counted in ``restored_tokens``), or the next prefill recomputes the
whole prefix, prompt and already streamed tokens alike, and counts that work
in ``recomputed_tokens``. The streamed tokens are kept, so a resumed request
never repeats or loses a token.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from switchyard.api import agent_pb2
from switchyard.common.config.limits import RequestLimitsConfig
from switchyard.common.priority import PriorityClass
from switchyard.common.tenant import DEFAULT_TENANT, agent_key, program_key
from switchyard.dispatcher.output import OutputStream

class RequestStatus(enum.IntEnum):
    """Where a request is in the dispatcher; every value from ``PARKED`` on is finished (after vLLM's
    ``vllm/v1/request.py`` ``RequestStatus``: ordered, ``is_finished`` a comparison).

    Written by the scheduler only. ``BUFFERED``: in the double buffer; ``WAITING``: in the waiting
    queue (never admitted, or preempted); ``RUNNING``: in the running set; ``PREEMPTING``: preempted
    while a step it belongs to is in flight (its KV leaves when that step ends); ``PARKED``: a
    react_loop agent's step that ended in tool calls, its prefix KV kept warm (finished for its caller,
    reason ``tool_calls``). The ``FINISHED_*`` values name the finish reason (:data:`FINISH_REASONS`);
    ``FINISHED_ERROR`` ended with ``Request.error`` (no finish reason).
    """

    NEW = 0
    BUFFERED = 1
    WAITING = 2
    RUNNING = 3
    PREEMPTING = 4
    PARKED = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH_CAPPED = 7
    FINISHED_TOOL_CALLS = 8
    FINISHED_ABORTED = 9
    FINISHED_ERROR = 10
    FINISHED_CONTENT_FILTERED = 11

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.PARKED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        """The finish reason of a finished status (None: unfinished, or ended with an error)."""
        return _FINISH_REASON.get(status)

    @staticmethod
    def finished_with(reason: str) -> "RequestStatus":
        """The finished status of an engine-reported finish reason: one of OpenAI's stop, length, tool_calls
        or content_filter. An upstream's own word reaches here already read as one of these by the one table of
        them (:data:`switchyard.gateway.decode.FINISH_REASONS`: TGI's eos_token is stop, OpenAI's former
        function_call is tool_calls; vLLM's abort, error and repetition, and a word not known, fail the call
        there).

        Raises:
            ValueError: ``reason`` is none of the four (an engine's defect: reading it as stop would hide it).
        """
        try:
            return _STATUS_OF_REASON[reason]
        except KeyError:
            raise ValueError(f"finish_reason: expected one of {sorted(_STATUS_OF_REASON)} (got {reason!r}); an "
                             "upstream's own words are read by switchyard.gateway.decode.FINISH_REASONS") from None


_FINISH_REASON = {
    RequestStatus.PARKED: "tool_calls",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_TOOL_CALLS: "tool_calls",
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_CONTENT_FILTERED: "content_filter",
}

_STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "tool_calls": RequestStatus.FINISHED_TOOL_CALLS,
    # OpenAI's and Azure OpenAI's: the server's content filter withheld the rest of the answer
    "content_filter": RequestStatus.FINISHED_CONTENT_FILTERED,
}

FINISH_REASONS: tuple[str, ...] = tuple(sorted(set(_FINISH_REASON.values())))
"""finish_reason values: OpenAI's stop/length/tool_calls/content_filter, plus cancelled by the caller; read off the
one table of them (the finished statuses'), not listed beside it."""

_SEQ_IDS = itertools.count(1)

_WORD_PIECE = re.compile(r"\s*\S+|\s+$")


def word_pieces(text: str) -> list[str]:
    """Split ``text`` into word-ish tokens, each keeping its leading whitespace.

    ``"".join(word_pieces(t)) == t``. The sim engine and the dispatcher's own
    prompt count (when the caller sent ``prompt_tokens = 0``) use it as their
    tokenizer. For English text it yields about 0.75 pieces per BPE token
    (OpenAI's rule of thumb: one token is about 0.75 of a word).
    """
    return _WORD_PIECE.findall(text)


@dataclass(frozen=True)
class Message:
    """A chat message: role is system, user, assistant or tool."""

    role: str
    content: str
    tool_call_id: str = ""
    name: str = ""
    tool_calls: tuple["ToolCall", ...] = ()
    """Assistant messages: the tool calls the model made in that turn."""


@dataclass(frozen=True)
class Tool:
    """A tool offered to the model (OpenAI function-calling shape)."""

    name: str
    description: str = ""
    parameters_json: str = "{}"


@dataclass(frozen=True)
class ToolCall:
    """A tool call emitted by the model: ``arguments_json`` is a JSON object string."""

    call_id: str
    name: str
    arguments_json: str


@dataclass(eq=False)
class Request:
    """One Generate request: its input, scheduling state, generated output and accounting.

    It carries its :class:`~switchyard.dispatcher.output.OutputStream` (``output``),
    written only by the engine loop (step or stream) from the scheduler's :class:`RequestOutput`s,
    so what the caller receives always agrees with the request's state. One request
    never reaches the loop: a ``prefill_only`` one on an engine that shares no
    prefixes is answered done at once by the processor (``open_request``), which
    sets its status first (nothing it could run is worth a place in the queue).
    Its accounting (compute score used, KV peak, tokens) is recorded here by the scheduler, not in side tables;
    attained service has one owner, the fair policy's ledger
    (:class:`~switchyard.dispatcher.scheduler.fairness.FairnessLedger`, per tenant and agent session).
    Identity is the object (``eq=False``), so requests can sit in sets and dicts.
    Times are ``time.monotonic()`` seconds; ``None`` until the event happens.
    """

    request_id: str
    """The caller's id (orchestrator: ``task_id:step``); not unique: a caller may reuse it."""
    prompt: str = ""
    messages: list[Message] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_tokens_sent: bool = False
    """Whether ``prompt_tokens`` is the caller's count (the orchestrator's cl100k count), not the processor's:
    an upstream engine learns the server's tokens per counted token only from those
    (:class:`~switchyard.dispatcher.engines.token_ratio.PromptTokenRatios`)."""
    prompt_token_ratio: float = 0.0
    """The model server's prompt tokens per counted one for :attr:`model` after this call, as the engine
    measures it (``GenerateDone.prompt_token_ratio``); 0: none measured."""
    max_tokens: int = RequestLimitsConfig.model_fields["default_max_tokens"].default
    """Completion tokens it may produce (the processor passes the Generate's, or ``limits.default_for(window)``:
    ``default_max_tokens``, at most half the model's context window); left out (a bench, a test), that setting's
    class default, not the configured value."""
    model: str = ""
    """The client-facing model it is served: the Generate's, or the engine's when it names none (resolved
    once, by ``processor.to_request``); an upstream engine's gateway maps it to an upstream id."""
    names_model: bool = False
    """The Generate named its model. False: it named none and is served the engine's, which an upstream
    engine's gateway may serve from ``model_gateway.fallback_model`` (a model the caller named is not replaced
    by another)."""
    answered_by: str = ""
    """The upstream model id that answered (its Usage's ``model``: the fallback, where one served); "" until
    then, and on step engines. The done chunk names it, else :attr:`model`."""
    agent_id: str = ""
    task_id: str = ""
    """The task this request is a step of (``GenerateRequest.task_id``; "" when not given): with the agent, its
    :attr:`program_key`."""
    task_type: str = ""
    priority: PriorityClass = PriorityClass.NORMAL
    """The request's priority class, the one type (:meth:`PriorityClass.from_proto` converts the proto's
    ``agent.Priority``; its numbers differ from the class's ranks, so a number is refused here)."""
    resume: bool = False
    """Set by a react_loop agent coming back from a tool call (warm prefix state)."""
    # --- the task's program, as its orchestrator sees it (GenerateRequest fields 12-15 and 17-19)
    tenant_id: str = DEFAULT_TENANT
    task_time_left_s: float | None = None
    """Seconds its task had left when the request was sent; None: not given."""
    expected_remaining_work_s: float = 0.0
    """Its task's expected work after this request, seconds (slack = time left - own time - this)."""
    prefill_only: bool = False
    """Compute the prompt's prefix state only: no tokens are wanted."""
    no_early_refusal: bool = False
    """Never refused on an estimate of its task's work (its orchestrator's ``orchestrator.program.refuse_early``
    is off): the fair policy orders it by slack and serves it when that is negative."""
    early_refusal_margin_s: float = 0.0
    """Shortfall of slack tolerated before it is refused as unable to make its deadline, seconds (its
    orchestrator's ``orchestrator.program.refuse_early_margin_s``)."""
    deadline_source: str = ""
    """What set its task's deadline (``GenerateRequest.deadline_source``: ``orchestrator.task_time_limit_s.<type>
    = 600`` or the caller's gRPC deadline), named by the upstream's refusals that cite it; "" when not given."""

    arrival: float = field(default_factory=time.monotonic)
    """When its start arrived (the GenerateStream message carrying it, or the Generate call), stamped by its session
    before it is validated (``RequestProcessor.open_request``): its queue wait, TTFT and deadline count from it, and
    the fair policy's time left; when it was built where nothing stamps it (benches, tests)."""
    deadline: float | None = None
    """When the request must have ended (monotonic seconds; None: no deadline): :attr:`arrival` plus the Generate
    call's time left, or a GenerateStream start's ``timeout_s`` (set by ``RequestProcessor.open_request``); an
    upstream engine's call must end by then, and the scheduler fails the request past it (``expire_deadlines``)."""

    # --- generated output
    output_tokens: list[str] = field(default_factory=list)
    """Every generated token text, streamed or not (tool-call arguments are not streamed as text)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: BaseException | None = field(default=None, repr=False)
    """Why it ended with ``FINISHED_ERROR`` (its session sends it to the caller as the request's error)."""

    # --- engine / scheduler state
    status: RequestStatus = RequestStatus.NEW
    """Where the scheduler holds it (:class:`RequestStatus`); written by the scheduler only, but for a
    ``prefill_only`` request the processor finishes at once, which never reaches the scheduler (and the engine
    tests' and bench's :class:`~switchyard.dispatcher.engines.driver.EngineDriver`, which stands in for it)."""
    kv_reserved_bytes: int = 0
    """KV bytes reserved in the HBM budget while it runs (0 when not running)."""
    batch: "FlushedBatch | None" = field(default=None, repr=False)
    """The flush that brought it to the scheduler, until it ends (its batch's service time)."""
    kv_leaving_bytes: int = 0
    """``PREEMPTING``: its live KV bytes, held in the HBM budget until the step in flight ends."""
    num_computed_tokens: int = 0
    step_kv_bytes: int = 0
    """KV bytes the prefill step in flight allocated for it (its computed prefix and the prompt tokens that step
    computes), from the step's composition until its result (``SchedulerCore.compose_batch``); 0 between steps and in
    decode steps (one token more, within the engine's own count). A prefill's prompt is held while it is computed: a
    request cancelled mid-prefill held it (its ``memory_peak_bytes``)."""
    preemptions: int = 0
    recomputed_tokens: int = 0
    restored_tokens: int = 0
    """Prefix tokens whose KV state came back from a lower memory tier instead of being recomputed."""
    swap_key: str = ""
    """Key of its KV state's copy in the DRAM tier (swapped out at preemption, or its agent's parked
    prefix to resume from); "" when none. The scheduler restores it at admission."""
    swap_tokens: int = 0
    """Prefix tokens that copy covers."""
    kv_hits: int = 0
    """Times its KV state was reused from a tier (the value score's frequency)."""
    oom_retries: int = 0
    """Engine steps of it that failed with a real out-of-memory error (retried once, then failed)."""
    admitted_at: float | None = None
    """When the policy last admitted it into the running set."""
    span: Any = field(default=None, repr=False, compare=False)
    """The request's ``dispatcher.generate`` span: preemptions are recorded on it as events, and the spans that
    serve several requests link to its context (:func:`request_links`)."""

    # --- flush and timing info
    batch_size: int = 0
    flush_reason: int = agent_pb2.FLUSH_REASON_UNSPECIFIED
    queue_wait_s: float = 0.0
    """Wait in the inference queue (double buffer and waiting set), seconds, from its :attr:`arrival` (its validation
    included) until its first admission, or until it ended when it never was (cancelled, past its deadline or failed
    while it waited)."""
    first_token_at: float | None = None
    last_token_at: float | None = None

    # --- accounting
    compute_score_used: float = 0.0
    """Compute score x seconds of engine time while running (see the scheduling policy)."""
    charged_until: float | None = None
    """Running: accounted up to this time (:mod:`~switchyard.dispatcher.scheduler.accounting`); None otherwise."""
    charged_mark: tuple[float, ...] = ()
    """The engine's cumulative activity at ``charged_until`` (``ComputeScoreMonitor.activity``)."""
    running_seconds: float = 0.0
    """Seconds it held a running slot, over all its admissions."""
    score_seconds: float = 0.0
    """Compute score x seconds while it ran (not shared): its average score is this / ``running_seconds``."""
    admitted_at_score: float | None = None
    """The compute score at its last admission (what it added is measured from there); None before it first ran
    and when that admission was onto an idle engine (what it added is then no marginal score)."""
    admitted_together: int = 1
    """Requests admitted in the same decision as it (they share the score increase)."""
    memory_peak_bytes: int = 0
    usage_prompt_tokens: int | None = None
    """Prompt tokens reported by an upstream engine; overrides ``prompt_tokens`` in usage."""
    usage_completion_tokens: int | None = None

    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    """The dispatcher's own id of this request, unique in the process (after vLLM's internal request id):
    what an engine's :class:`~switchyard.dispatcher.engines.base.StepResult` is keyed by, whatever the
    caller's ``request_id``."""
    engine_state: Any = field(default=None, repr=False)
    """The engine's own per-request state, read and written by the engine alone (the sim engine: its
    planned reply and its prompt's prefix-cache block keys, :class:`~switchyard.dispatcher.engines.sim.SimSeq`);
    None until the engine first steps it. Kept here, not in a map of the engine's keyed by the request,
    so that one request's state lives with the request."""
    upstream_call: Any = field(default=None, repr=False)
    """The stream loop's ``asyncio.Task`` streaming this request from an upstream engine, while it streams
    (written by :class:`~switchyard.dispatcher.stream_loop.StreamLoop` alone; None on step engines)."""
    upstream: str = ""
    """What an upstream engine's call of it was last sent to, for messages: ``the model server at <URL> (model
    <id>)``, the URL without credentials (written by the engine as each HTTP request goes out, :meth:`sent_upstream`);
    "" on step engines and before its call."""
    upstream_sent_at: float | None = None
    """When that HTTP request went out (monotonic seconds); None before."""
    waited_on: str = ""
    """What it was waiting on when it ended unfinished (cancelled, failed), and how long (:meth:`waiting_on`, set as
    it ends): ``GenerateDone.waited_on``; "" while it runs, when it finished, or when it waited on nothing."""

    output: OutputStream = field(default_factory=OutputStream, repr=False)
    """Where its tokens, tool calls and end go to its session (written only through :meth:`RequestOutput.publish`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.priority, PriorityClass):
            raise TypeError(f"Request.priority is a PriorityClass (PriorityClass.from_proto converts agent.Priority), "
                            f"got {self.priority!r}")

    # ------------------------------------------------------------------ derived

    @functools.cached_property
    def agent_key(self) -> str:
        """The agent's key, its tenant's and its id's (:func:`switchyard.common.tenant.agent_key`): what the
        state the agent's tasks share (session fairness, the upstream's affinity) is keyed by, so that two
        tenants' agents of one id never share it; a task's own state is keyed by :attr:`program_key`. "" when
        the request has no agent. Read per engine step (the fair policy's charge), so kept once made: the
        tenant and the agent id are the request's from its start."""
        return agent_key(self.tenant_id, self.agent_id)

    @property
    def program_key(self) -> str:
        """Its task's key (:func:`switchyard.common.tenant.program_key`: the agent's key and the task id): what
        a task's own state is keyed by (its parked prefix state, tool-wait plan, DRAM copy, warm-up prefix), where
        :attr:`agent_key` keys what the agent's tasks share (session fairness, upstream affinity). ""
        when the request has no agent."""
        return program_key(self.tenant_id, self.agent_id, self.task_id)

    @property
    def reached_engine(self) -> bool:
        """Admitted at least once (``admitted_at`` set): it left the inference queue, its queue wait is over."""
        return self.admitted_at is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_tokens)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the prefix a full recompute covers."""
        return self.prompt_tokens + len(self.output_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV the next step must compute: the prompt (first prefill),
        the whole prefix (recompute after preemption) or the newest token (decode)."""
        return max(0, self.num_tokens - self.num_computed_tokens)

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still generate before finish_reason ``length``."""
        return max(0, self.max_tokens - len(self.output_tokens))

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """stop, length, tool_calls, content_filter or cancelled once finished (:class:`RequestStatus`, one of
        :data:`FINISH_REASONS`); None otherwise and after an error."""
        return RequestStatus.finish_reason(self.status)

    @property
    def needs_prefill(self) -> bool:
        """True before its first token and after a preemption dropped its KV state.

        Before the first token ``num_computed_tokens`` may already be > 0: a
        react_loop agent resuming with its prefix state warm prefills only the rest.
        """
        return self.num_computed_tokens == 0 or not self.output_tokens

    def completion_tokens(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else len(self.output_tokens)

    def usage_prompt(self) -> int:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_tokens

    def sent_upstream(self, upstream: str) -> None:
        """An upstream engine sent its call to ``upstream`` now (:attr:`upstream`; a retry or the fallback model
        sends it again)."""
        self.upstream = upstream
        self.upstream_sent_at = time.monotonic()

    def waiting_on(self, now: float) -> str:
        """What it waits on at ``now`` (monotonic seconds), for the words of its end: admission to the engine
        (buffered or waiting, never admitted: since it arrived), its upstream's answer (an upstream engine's call:
        since the call was sent or its last token came, whichever is later), or "" (it generates on the dispatcher's
        own engine, or waits again after a preemption)."""
        if not self.reached_engine:
            return f"admission to the engine (inference queue) for {max(0.0, now - self.arrival):.3g} s"
        if self.upstream and self.upstream_sent_at is not None and self.status in (
                RequestStatus.RUNNING, RequestStatus.PREEMPTING):
            since = max(self.upstream_sent_at, self.last_token_at or self.upstream_sent_at)
            return f"{self.upstream} for {max(0.0, now - since):.3g} s"
        return ""

    # ------------------------------------------------------------------ written by the scheduler

    def mark_preempted(self) -> None:
        """The policy took its slot: KV state is dropped, tokens already streamed are kept (an event on
        its span)."""
        self.preemptions += 1
        self.num_computed_tokens = 0
        if self.span is not None:
            self.span.add_event(
                "preempted",
                {"switchyard.preemptions": self.preemptions, "switchyard.tokens_streamed": len(self.output_tokens)},
            )

    def observe_kv_bytes(self, nbytes: int) -> None:
        """Track the peak KV/prefix-state bytes held for this request."""
        if nbytes > self.memory_peak_bytes:
            self.memory_peak_bytes = nbytes


@dataclass(eq=False)
class FlushedBatch:
    """One swap of the double buffer, shared by its members: ``left`` members have not ended yet, and it was
    flushed at ``flushed_at`` (monotonic seconds); when the last ends, the batch's service time is reported
    (to ``SchedulerCore.adaptive_flush``, its measurement)."""

    left: int
    flushed_at: float


@dataclass
class RequestOutput:
    """What one request produced since the scheduler last reported on it: the engine loop pushes it to
    ``req.output`` (visible tokens with their index, tool calls, then its end when ``finished``)."""

    req: Request
    tokens: list[tuple[str, int]] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finished: bool = False

    def publish(self) -> None:
        """Push to the request's output stream: tokens, tool calls, then ``done`` or ``error``."""
        out = self.req.output
        for text, index in self.tokens:
            out.token(text, index)
        for call in self.tool_calls:
            out.tool_call(call)
        if self.finished:
            if self.req.error is not None:
                out.error(self.req.error)
            else:
                out.done(self.req.finish_reason or "stop")


@dataclass
class SchedulerOutput:
    """What the scheduling policy decided at one step boundary.

    ``admitted``: requests newly taken into the running set (they need a
    prefill: first one, or a recompute after preemption). ``preempted``:
    running requests whose slot was taken; the scheduler has dropped their KV
    state (``kv.free``, or a copy went to DRAM) and they wait again. ``running``: the whole
    running set after this decision, admitted included, in step order.
    ``expired``: requests this decision failed: waited past ``queues.inference.timeout_ms``
    before their first admission, or past their own deadline (DEADLINE_EXCEEDED), or, from
    ``on_oom``, a step that ran out of memory.
    ``restore``: admitted requests whose KV state has a copy in the DRAM tier
    (``swap_key``): the step loop brings it back before their next step.
    ``outputs``: requests that ended in this decision (expired, past their
    deadline): the engine loop publishes them. ``prefetch``: swapped agents'
    parked steps whose planned restore is due (their ``swap_key``): the step
    loop loads each copy back in the background and hands it to
    ``SchedulerCore.prefetched``.
    """

    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)
    restore: list[Request] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    prefetch: list[Request] = field(default_factory=list)


def request_links(reqs: "list[Request]") -> list[trace.Link]:
    """Links from a span that serves several requests (a flushed batch, an engine turn) to each request's span.

    Such a span has no single parent; the links tie it to each task's trace. Only sampled requests
    are linked (an unsampled one's span is never exported). Empty with tracing off.
    """
    contexts = [s.span.get_span_context() for s in reqs if s.span is not None]
    return [trace.Link(context) for context in contexts if context.trace_flags.sampled]
