"""``switchyard.json`` ``orchestrator``: the orchestrator, its HTTP face, task store, affinity and react_loop."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from switchyard.api import agent_pb2
from switchyard.common.affinity import DEFAULT_BALANCE
from switchyard.common.config.auth import AuthConfig
from switchyard.common.config.base import _Strict
from switchyard.common.config.server import _health_port, _metrics_port, _port, distinct_ports
from switchyard.common.grpc_target import EXPECTED_TARGET, grpc_target_problem


_ORIGIN = re.compile(r"(https?)://([a-z0-9.\-]+|\[[0-9a-f:.]+\])(?::([1-9][0-9]{0,4}))?")
"""An origin as a browser sends it in ``Origin`` (RFC 6454 section 6.1): scheme, host (a name in lower case, or an
IPv6 address in brackets) and an optional port (no leading zero; :func:`_browser_port` says which); no path."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _browser_port(scheme: str, port: str | None) -> bool:
    """Whether a browser's ``Origin`` can carry ``port`` (None: none) for ``scheme``: one up to 65535 and not the
    scheme's default, which its origin leaves out (the URL standard's serialization)."""
    return port is None or int(port) <= 65535 and int(port) != _DEFAULT_PORTS[scheme]


class HttpFaceConfig(_Strict):
    """The orchestrator's HTTP face (orchestrator/http_face.py): AgentService as JSON and Server-Sent Events.

    Served beside gRPC by the same process on ``server.host``, with the same validation, queues, task store,
    bearer tokens (``orchestrator.auth``) and TLS (``server.tls``).
    """

    enabled: bool = Field(True, description="Serve the HTTP face.")
    port: int = Field(8080, ge=0, le=65535, description="TCP port of the HTTP face; 0 picks a free port.")
    default_payload: str = Field(
        "Continue the agent's task: take its next step.", min_length=1,
        description="Instruction of an HTTP submit or run whose body has no payload, text (an agent harness sends "
        "agent_id, priority, task_type and max_tokens only); validated as a request's own payload.",
    )
    body_read_timeout_s: float = Field(
        10.0, gt=0, le=600,
        description="Longest wait for a request's whole body once its headers arrived, seconds; a client that sends "
        "less than its Content-Length by then gets 408 and the connection is closed (a slow or stalled sender "
        "holds no handler).",
    )
    keepalive_timeout_s: float = Field(
        75.0, gt=0, le=3600,
        description="Longest a connection waits for its next request's head, seconds: an idle connection, or one "
        "whose head is not whole by then, is closed (aiohttp's own server default is an hour, and a client could "
        "hold connections that long sending nothing; 75 s is nginx's keepalive_timeout and aiohttp's run_app).",
    )
    write_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Longest one write of an answer (an SSE event or keepalive, a JSON body) may wait for the client "
        "to take bytes, seconds, once the socket's buffers are full; past it the connection is closed, and a "
        "POST /api/v1/agent/run stream's task is cancelled as when its client leaves (a client that stops reading "
        "without closing holds no handler and no task), counted in "
        "switchyard_client_write_timeouts_total{edge=\"http\"}.",
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=list,
        description="Origins whose browser pages may call the face (CORS), each scheme://host[:port] as a browser "
        "sends it in Origin (https://dash.example.com), or '*' for any: a preflight (OPTIONS) from one is answered "
        "with the methods and headers its route takes, and every answer to one carries Access-Control-Allow-Origin "
        "(credentials are bearer tokens in Authorization, never cookies). Empty: no CORS headers, and OPTIONS is 405.",
    )

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        """Refused at load: an origin a browser never sends (a path, a trailing slash, upper case, the scheme's
        default port, a port with a leading zero or past 65535) matched no request, and the dashboard it was meant
        for was refused without a word of why."""
        for origin in origins:
            matched = _ORIGIN.fullmatch(origin) if origin != "*" else None
            if origin != "*" and not (matched and _browser_port(matched[1], matched[3])):
                raise ValueError(f"each an origin as a browser sends it, scheme://host[:port] in lower case with no "
                                 f"path or trailing slash and no default port (https://dash.example.com), or '*' "
                                 f"(got {origin!r})")
        return origins

    sse_keepalive_s: float = Field(
        4.0, gt=0, le=300,
        description="An SSE stream (POST /api/v1/agent/run) quiet this long, seconds, while its task waits (a "
        "queue, a tool, a long prefill) gets a comment line (':'), which SSE parsers skip, so a client or proxy "
        "with a read timeout does not cut a task that is still running: httpx's default is 5 s, nginx's "
        "proxy_read_timeout 60 s.",
    )


