"""``switchyard bench``: load-test RunTask, compare scheduler settings, or run the scheduling benchmark.

Subcommands:

- ``run`` (the default): the load generator; options mirror ghz's (``-n``, ``-c``,
  ``--rps``, ``--duration``, ``-d``/``--data``, ``-D``/``--data-file``,
  ``--config`` for a ghz JSON config file) and the report is ghz's JSON format.
  Interrupted (Ctrl-C, SIGINT) once calls have started, it prints and writes the
  report of the calls that completed, as ghz does (``endReason`` ``cancel``; the
  summary says so), and exits 130. Against a stack with ``orchestrator.auth`` on,
  its calls carry the bearer token as ``switchyard run``'s do
  (``SWITCHYARD_AUTH_TOKEN``, ``--token-env``, ``--token-file``:
  :mod:`switchyard.common.client_token`), unless ``-m`` names ``authorization``.
- ``compare``: scenarios A-D on one request set (see :mod:`switchyard_harness.bench.compare`).
- ``sched``: the scheduling benchmark (``switchyard_harness.bench.sched_bench``).
- ``isolation``: idle-dispatcher queue wait, and core TTFT under batch load
  (:mod:`switchyard_harness.bench.isolation`).
- ``agents``: the field's agent load test, memory tiers acting (:mod:`switchyard_harness.bench.agents_bench`).
- ``route``: agent routing over many dispatcher replicas, simulated
  (:mod:`switchyard_harness.bench.route`).
- ``pool``: the gateway's endpoint picker over three sim-openai replicas against
  round robin, and with one replica killed (:mod:`switchyard_harness.bench.pool`).
- ``fault``: SIGKILL one of several local dispatchers under load and account
  for every call (:mod:`switchyard_harness.bench.fault`).
- ``upstream``: one load straight at a model server and through Switchyard, taking turns
  (:mod:`switchyard_harness.bench.upstream`).
- ``retrieval``: retrieval answer quality and time per query
  (:mod:`switchyard_harness.bench.retrieval_quality`).
- ``diff``: two ghz-format reports side by side (:mod:`switchyard_harness.bench.diff`).
- ``http``: the orchestrator's HTTP face under load, SSE vs gRPC RunTask (:mod:`switchyard_harness.bench.http_bench`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from switchyard_harness import json_output
from switchyard.common import outputs
from switchyard.common.client_token import TokenError, add_token_options, bearer_token
from switchyard.common.config.base import did_you_mean

_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
INTERRUPTED = 130
"""The exit status of a run stopped by SIGINT (Ctrl-C): 128 + the signal's number, as a shell reports it."""


def parse_duration(text: str | float | int) -> float:
    """A Go/ghz duration (``"10s"``, ``"1m30s"``, ``"500ms"``) or plain seconds -> seconds.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if isinstance(text, (int, float)):
        return float(text)
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"expected a duration such as 10s, 1m30s or 500ms, got {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _procs(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number >= 1, got {text!r}")
    return value


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``compare`` share (ghz's names). Defaults None: see :func:`resolve_plan`."""
    parser.add_argument("--config", help="ghz JSON config file (ghz/reference.json); flags override its keys")
    parser.add_argument("-n", "--total", type=int, help="calls to make (ghz default 200)")
    parser.add_argument("-c", "--concurrency", type=int, help="concurrent calls (ghz default 50)")
    parser.add_argument("-r", "--rps", type=float, help="call starts per second, 0 = unpaced (ghz -r)")
    parser.add_argument("-z", "--duration", type=parse_duration, help="run this long instead of -n (e.g. 30s)")
    parser.add_argument("-t", "--timeout", type=parse_duration,
                        help="deadline per call (default 20s; 0: none, as ghz -t 0)")
    parser.add_argument("-d", "--data", help="call data as JSON: an object or an array used round-robin")
    parser.add_argument("-D", "--data-file", help="call data JSON file (ghz/data/mixed.json)")
    parser.add_argument("--procs", type=_procs, default="auto", help="client processes: auto or N")
    # ghz's connection flags, so a ghz command line runs unchanged.
    parser.add_argument("-m", "--metadata", help="gRPC metadata as a JSON object of strings (ghz -m), "
                        "e.g. '{\"authorization\": \"Bearer ...\"}'")
    parser.add_argument("--insecure", action="store_true", help="plain text, no TLS (the default; ghz --insecure)")
    parser.add_argument("--cacert", help="PEM CA bundle: connect over TLS and check the server (ghz --cacert)")
    parser.add_argument("--cert", help="PEM client certificate for mTLS (ghz --cert), with --key")
    parser.add_argument("--key", help="PEM private key of --cert (ghz --key)")
    parser.add_argument("--cname", help="server name to check in its certificate (ghz --cname)")
    parser.add_argument("--proto", help="accepted for ghz compatibility; the contract is built in")
    parser.add_argument("--protoset", help="accepted for ghz compatibility; the contract is built in")
    parser.add_argument("-i", "--import-paths", help="accepted for ghz compatibility (ghz resolves the proto's "
                        "imports there); the contract is built in")
    parser.add_argument("--call", help="accepted for ghz compatibility: only agent.AgentService.RunTask")


