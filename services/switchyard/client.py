"""``switchyard run "question"``: stream one task's events.

Human-readable by default (stage timings, the answer as it streams, a summary
with usage, TTFT, queue waits and sources); ``--json`` prints one JSON object
per event (protobuf JSON mapping) for machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys

import grpc

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import ConfigError, ServerConfig, builtin_config, config_folder, load_config
from switchyard.common.client_token import TokenError, add_token_options, bearer_token
from switchyard.common.channels import MAX_CALL_TIMEOUT_S, open_channel
from switchyard.common.tls_check import PLAINTEXT_TO_TLS, explain, looks_like_tls_failure, speaks_tls
from switchyard.common.cli_text import parser_for
from switchyard.common.errors import InvalidArgument
from switchyard.common.grpc_target import address_problem
from switchyard.common.tenant import EXPECTED, TENANT_HEADER, TENANT_PATTERN
from switchyard.common.untrusted import terminal_safe
from switchyard.orchestrator.http_models import message_dict
from switchyard.orchestrator.validation import parse_priority


_UNREACHABLE = re.compile(r"failed to connect to all addresses|connections to all backends failing|Connection refused")
"""grpc's words when the orchestrator itself does not answer (not a downstream's UNAVAILABLE it relays)."""
_CUT = re.compile(r"Socket closed|Connection reset|Broken pipe")
"""grpc's words when the connection to the orchestrator broke mid-call (its process stopped or was killed, or
something between cut it), not a status the orchestrator sent."""
_HTTP1 = re.compile(r"Trying to connect an http1\.x server")
"""grpc's words when an HTTP/1.x server answers where it expected a gRPC one."""
_NOT_HTTP2 = re.compile(r"Failed parsing HTTP/2")
"""grpc's words when something answers that does not speak HTTP/2 (a metrics port, a Redis)."""


_NO_METHOD = "Method not found!"
"""grpc's words (UNIMPLEMENTED) when the gRPC server called serves no such method: not AgentService's server."""


def not_agent_service_here(address: str, code: grpc.StatusCode, details: str,
                           grpc_port: int | None = None) -> str | None:
    """What a failed AgentService call's status says of the server at ``address`` when it is a gRPC server that
    serves no AgentService (a dispatcher's or retrieval's port), for a person; None otherwise. ``grpc_port``: the
    orchestrator's gRPC port in the configuration, named where given. It printed "UNIMPLEMENTED: Method not
    found!" alone."""
    if code != grpc.StatusCode.UNIMPLEMENTED or details.strip() != _NO_METHOD:
        return None
    port = f"orchestrator.port ({grpc_port} here)" if grpc_port is not None else "orchestrator.port"
    return (f"the gRPC server at {address} serves no agent.AgentService (a dispatcher's or retrieval's port?): "
            f"the orchestrator's gRPC port is {port}")


def not_grpc_here(address: str, details: str, grpc_port: int | None = None) -> str | None:
    """What a failed call's UNAVAILABLE ``details`` say answers at ``address`` when it is not a gRPC server, for
    a person; None when they say no such thing (nothing answers, or a gRPC server answered). ``grpc_port``: the
    orchestrator's gRPC port in the configuration (``orchestrator.port``), named where given."""
    port = f"orchestrator.port ({grpc_port} here)" if grpc_port is not None else "orchestrator.port"
    if _HTTP1.search(details):
        return (f"an HTTP/1.x server answers at {address}, not gRPC: the orchestrator's HTTP face "
                f"(orchestrator.http.port)? the orchestrator's gRPC port is {port}")
    if _NOT_HTTP2.search(details):
        return (f"something answers at {address} that is not a gRPC server (a metrics port, a Redis, another "
                f"service?): the orchestrator's gRPC port is {port}")
    return None
_INT32_MAX = 2**31 - 1


