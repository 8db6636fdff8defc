"""Calls through the whole stack against a real model server: stock ``transformers serve``.

Usage::

    python tools/upstream_soak.py [--calls 1000] [--concurrency 8] [--max-tokens 16] \
        [--index-dir data/index] [--base-url URL --model ID] [--out report.json]

Without ``--base-url`` it builds the tiny random-weight Llama (``switchyard_harness.testing.transformers_serve``,
offline, seconds) and starts ``transformers serve MODEL --continuous-batching --device cpu`` on
127.0.0.1. It then starts the stack as users run it (``switchyard up --free-ports``, three processes)
with ``SWITCHYARD_ENGINE=openai`` and ``model_gateway.base_url`` pointed at the server, runs
``--calls`` RunTask calls of chat, rag_answer and react_loop in turn (``switchyard bench``'s load
generator), and prints the calls by status code, the errors, calls/s, the latency percentiles and the
dispatcher's ``switchyard_upstream_stream_endings_total`` (how the server ended its streams).

Target (issue 22): stock ``transformers serve``, chat, rag_answer and react_loop, 1,000 calls,
0 errors. Exit status 0 when every call returned OK, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "services"), str(REPO / "harness")]

from switchyard_harness.bench.calldata import parse_calldata  # noqa: E402
from switchyard_harness.bench.loadgen import LoadPlan, run_load  # noqa: E402
from switchyard_harness.bench.report import build_report, summary_text  # noqa: E402
from switchyard.launcher import UpProcess  # noqa: E402
from switchyard_harness.arg_types import count, max_tokens, model_server_url, positive  # noqa: E402
from switchyard_harness.testing.transformers_serve import TransformersServer, build_tiny_llama  # noqa: E402

TASKS = ("chat", "rag_answer", "react_loop")


def gateway_config(out: Path, base_url: str, model: str) -> Path:
    """A copy of config/ with model_gateway pointed at ``base_url`` serving ``model`` (no key, no fallback)."""
    shutil.copytree(REPO / "config", out)
    queue = json.loads((out / "queue.json").read_text())
    queue["model_gateway"].update(base_url=base_url, default_model=model, fallback_model="", model_map={},
                                  api_key_required=False)
    (out / "queue.json").write_text(json.dumps(queue, indent=2))
    return out


def endings(metrics_url: str) -> dict[str, float]:
    """``switchyard_upstream_stream_endings_total`` by ending, scraped from a dispatcher's /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = re.findall(r'^switchyard_upstream_stream_endings_total\{ending="(\w+)"\} (\S+)$', text, re.M)
    return {ending: float(value) for ending, value in found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=count, default=1000, help="RunTask calls (default 1000)")
    parser.add_argument("--concurrency", type=count, default=8, help="calls at once (default 8)")
    parser.add_argument("--max-tokens", type=max_tokens, default=16, help="max_tokens of each task (default 16)")
    parser.add_argument("--timeout", type=positive, default=60.0, help="deadline per call, seconds (default 60)")
    parser.add_argument("--index-dir", help="retrieval index for rag_answer (default: the config's data/index)")
    parser.add_argument("--base-url", type=model_server_url, help="an OpenAI-compatible server already running (default: start "
                        "transformers serve with the tiny Llama)")
    parser.add_argument("--model", help="the model id --base-url serves")
    parser.add_argument("--model-dir", type=Path, help="where to build (or find) the tiny Llama")
    parser.add_argument("--out", help="write the ghz-format report here")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="upstream-soak-"))
    server = None
    stack = None
    try:
        if args.base_url:
            base_url, model = args.base_url, args.model or ""
        else:
            model_dir = build_tiny_llama(args.model_dir or work / "tiny-llama")
            server = TransformersServer(model_dir).start()
            base_url, model = server.base_url, server.model
        print(f"model server: {base_url} serving {model}", flush=True)
        cfg = gateway_config(work / "config", base_url, model)
        stack = UpProcess(args.index_dir, env={"SWITCHYARD_ENGINE": "openai", "SWITCHYARD_CONFIG_DIR": str(cfg)})
        if not stack.started(300):
            print("switchyard up did not become healthy:\n" + "".join(stack.lines), file=sys.stderr)
            return 1
        points = stack.endpoints()
        host = points["orchestrator"][0]
        dispatcher_metrics = points["dispatcher"][1]
        calldata = parse_calldata([
            {"task_id": f"soak-{task}-{{{{.RequestNumber}}}}", "agent_id": "agent-{{.RequestNumber}}",
             "payload": "Write a long story about the with statement.", "task_type": task,
             "max_tokens": args.max_tokens, "priority": priority}
            for task, priority in zip(TASKS, ("CORE", "NORMAL", "BATCH"))
        ])
        plan = LoadPlan(host=host, calldata=calldata, total=args.calls, concurrency=args.concurrency,
                        timeout_s=args.timeout)
        load = run_load(plan)
        report = build_report(load, plan, name="upstream soak: transformers serve")
        print(summary_text(report))
        codes = report["statusCodeDistribution"]
        errors = sum(n for code, n in codes.items() if code != "OK")
        print(f"\nupstream stream endings (dispatcher): {endings(dispatcher_metrics)}")
        print(f"calls {report['count']}, errors {errors}, {report['rps']:.1f} calls/s, "
              f"concurrency {args.concurrency}, max_tokens {args.max_tokens}, tasks {'/'.join(TASKS)} in turn")
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return 0 if errors == 0 and report["count"] == args.calls else 1
    finally:
        if stack is not None:
            stack.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