def _metadata(value: Any) -> dict[str, str]:
    """ghz ``-m``: a JSON object (text or, from a config file, already parsed) of string values."""
    if value is None:
        return {}
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise ValueError(f"--metadata: expected a JSON object, {exc}") from None
    if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
        raise ValueError("--metadata: expected a JSON object of strings, e.g. '{\"authorization\": \"Bearer t\"}'")
    return {str(k).lower(): v for k, v in parsed.items()}


def _tls(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, str]:
    """TLS settings from ghz's flags (or config keys); empty for plain text."""
    def pick(name: str) -> str:
        return getattr(args, name, None) or cfg.get(name) or ""

    if getattr(args, "call", None) and args.call.replace("/", ".") != "agent.AgentService.RunTask":
        raise ValueError(f"--call: only agent.AgentService.RunTask is served, got {args.call!r}")
    if not pick("cacert"):
        if pick("cert") or pick("key"):
            raise ValueError("--cert/--key: give --cacert too (the CA that signs the server's certificate)")
        return {}
    if getattr(args, "insecure", False):
        raise ValueError("--insecure and --cacert: choose plain text or TLS")
    if bool(pick("cert")) != bool(pick("key")):
        raise ValueError("--cert and --key: give both for mTLS")
    return {"ca_file": pick("cacert"), "cert_file": pick("cert"), "key_file": pick("key"), "server_name": pick("cname")}


_GHZ_CONFIG_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "total": ("a whole number", (int,)),
    "concurrency": ("a whole number", (int,)),
    "rps": ("a number", (int, float)),
    "duration": ("a duration such as \"10s\" or seconds", (str, int, float)),
    "timeout": ("a duration such as \"20s\" or seconds", (str, int, float)),
    "host": ("host:port as a string", (str,)),
    "data-file": ("a file's path as a string", (str,)),
    "insecure": ("true or false", (bool,)),
    **{key: ("a file's path as a string", (str,)) for key in ("cacert", "cert", "key")},
    "cname": ("a server name as a string", (str,)),
    "name": ("a string", (str,)),
    "call": ("a method's name as a string", (str,)),
}
"""The ghz config keys :func:`resolve_plan` reads (``data`` and ``metadata`` are checked where they are parsed),
with what each must be; other ghz keys (``proto``, ``import-paths``, ...) are left as ghz documents them."""