class OrchestratorConfig(_Strict):
    """The orchestrator (AgentService at the edge): ``switchyard.json`` ``orchestrator``."""

    port: int = _port(50051)
    metrics_port: int = _metrics_port(9101)
    health_port: int | None = _health_port()

    @model_validator(mode="after")
    def _ports_of_its_own(self) -> "OrchestratorConfig":
        distinct_ports("orchestrator", {"port": self.port, "metrics_port": self.metrics_port,
                                        "health_port": self.health_port,
                                        "http.port": self.http.port if self.http.enabled else None})
        return self

    retrieval_addr: str = Field(
        "127.0.0.1:50052", min_length=1,
        description="gRPC target of retrieval, host:port or dns:///name:port (SWITCHYARD_RETRIEVAL_ADDR); a port "
        "in 1-65535 is required.",
    )
    dispatcher_addr: str = Field(
        "127.0.0.1:50053", min_length=1,
        description="gRPC target of the dispatcher, host:port, ipv4:host:port,host:port (several replicas) or "
        "dns:///name:port (SWITCHYARD_DISPATCHER_ADDR); a port in 1-65535 is required.",
    )

    @field_validator("retrieval_addr", "dispatcher_addr")
    @classmethod
    def _reachable_target(cls, target: str) -> str:
        if problem := grpc_target_problem(target):
            raise ValueError(f"{EXPECTED_TARGET} ({problem})")
        return target

    retrieval_timeout_ms: float = Field(
        7000, gt=0, le=3_600_000,
        description="Longest wait for one Retrieve call, retrieval's own queue wait included, milliseconds.",
    )
    batch_token_flush_interval_ms: float = Field(
        50.0, ge=0, le=10_000,
        description="Shortest time between two token events of a BATCH task's stream (RunTask, and the HTTP "
        "face's Server-Sent Events), ms: the tokens that arrive within it leave merged in one event (one write "
        "for several), and any other event (a tool call, the final event) cuts the wait short. The first token "
        "is never held; CORE and NORMAL tasks' tokens leave as they come. 0: BATCH's too. The task's model calls "
        "carry it to the dispatcher (GenerateStream's token_hold_s), which then sends their tokens at most once "
        "per interval too.",
    )
    default_task_type: str = Field("rag_answer", description="Workflow of a task that names none, a task type: rag_answer, chat or react_loop.")
    cpu_executor: Literal["process", "thread", "loop"] = Field(
        "process",
        description="Where a task's CPU work (rendering its prompt and counting its tokens, one trip) runs, a name: a "
        "process pool, a thread pool, or the event loop itself. See the README's architecture section for the "
        "measured trade-off.",
    )
    cpu_workers: int = Field(2, ge=1, le=256, description="Processes or threads of the CPU executor, workers.")
    cpu_inline_max_chars: int = Field(
        16_000, ge=0, le=100_000_000,
        description="CPU work on at most this many characters of text (question, passages, tools, history) runs on the "
        "event loop whatever cpu_executor says, characters: a process-pool trip (pickling, a pipe, a context "
        "switch) costs more than rendering and counting a short prompt (0.2 ms for 4,000 characters), and the "
        "event-loop lag it would save shows only past about 18,000 (docs/benchmarks.md). 0: always the executor.",
    )
    max_unfinished_submitted_tasks: int = Field(
        10_000, ge=1,
        description="Most SubmitTask tasks one orchestrator holds unfinished (queued or running), tasks; more are refused "
        "with RESOURCE_EXHAUSTED. Finished tasks are bounded by task_store.",
    )
    max_running_submitted_tasks: int = Field(
        64, ge=1,
        description="Most SubmitTask tasks one orchestrator runs at once, tasks; the other unfinished ones wait QUEUED "
        "in its backlog (priority class first, then arrival) and start as running ones finish. 64 is two of the "
        "dispatcher's batches (queues.json flush.max_batch_size 32): a full batch generating while the rest of the "
        "running tasks retrieve, render or call tools. RunTask is not bounded by it.",
    )
    metadata_span_keys: list[str] = Field(
        default_factory=lambda: ["user", "session_id", "tenant"],
        description="Metadata keys (names) recorded on the task's span as switchyard.metadata.<key> "
        "(values cut to 256 characters); other keys are accepted within limits.max_metadata_* and not used.",
    )
    grpc_stream_write_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="Longest a RunTask event may wait for a gRPC caller to take it, seconds, once the call's HTTP/2 "
        "flow-control window is full (a caller that stops reading without cancelling); past it (checked every quarter "
        "of it) the task is cancelled "
        "and the call ends DEADLINE_EXCEEDED naming this key, which such a caller reads after the events it left "
        "unread; counted in switchyard_client_write_timeouts_total{edge=\"grpc\"}. The orchestrator's HTTP face "
        "bounds its writes by orchestrator.http.write_timeout_s.",
    )
    task_time_limit_s: dict[str, float] = Field(
        default_factory=lambda: {"chat": 120.0, "rag_answer": 180.0, "react_loop": 600.0},
        description="Longest a task of each type may run, seconds, from arrival (a submitted task: from its first "
        "start, leaving the backlog, over every start) to its final event; past it "
        "the task ends DEADLINE_EXCEEDED and every downstream call it made is cancelled. A caller's earlier "
        "gRPC deadline wins. Bounds work whose caller is gone without cancelling (SubmitTask, a dropped call).",
    )
    task_store: "TaskStoreConfig" = Field(
        default_factory=lambda: TaskStoreConfig(), description="Where SubmitTask tasks are recorded (SWITCHYARD_TASK_STORE)."
    )

    @field_validator("default_task_type")
    @classmethod
    def _a_task_type(cls, value: str) -> str:
        """Refused at load: it loaded, and every task naming no task type was refused INVALID_ARGUMENT."""
        from switchyard.common.metrics import TASK_TYPES

        if value not in TASK_TYPES:
            raise ValueError(f"one of {', '.join(TASK_TYPES)}")
        return value

    @field_validator("task_time_limit_s")
    @classmethod
    def _every_task_type_limited(cls, limits: dict[str, float]) -> dict[str, float]:
        from switchyard.common.metrics import TASK_TYPES

        if unknown := sorted(set(limits) - set(TASK_TYPES)):
            raise ValueError(f"unknown task type(s) {', '.join(unknown)}; expected keys among {', '.join(TASK_TYPES)}")
        if missing := [t for t in TASK_TYPES if t not in limits]:
            raise ValueError(f"no time limit for task type(s) {', '.join(missing)}: give each a number of seconds")
        if bad := {t: v for t, v in limits.items() if not 0 < v <= 86_400}:
            raise ValueError(f"time limits must be in (0, 86400] seconds, got {bad}")
        return limits

    inference_mode: Literal["split", "inline"] = Field(
        "split",
        description="How inference holds a worker, a name. split: CPU steps hold an orchestration worker only while they run; inline: one worker "
        "holds a task for its whole DAG, inference included (the one-mixed-queue baseline).",
    )
    react: "ReactConfig" = Field(default_factory=lambda: ReactConfig(), description="The react_loop workflow.")
    program: "ProgramConfig" = Field(
        default_factory=lambda: ProgramConfig(), description="Step and tool times measured, and the hints sent on."
    )
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Bearer tokens required at the edge.")
    http: HttpFaceConfig = Field(default_factory=HttpFaceConfig, description="The HTTP face beside gRPC.")
    show_addresses_to_callers: bool = Field(
        False,
        description="Leave internal addresses (the model server's URLs, a pool's endpoints, the dispatcher's, "
        "retrieval's and a proxy's addresses, private host names, an orchestrator instance id's host and pid) in the "
        "error messages callers read: gRPC status "
        "details, error tool results, a task's error in GetTaskStatus and CancelTask, the HTTP face's JSON errors "
        "and SSE error events. False (for a multi-tenant deployment): each is named without its address ('the "
        "model server', '[address hidden]', 'orchestrator instance <tag>'); logs, spans and switchyard doctor show "
        "them whole either way, and "
        "credentials in a URL (user:password@, its query) are never shown.",
    )
    affinity: "AffinityConfig" = Field(
        default_factory=lambda: AffinityConfig(), description="Agent affinity of dispatcher calls."
    )
    health_check_interval_s: float = Field(
        1.0, gt=0, le=60,
        description="Seconds between checks of the dispatcher's and retrieval's gRPC health; the "
        "orchestrator's own health (readiness) follows them (orchestrator/readiness.py).",
    )
    health_check_timeout_s: float = Field(
        1.0, gt=0, le=30,
        description="Seconds one downstream health Check may take before that replica counts as not ready "
        "(a stopped process answers nothing).",
    )

    def token_hold_s(self, priority: int) -> float:
        """How long a task of ``priority`` (an ``agent.Priority``) has its tokens after its first held, seconds:
        ``batch_token_flush_interval_ms`` for BATCH, else 0. The one reading of that key: RunTask (and the HTTP
        face's SSE) merges the task's token events by it, and each of the task's model calls carries it to the
        dispatcher (``StreamedGenerate.token_hold_s``), which then holds the call's tokens no longer than this
        either: the two hops cannot disagree, whatever the dispatcher's own config says."""
        return self.batch_token_flush_interval_ms / 1000 if priority == agent_pb2.BATCH else 0.0