def _max_tokens(text: str) -> int:
    """argparse type of ``--max-tokens``: a whole number from 0 to the proto field's int32 range."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens: 0 (the server's default) or a count "
                                         f"within the server's limits.max_tokens, got {text!r}")
    return value


def _priority(text: str) -> int:
    """argparse type of ``--priority``: the orchestrator's own rule for a priority's name (any case)."""
    try:
        return parse_priority(text, "--priority")
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--priority: ")) from None


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


class HumanPrinter:
    """Prints events for a person; remembers whether the cursor sits after streamed tokens. Text that came
    from the task is printed through :func:`terminal_safe`."""

    def __init__(self, out=None) -> None:
        self.out = sys.stdout if out is None else out  # the stdout of now, not of the module's import
        self.in_text = False

    def _line(self, text: str) -> None:
        if self.in_text:
            self.out.write("\n")
            self.in_text = False
        self.out.write(text + "\n")

    def __call__(self, event: agent_pb2.TaskEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "accepted":
            a = event.accepted
            trace = f"  trace {a.trace_id}" if a.trace_id else ""
            self._line(f"accepted  task {a.task_id}  queue position {a.queue_position}{trace}")
        elif kind == "stage":
            s = event.stage
            self._line(terminal_safe(f"  stage {s.name:<16} {_ms(s.duration_s):>10}   (at {_ms(s.start_s)})",
                                     frozenset()))
        elif kind == "token":
            if not self.in_text:
                self.out.write("\n")
            self.out.write(terminal_safe(event.token.text))
            self.in_text = True
        elif kind == "tool_call":
            c = event.tool_call
            self._line(terminal_safe(f"  tool call   {c.name}({c.arguments_json})", frozenset()))
        elif kind == "tool_result":
            r = event.tool_result
            first = r.content.splitlines()[0] if r.content else ""
            flag = " ERROR" if r.is_error else ""
            self._line(terminal_safe(f"  tool result {r.name}{flag} after {r.attempts} attempt(s): {first[:100]}",
                                     frozenset()))
        elif kind == "final":
            f = event.final
            t = f.timings
            self._line("")
            waits = ", ".join(f"{q} {_ms(w)}" for q, w in sorted(t.queue_wait_s.items())) or "none"
            self._line(
                f"final: {f.usage.prompt_tokens} prompt + {f.usage.completion_tokens} completion tokens; "
                f"TTFT {_ms(t.ttft_s)}, total {_ms(t.total_s)}; model {f.model or '-'}; "
                f"finish {terminal_safe(f.finish_reason or '-')}"
            )
            if f.finish_reason == "length":
                self._line("output cut short: the model reached its token limit (finish_reason length); "
                           "raise --max-tokens")
            elif f.finish_reason == "content_filter":
                self._line("output cut short: the model server's content filter withheld the rest of the answer "
                           "(finish_reason content_filter)")
            self._line(f"queue waits: {waits}")
            self._line(f"compute score used {f.compute_score_used:.3f} score-seconds, memory peak {f.memory_peak_bytes} bytes")
            for i, p in enumerate(f.passages, 1):
                self._line(terminal_safe(f"  [{i}] {p.title}  ({p.source})  cosine {p.score:.3f}",  # ranking's order
                                         frozenset()))
            if f.trace_id:
                self._line(f"trace id: {f.trace_id}")
        self.out.flush()


async def run_task(
    address: str, request: agent_pb2.RunTaskRequest, on_event, timeout: float | None, token: str | None = None,
    server: ServerConfig | None = None, tenant: str = "",
) -> None:
    """Call RunTask at ``address`` and pass each event to ``on_event``; ``token`` is sent as a bearer
    token, ``tenant`` (non-empty) as ``x-tenant-id``, and ``server.tls`` (when on) secures the channel.

    Raises:
        grpc.aio.AioRpcError: the task failed; its code and details say why.
    """
    metadata: list[tuple[str, str]] = []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    if tenant:
        metadata.append((TENANT_HEADER, tenant))
    async with open_channel(address, server, peer="orchestrator") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        async for event in stub.RunTask(request, timeout=timeout, metadata=tuple(metadata) or None):
            on_event(event)


_REFUSED_ON_OUR_DEADLINE = "before its deadline (the caller's gRPC deadline)"
"""What the orchestrator's early refusal says when the caller's deadline (this command's --timeout) set it."""

_GRPC_DEADLINE = re.compile(r"^(Stream removed \()?Deadline Exceeded\)?$")
"""grpc's own words for the caller's deadline: the server's message names its limit instead."""


def up_file_orchestrator() -> tuple[str, str] | None:
    """(the up file, its orchestrator's address) of the stack ``switchyard up`` runs, which ``switchyard top`` and
    ``switchyard profile`` read (``--free-ports`` gives it other ports than the config's); None when there is none
    (a killed launcher's file is removed, as they remove it)."""
    from switchyard.common import up_files

    path = up_files.default_path()
    up_files.remove_stale(path)
    try:
        address = up_files.recorded_services(path)["orchestrator"]["address"]
    except (OSError, ValueError, KeyError):
        return None
    return (str(path), address) if isinstance(address, str) and not address_problem(address) else None


def up_stack_elsewhere(address: str, command: str) -> str | None:
    """Where the stack ``switchyard up`` runs serves its orchestrator (:func:`up_file_orchestrator`), as a sentence
    naming ``command`` run against it (``"run --addr"``, ``"bench run"``); None when no such stack runs or it serves
    at ``address`` (the one just tried)."""
    up_stack = up_file_orchestrator()
    if up_stack is None or up_stack[1] == address:
        return None
    return (f"the stack that switchyard up started serves its orchestrator at {up_stack[1]} (its up file "
            f"{up_stack[0]}): switchyard {command} {up_stack[1]} ...")


def main(argv: list[str]) -> int:
    parser = parser_for("switchyard run", __doc__)
    parser.add_argument("question", nargs="+", help="the question or instruction (the task's payload)")
    parser.add_argument("--addr", help="orchestrator host:port (default: from config, 127.0.0.1:50051)")
    parser.add_argument("--config-dir", help="config folder (default: $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--task-type", default="", help="rag_answer (default), chat or react_loop")
    parser.add_argument("--priority", default=agent_pb2.NORMAL, type=_priority,
                        help="core, normal (default) or batch, any case")
    parser.add_argument("--max-tokens", type=_max_tokens, default=0,
                        help="completion tokens of each model call (react_loop makes several), 0 = the workflow's default "
                             "(the server checks limits.max_tokens)")
    parser.add_argument("--model", default="",
                        help="model alias or id (default: the engine's own; model_gateway.default_model on the openai engine)")
    parser.add_argument("--task-id", default="", help="the task's id (default: one the orchestrator makes)")
    parser.add_argument("--agent-id", default="", help="the agent the task belongs to (its memory, its session's "
                                                         "fair share, its replica; default: none, the task alone)")
    parser.add_argument("--tenant", default="", help=f"the tenant it runs for, sent as x-tenant-id ({EXPECTED}; "
                                                       "default: the bearer token's, else default)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    parser.add_argument("--json", action="store_true", help="one JSON object per event")
    add_token_options(parser)  # --token-file and --token-env, as profile, bench http and the locustfile take them
    args = parser.parse_args(argv)
    if not 0 < args.timeout <= MAX_CALL_TIMEOUT_S:  # NaN fails it too; a larger one failed at once, DEADLINE_EXCEEDED
        parser.error(f"--timeout: expected seconds > 0, at most {MAX_CALL_TIMEOUT_S:g} (gRPC's deadline overflows "
                     f"past it), got {args.timeout:g}")
    if args.tenant and not TENANT_PATTERN.fullmatch(args.tenant):
        parser.error(f"--tenant: expected {EXPECTED}, got {args.tenant[:80]!r}")
    address = args.addr
    if address is not None and (problem := address_problem(address)):
        parser.error(f"--addr: expected host:port such as 127.0.0.1:50051, a port in 1-65535, got {address!r} "
                     f"({problem})")
    folder = config_folder(args.config_dir)
    try:
        if address is not None and args.config_dir is None and not folder.is_dir():
            # a client given its address needs the config only for TLS: the built-in defaults, and the
            # environment's TLS (SWITCHYARD_TLS_DIR, SWITCHYARD_TLS_SERVER_NAME, SWITCHYARD_TLS_CLIENT_AUTH)
            config = builtin_config()
            how = ("TLS from the environment (SWITCHYARD_TLS_DIR)" if config.server.tls.enabled else
                   "plaintext (SWITCHYARD_TLS_DIR, or --config-dir naming a folder whose server.tls is on, for TLS)")
            print(f"switchyard run: no config folder at {folder.resolve()}: gRPC to {address} over {how}",
                  file=sys.stderr)
        else:
            config = load_config(args.config_dir)  # the address, and TLS when server.tls is on
    except (ConfigError, ValueError) as exc:
        print(f"switchyard run: bad configuration:\n{exc}", file=sys.stderr)
        return 2
    if address is None:
        address = f"{config.server.host}:{config.orchestrator.port}"
    request = agent_pb2.RunTaskRequest(
        task_id=args.task_id,
        agent_id=args.agent_id,
        payload=" ".join(args.question),
        task_type=args.task_type,
        priority=args.priority,
        max_tokens=args.max_tokens,
        model=args.model,
    )
    if args.json:
        def on_event(event: agent_pb2.TaskEvent) -> None:  # as the HTTP face's events: one JSON shape
            print(json.dumps(message_dict(event), separators=(",", ":")), flush=True)
    else:
        on_event = HumanPrinter()
    try:
        token = bearer_token(args.token_file, args.token_env)
    except TokenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_task(address, request, on_event, args.timeout, token, config.server, args.tenant))
    except grpc.aio.AioRpcError as err:
        print(f"\nerror: {err.code().name}: {terminal_safe(err.details() or '')}", file=sys.stderr)
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and _GRPC_DEADLINE.search(err.details() or ""):
            print(f"this command's --timeout ({args.timeout:g} s) ran out before the task ended; raise it for a "
                  "longer task (the task was cancelled with the call)", file=sys.stderr)
        elif err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and _REFUSED_ON_OUR_DEADLINE in (err.details() or ""):
            print(f"this command's --timeout ({args.timeout:g} s) is the task's deadline, and its measured work "
                  "does not fit in it: raise it for a longer task", file=sys.stderr)
        tls_failed = config.server.tls.enabled and looks_like_tls_failure(err.details() or "")
        plain_to_tls = (err.code() == grpc.StatusCode.UNAVAILABLE and not config.server.tls.enabled
                        and bool(_CUT.search(err.details() or "")) and asyncio.run(speaks_tls(address)))
        elsewhere = not_grpc_here(address, err.details() or "", config.orchestrator.port)
        not_agent = not_agent_service_here(address, err.code(), err.details() or "", config.orchestrator.port)
        if plain_to_tls:
            print(PLAINTEXT_TO_TLS.format(address=address), file=sys.stderr)
        elif err.code() == grpc.StatusCode.UNAVAILABLE and elsewhere is not None or not_agent is not None:
            print(f"{elsewhere or not_agent}; --addr takes that port", file=sys.stderr)
            if not_agent is not None and (up_stack := up_stack_elsewhere(address, "run --addr")) is not None:
                print(up_stack, file=sys.stderr)
        elif (err.code() == grpc.StatusCode.UNAVAILABLE and _UNREACHABLE.search(err.details() or "")
              and not tls_failed):  # a TLS failure is something answering: explained below
            print(f"nothing answers at {address}: is the stack running (`make run` or `switchyard up`)? "
                  "--addr names another orchestrator", file=sys.stderr)
            if (up_stack := up_stack_elsewhere(address, "run --addr")) is not None:
                print(up_stack, file=sys.stderr)
        elif err.code() == grpc.StatusCode.UNAVAILABLE and _CUT.search(err.details() or ""):
            print(f"the connection to the orchestrator at {address} broke before the task ended (it stopped or was "
                  "killed, or something between cut it); a RunTask ends with its call and leaves no record: run it "
                  "again once the orchestrator answers", file=sys.stderr)
        if tls_failed:
            print(asyncio.run(explain(address, config.server.tls)), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