def ghz_config(path: Path) -> dict[str, Any]:
    """A ghz JSON config file (``--config``), each key :func:`resolve_plan` reads of the JSON type it expects.

    Raises:
        ValueError: the file cannot be read, is not UTF-8 JSON or not an object, or a key holds another type (the
            message names the key, what was expected and the value).
    """
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8-sig"))  # an editor's BOM is no error
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # not UTF-8, not JSON
        raise ValueError(f"expected a ghz JSON config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"expected a JSON object of ghz's keys, got {type(cfg).__name__} {json.dumps(cfg)[:80]}")
    for key in cfg:  # ghz's keys are its long flags' names: one not taken is named, never ignored
        if f"--{key}" in GHZ_FLAGS_NOT_TAKEN:
            raise ValueError(f"{key}: a ghz key switchyard bench does not take; {GHZ_FLAGS_NOT_TAKEN[f'--{key}']}")
    for key, (what, types) in _GHZ_CONFIG_TYPES.items():
        value = cfg.get(key)
        if value is None and key not in cfg:
            continue
        bad_number = isinstance(value, float) and not math.isfinite(value)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types) or bad_number:
            raise ValueError(f"{key}: expected {what}, got {json.dumps(value, allow_nan=True)}")
    return cfg


_SCHEDULE = "drop it (a load that changes over the run is not generated: a constant -r/--rps and -c/--concurrency)"
_JSON_DATA = "drop it (call data is JSON: -d or -D)"
GHZ_FLAGS_NOT_TAKEN: dict[str, str] = {
    **dict.fromkeys(("-q", "--qps"), "use -r/--rps (ghz's old name for the rate)"),
    **dict.fromkeys(("--connections", "--cpus"), "drop it (--procs sets the client processes, each with its own "
                    "channel)"),
    **dict.fromkeys(("-x", "--max-duration", "--duration-stop"), "drop it (-z/--duration runs for a time instead "
                    "of -n; -t/--timeout bounds each call)"),
    "--skipFirst": "drop it (every call is reported: run a warm-up first and keep the second report)",
    "--count-errors": "drop it (latency figures are of the successful calls, as ghz's without it; failed ones are "
                      "counted in statusCodeDistribution and errorDistribution)",
    "--async": "drop it (calls start at -r/--rps, at most -c/--concurrency in flight)",
    "--skipTLS": "drop it (a server's certificate is always checked over TLS: --cacert CA)",
    **dict.fromkeys(("-b", "--binary", "-B", "--binary-file"), _JSON_DATA),
    **dict.fromkeys(("-M", "--metadata-file"), "drop it (metadata is -m with a JSON object)"),
    **dict.fromkeys([f"--load-{k}" for k in ("schedule", "start", "end", "step", "step-duration", "max-duration")]
                    + [f"--concurrency-{k}" for k in ("schedule", "start", "end", "step", "step-duration",
                                                        "max-duration")], _SCHEDULE),
    **dict.fromkeys((
        "--authority", "--stream-interval", "--stream-call-duration", "--stream-call-count",
        "--stream-dynamic-messages", "--reflect-metadata", "--connect-timeout", "--keepalive", "--tags", "--debug",
        "-e", "--enable-compression", "--lb-strategy", "--disable-template-functions", "--disable-template-data",
        "--max-recv-message-size", "--max-send-message-size"), "drop it"),
}
"""ghz's flags (github.com/bojand/ghz, its usage) that ``bench run`` and ``bench compare`` do not take, and what
to do instead: each is refused by name (:func:`parse_load_args`). argparse's own 'unrecognized arguments' took a
flag's value for the target and named the target as unrecognized."""


def parse_load_args(parser: argparse.ArgumentParser, argv: list[str], command: str) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but a ghz flag ``bench COMMAND`` does not take (:data:`GHZ_FLAGS_NOT_TAKEN`)
    is refused naming it and what to do (:func:`usage_error`), not as argparse's unrecognized arguments."""
    args, unknown = parser.parse_known_args(argv)
    for token in unknown:
        flag = token.partition("=")[0]
        if flag in GHZ_FLAGS_NOT_TAKEN:
            usage_error(f"{flag}: a ghz flag that switchyard bench {command} does not take; "
                        f"{GHZ_FLAGS_NOT_TAKEN[flag]} (`switchyard bench {command} --help` lists those it takes)")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def usage_error(message: str) -> NoReturn:
    """Print ``switchyard bench: message`` on stderr and exit 2, as argparse does for a bad flag."""
    print(f"switchyard bench: {message}", file=sys.stderr)
    raise SystemExit(2)