class TaskStoreConfig(_Strict):
    """Where SubmitTask records tasks for GetTaskStatus: durable across a crash of the orchestrator."""

    backend: Literal["sqlite", "redis"] = Field(
        "sqlite",
        description="Store, a name (SWITCHYARD_TASK_STORE). sqlite: a file on this host (one orchestrator, or several on one host); redis: the DRAM tier's "
        "Redis (memory_policy.toml [dram]), shared by every orchestrator replica. That Redis must persist "
        "(appendonly yes) for tasks to survive its own restart.",
    )
    sqlite_path: str = Field("data/tasks.sqlite3", min_length=1, description="Path of the SQLite file (WAL mode); folders are created.")
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL",
        description="SQLite PRAGMA synchronous, a mode. NORMAL (WAL) survives a killed process; FULL also a power loss, "
        "at one fsync per commit (sqlite.org/pragma.html#pragma_synchronous).",
    )
    retention_s: float = Field(
        86_400, gt=0, le=365 * 86_400, description="A finished task is answered this long after it finished, seconds."
    )
    max_finished_tasks: int = Field(
        1_000_000, ge=1, le=1_000_000_000, description="Most finished tasks kept, tasks; the oldest go first beyond it."
    )
    lease_s: float = Field(
        10, gt=0, le=3600,
        description="Lease of an orchestrator on its tasks, seconds, renewed every lease_s / 3; a task whose orchestrator's lease ran out "
        "while it was RUNNING is reported FAILED with the reason, one still QUEUED is adopted and run by a live "
        "orchestrator on the store, which looks for such tasks (and those a stopping one released) every lease_s.",
    )
    cancel_poll_s: float = Field(
        0.25, gt=0, le=60,
        description="Seconds between an orchestrator's reads of the cancels other replicas recorded for its tasks: a "
        "CancelTask answered by a replica that does not hold the task is recorded in the store and carried out by "
        "the holder within about this long. At most lease_s: a request not taken within 3 x lease_s is dropped, "
        "as a dead owner's is.",
    )

    @model_validator(mode="after")
    def _cancels_read_within_the_lease(self) -> "TaskStoreConfig":
        if self.cancel_poll_s > self.lease_s:
            raise ValueError(
                f"cancel_poll_s ({self.cancel_poll_s:g}) must not exceed lease_s ({self.lease_s:g}): a cancel request "
                "not taken within 3 x lease_s is dropped as a dead owner's"
            )
        return self