def resolve_plan(args: argparse.Namespace, host: str | None):
    """Merge a ghz config file, flags and ghz's defaults into a LoadPlan (flags win).

    Raises:
        SystemExit(2), the problem on stderr naming the flag or file (:func:`usage_error`): an unreadable
            config or call data, or a value the plan refuses.
    """
    from switchyard_harness.bench.calldata import CallDataError, load_calldata_file, parse_calldata
    from switchyard_harness.bench.loadgen import LoadPlan, with_procs

    cfg: dict[str, Any] = {}
    base = Path.cwd()
    if args.config:
        path = Path(args.config)
        try:
            cfg = ghz_config(path)
        except ValueError as exc:
            usage_error(f"--config {path}: {exc}")
        base = path.parent

    def pick(flag: Any, key: str, default: Any) -> Any:
        return flag if flag is not None else cfg.get(key, default)

    try:
        if args.data is not None:
            items = parse_calldata(args.data, "--data")
        elif args.data_file is not None:
            try:
                items = load_calldata_file(args.data_file)
            except CallDataError as exc:
                raise CallDataError(f"-D/--data-file: {exc}") from None
        elif "data" in cfg:
            items = parse_calldata(cfg["data"], f"{args.config}: data")
        elif "data-file" in cfg:
            data_path = Path(cfg["data-file"])
            if not data_path.exists() and (base / data_path).exists():
                data_path = base / data_path
            try:
                items = load_calldata_file(data_path)
            except CallDataError as exc:
                raise CallDataError(f"--config {args.config}: data-file: {exc}") from None
        else:
            items = parse_calldata({"task_id": "bench-{{.RequestNumber}}", "payload": "summarize this doc"})
    except (CallDataError, OSError) as exc:
        usage_error(str(exc))
    try:
        plan = LoadPlan(
            host=host or cfg.get("host", "127.0.0.1:50051"),
            calldata=items,
            total=int(pick(args.total, "total", 200)),
            concurrency=int(pick(args.concurrency, "concurrency", 50)),
            rps=float(pick(args.rps, "rps", 0)),
            duration_s=parse_duration(pick(args.duration, "duration", 0)),
            timeout_s=parse_duration(pick(args.timeout, "timeout", 20)),
            metadata=_metadata(pick(args.metadata, "metadata", None)),
            tls=_tls(args, cfg),
        )
        return with_procs(plan, args.procs)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        usage_error(str(exc))


def with_token(plan: Any, args: argparse.Namespace) -> Any:
    """``plan`` with the bearer token of ``--token-file`` or ``--token-env``'s variable in its ``authorization``
    metadata, as ``switchyard run`` sends it; unchanged with no token, or where ``-m`` (or the ghz config's
    ``metadata``) names ``authorization`` itself (ghz's own way, which then wins over the variable).

    Raises:
        SystemExit(2) (:func:`usage_error`): the token file cannot be read or holds no single token, or
            ``--token-file`` is given beside an ``authorization`` of ``-m`` (which of the two to send is not guessed).
    """
    import dataclasses

    if "authorization" in plan.metadata:
        if args.token_file:
            usage_error(f"--token-file {args.token_file}: -m (or the --config file's metadata) names authorization "
                        "too; give the token one way")
        return plan
    try:
        token = bearer_token(args.token_file, args.token_env)
    except TokenError as exc:
        usage_error(str(exc))
    if token is None:
        return plan
    return dataclasses.replace(plan, metadata={**plan.metadata, "authorization": f"Bearer {token}"})


SECRET_FLAGS = ("-m", "--metadata")
"""Flags whose value may carry a credential (ghz's ``-m '{"authorization": "Bearer ..."}'``)."""