class AffinityConfig(_Strict):
    """Agent affinity of the orchestrator's dispatcher calls (common/affinity.py, orchestrator/replicas.py)."""

    enabled: bool = Field(
        True, description="With several dispatcher replicas, send an agent's calls to the replica holding its "
        "warm state (consistent hashing with bounded loads); off: round_robin per call.",
    )
    balance: float = Field(
        DEFAULT_BALANCE, gt=1, le=10,
        description="Load bound, a ratio: no replica holds more than this times the mean number of active agents, "
        "nor (once its agents have more than one call each) more than this times the mean calls in flight; an "
        "agent's overflow goes to the next replica on the ring (Mirrokni, Thorup, Zadimoghaddam 2018).",
    )
    idle_s: float = Field(
        60.0, gt=0, le=86_400,
        description="An agent with no call for this long, seconds, stops counting on its replica (its state there is "
        "likely released: scheduler tool_wait_ttl_s is 30 s).",
    )
    resolve_interval_s: float = Field(
        10.0, gt=0, le=3600, description="Seconds between DNS resolutions of a dns:/// dispatcher target."
    )


class ReactConfig(_Strict):
    """The react_loop workflow and its tool calls."""

    max_steps: int = Field(4, ge=1, le=64, description="Think -> tool -> observe rounds before a forced answer, rounds.")
    tool_attempts: int = Field(3, ge=1, le=20, description="Tries per tool call (tenacity stop_after_attempt), attempts.")
    tool_backoff_initial_ms: float = Field(
        50, ge=0, le=60_000, description="First retry delay, milliseconds; doubles per try."
    )
    tool_backoff_max_ms: float = Field(1000, ge=0, le=600_000, description="Longest retry delay, milliseconds.")
    tool_timeout_ms: float = Field(
        2000, gt=0, le=600_000, description="Per-attempt timeout of one tool call, milliseconds."
    )

    @model_validator(mode="after")
    def _backoff_pair(self) -> "ReactConfig":
        """A longest delay below the first made every delay the longest, the first unsaid (as model_gateway's
        retry_backoff pair, refused the same way)."""
        if self.tool_backoff_max_ms < self.tool_backoff_initial_ms:
            raise ValueError(f"tool_backoff_max_ms ({self.tool_backoff_max_ms:g}) must not be below "
                             f"tool_backoff_initial_ms ({self.tool_backoff_initial_ms:g})")
        return self