def shown_argv(argv: list[str]) -> list[str]:
    """``argv`` as a plot's title may show it: each metadata value replaced by its keys (a bearer token in a
    PNG is a leaked token)."""
    def keys_only(value: str) -> str:
        try:
            names = list(json.loads(value))
        except (ValueError, TypeError):
            names = []
        return "{" + ", ".join(f"{name}: ***" for name in names) + "}"

    shown: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            shown.append(keys_only(arg))
            hide_next = False
        elif arg in SECRET_FLAGS:
            shown.append(arg)
            hide_next = True
        elif arg.startswith("--metadata="):
            shown.append("--metadata=" + keys_only(arg.removeprefix("--metadata=")))
        elif arg.startswith("-m") and not arg.startswith("--") and len(arg) > 2:
            shown.append("-m" + keys_only(arg[2:]))
        else:
            shown.append(arg)
    return shown


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="switchyard bench run",
        description="Load-test agent.AgentService.RunTask (server streaming); writes ghz's JSON report.",
        allow_abbrev=False,  # ghz's flags as ghz spells them (and --meta for --metadata would slip past shown_argv)
    )
    add_load_options(parser)
    parser.add_argument("--host", help="orchestrator host:port (default 127.0.0.1:50051 or the config's host)")
    parser.add_argument("target", nargs="?", help="orchestrator host:port, as ghz takes it (same as --host)")
    parser.add_argument("-o", "--output", help="write the report here (ghz -o); without -O: the JSON report")
    parser.add_argument("-O", "--format", choices=["summary", "json", "pretty"],
                        help="report format as ghz names them: summary (text), json, pretty (indented JSON); "
                        "written to -o, or to stdout")
    parser.add_argument("--name", default="", help="report name (ghz --name)")
    parser.add_argument("--plot", metavar="PNG", help="also write a PNG: latency histogram, TTFT distribution, "
                        "throughput over time")
    add_token_options(parser)
    args = parse_load_args(parser, argv, "run")
    outputs.refuse_unwritable(parser, ("-o/--output", args.output), ("--plot", args.plot))  # now, not after the run
    plan = with_token(resolve_plan(args, args.host or args.target), args)

    import grpc

    from switchyard.client import not_agent_service_here, up_stack_elsewhere
    from switchyard_harness.bench.loadgen import run_load
    from switchyard_harness.bench.report import build_report, summary_text

    try:
        load = run_load(plan, interruptible=True)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"switchyard bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # run_load raises it for a SIGINT before the calls started, and for a second one while the run stops
        print("switchyard bench run: interrupted before any call started, or a second time while stopping; no "
              "report", file=sys.stderr)
        return INTERRUPTED
    interrupted = load.end_reason == "cancel"  # Ctrl-C: the report of the calls that completed, as ghz's
    # a dispatcher's or retrieval's port: every call "Unimplemented desc = Method not found!", and no word on why
    not_agent = next((hint for r in load.results if r.status == "Unimplemented" and (hint := not_agent_service_here(
        plan.host, grpc.StatusCode.UNIMPLEMENTED, r.error.partition(" desc = ")[2]))), None)
    report = build_report(load, plan, name=args.name)
    rendered = {
        "summary": summary_text(report),
        "json": json_output.dumps(report, separators=(",", ":")),
        "pretty": json_output.dumps(report, indent=2),
    }
    if args.format is None:  # the summary on stdout, and the JSON report where -o says
        print(rendered["summary"])
        text = rendered["pretty"]
    else:
        text = rendered[args.format]
    if args.output:
        try:
            outputs.write(args.output, text + "\n")
        except OSError as exc:
            print(f"switchyard bench run: -o {args.output}: could not write the report ({exc.strerror or exc}); "
                  "it follows on stdout", file=sys.stderr)
            print(text)
            return 1
        if args.format is None:
            print(f"\nreport written to {args.output}")
    elif args.format is not None:
        print(text)
    if args.plot:
        from switchyard_harness.bench.plot import plot_run

        title = (f"switchyard bench run {' '.join(shown_argv(argv))}\n{report['count']} calls, {report['rps']:.1f} rps, "
                 f"concurrency {plan.concurrency}, offered {plan.rps:g} rps")
        try:
            plot_run(load, Path(args.plot), title)
        except OSError as exc:
            print(f"switchyard bench run: --plot {args.plot}: could not write the plot ({exc.strerror or exc})",
                  file=sys.stderr)
            return 1
        if args.format is None:
            print(f"plot written to {args.plot}")
    if not_agent is not None:
        up_stack = up_stack_elsewhere(plan.host, "bench run")
        elsewhere = "" if up_stack is None else f"; {up_stack}"
        print(f"switchyard bench run: {not_agent}; the target takes that port{elsewhere}", file=sys.stderr)
    if interrupted:
        print(f"switchyard bench run: interrupted; the report covers the {len(load.results)} calls that completed "
              "(endReason cancel)", file=sys.stderr)
        return INTERRUPTED
    return 0 if load.results else 1


def _compare(argv: list[str]) -> int:
    from switchyard_harness.bench import compare

    return compare.main(argv)


def _sched(argv: list[str]) -> int:
    from switchyard_harness.bench import sched_bench  # the scheduling benchmark's own module

    return int(sched_bench.main(argv) or 0)


def _isolation(argv: list[str]) -> int:
    from switchyard_harness.bench import isolation

    return isolation.main(argv)


def _agents(argv: list[str]) -> int:
    from switchyard_harness.bench import agents_bench

    return agents_bench.main(argv)


def _route(argv: list[str]) -> int:
    from switchyard_harness.bench import route

    return route.main(argv)


def _pool(argv: list[str]) -> int:
    from switchyard_harness.bench import pool

    return pool.main(argv)


def _fault(argv: list[str]) -> int:
    from switchyard_harness.bench import fault

    return fault.main(argv)


def _upstream(argv: list[str]) -> int:
    from switchyard_harness.bench import upstream

    return upstream.main(argv)


def _diff(argv: list[str]) -> int:
    from switchyard_harness.bench import diff

    return diff.main(argv)


def _http(argv: list[str]) -> int:
    from switchyard_harness.bench import http_bench

    return http_bench.main(argv)


def _retrieval(argv: list[str]) -> int:
    from switchyard_harness.bench import retrieval_quality

    return retrieval_quality.main(argv)


SUBCOMMANDS = {
    "run": _run, "compare": _compare, "sched": _sched, "isolation": _isolation, "agents": _agents,
    "route": _route, "pool": _pool, "fault": _fault, "upstream": _upstream, "retrieval": _retrieval, "diff": _diff,
    "http": _http,
}


def main(argv: list[str]) -> int:
    """Entry point of ``switchyard bench``; ``run`` when the first word is not a subcommand."""
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(
            "usage: switchyard bench [run|compare|sched|isolation|agents|route|pool|fault|upstream|retrieval|diff|http] "
            "[OPTIONS]\n\n"
            "  run        load-test RunTask, ghz JSON report (default)\n"
            "  compare    scenarios A-D (baseline, split+double buffer, fixed flush 10/20/50 ms, adaptive)\n"
            "  sched      scheduling benchmark\n"
            "  isolation  idle-dispatcher wait, and core TTFT with batch work running vs unloaded\n"
            "  agents     N react agents with tool calls: memory tiers, OOM, restored vs recomputed tokens\n"
            "  route      agent routing over many dispatcher replicas, simulated (affinity vs random, round-robin)\n"
            "  pool       the gateway's endpoint picker over 3 sim-openai replicas vs round robin; one killed\n"
            "  fault      kill -9 one of several local dispatchers under load; account for every call\n"
            "  upstream   one load straight at a model server and through Switchyard, taking turns; the knee\n"
            "  retrieval  retrieval quality (recall@k, MRR@10, nDCG@10) and time per query\n"
            "  diff       two ghz-format reports side by side with the change, and a PNG of both latency distributions\n"
            "  http       the HTTP face: submit at a rate, and RunTask over SSE vs gRPC at the same load\n\n"
            "Run 'switchyard bench SUBCOMMAND --help' for its options."
        )
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    if argv and not argv[0].startswith("-") and ":" not in argv[0]:
        # a target is host:port; a bare word is a mistyped subcommand
        print(f"switchyard bench: unknown subcommand {argv[0]!r}; expected one of {', '.join(SUBCOMMANDS)}, "
              f"or a target host:port{did_you_mean(argv[0], SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return _run(argv)