class ProgramConfig(_Strict):
    """What the orchestrator measures of each task's program and tells the dispatcher (orchestrator/program.py)."""

    tool_wait_estimate_quantile: float = Field(
        0.75, gt=0, le=1, description="Quantile of a tool's recent call durations announced as its expected wait, 0-1.")
    tool_wait_samples_kept: int = Field(256, ge=1, le=100_000, description="Recent calls kept per tool, calls.")
    tool_wait_cold_estimate_s: float = Field(
        1.0, ge=0, le=3600, description="Expected wait of a tool with no call measured yet, seconds.")
    tool_wait_hint_timeout_ms: float = Field(
        250, gt=0, le=10_000, description="Deadline of one ToolWait announcement to the dispatcher, milliseconds.")
    step_time_samples_kept: int = Field(
        256, ge=1, le=100_000, description="Recent steps kept per (task type, step kind) for their mean time, steps.")
    refuse_early: bool = Field(
        True, description="Refuse DEADLINE_EXCEEDED before a model step when the task's time left is below its "
        "expected work (this step and those after it) by more than refuse_early_margin_s. Off: no refusal on an "
        "estimate, here or at a fair-policy dispatcher (each request says so: GenerateRequest.no_early_refusal); "
        "the time limit still ends the task.")
    refuse_early_margin_s: float = Field(
        0.0, ge=0, le=86_400, description="Shortfall of time left against expected work tolerated, seconds, here "
        "and at a fair-policy dispatcher (GenerateRequest.early_refusal_margin_s). Read only with refuse_early on: "
        "set with it off, refused at load.")
    rag_early_prefill: bool = Field(
        True, description="rag_answer: send system prompt + question as a prefill_only request while retrieval "
        "runs, when the dispatcher says its engine shares prefixes (ModelInfo.shares_prefixes).")

    @model_validator(mode="after")
    def _margin_needs_refuse_early(self) -> "ProgramConfig":
        """refuse_early_margin_s is read only by the early refusal: set with refuse_early off it would do nothing,
        silently."""
        if not self.refuse_early and self.refuse_early_margin_s != 0.0:
            raise ValueError("refuse_early_margin_s: expected refuse_early true (the only rule that reads it), got "
                             "refuse_early false: set refuse_early to true or leave refuse_early_margin_s at 0")
        return self
