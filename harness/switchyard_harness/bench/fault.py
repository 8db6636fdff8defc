"""``switchyard bench fault``: kill -9 one dispatcher under load and account for every call.

Starts ``switchyard up --free-ports --dispatchers N`` (the stack's own
processes), runs RunTask streams from ``--concurrency`` workers (chat tasks of
a few agents each, so calls go through agent affinity) and SubmitTask calls
beside them, SIGKILLs one dispatcher at ``--kill-at`` seconds, and reports:

- calls spread over the dispatchers before the kill (their
  ``switchyard_ttft_seconds_count``), against the mean;
- every RunTask outcome: succeeded, or failed with its status, split by
  whether it had streamed tokens. The promise: calls that had streamed nothing
  are tried again on another replica (``switchyard_dispatcher_retries_total``)
  and succeed; calls cut mid-stream fail UNAVAILABLE naming the killed
  replica's address (the bench's stack shows addresses to its callers, the operator:
  :func:`operator_config`);
- recovery: from the kill until calls started after it no longer fail (the
  start of the last failing call that began after the kill; 0 when none did),
  and how the calls started in the 2 s after the kill fared;
- SubmitTask'd tasks: every one must reach a final state (SUCCEEDED or
  FAILED with its error), none lost.

Needs the retrieval index (``make index``, or ``--index-dir``), as ``switchyard up`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from switchyard_harness import json_output
from switchyard.common import outputs
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common import envs
from switchyard.common.channels import open_channel
from switchyard.launcher import UpProcess
from switchyard_harness.top import read as read_metrics
from switchyard_harness.top import total


@dataclass
class Call:
    """One RunTask: when it started and ended (seconds from the run's start), tokens seen, outcome."""

    start: float
    end: float = 0.0
    tokens: int = 0
    code: str = "OK"
    details: str = ""


@dataclass
class FaultReport:
    """What ``switchyard bench fault`` measured."""

    dispatchers: int
    victim: str
    victim_address: str
    kill_at_s: float
    spread_before_kill: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    succeeded: int = 0
    failed_after_tokens: int = 0
    failed_after_tokens_naming_victim: int = 0
    failed_before_tokens: int = 0
    other_failures: list[str] = field(default_factory=list)
    retries: float = 0.0
    recovery_s: float = 0.0
    started_within_2s_after_kill: int = 0
    succeeded_within_2s_after_kill: int = 0
    submitted: int = 0
    submitted_succeeded: int = 0
    submitted_failed: int = 0
    submitted_lost: int = 0
    submitted_errors: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        mean = sum(self.spread_before_kill.values()) / max(1, len(self.spread_before_kill))
        spread = ", ".join(f"{name} {count:.0f} ({(count - mean) / mean:+.0%})" if mean else f"{name} 0"
                           for name, count in self.spread_before_kill.items())
        return [
            f"switchyard bench fault: {self.dispatchers} dispatchers; SIGKILL {self.victim} "
            f"({self.victim_address}) at {self.kill_at_s:.1f} s",
            f"  calls before the kill, per dispatcher: {spread}",
            f"  RunTask calls: {self.calls}; succeeded {self.succeeded}; failed after streaming tokens "
            f"{self.failed_after_tokens} (UNAVAILABLE naming {self.victim_address}: "
            f"{self.failed_after_tokens_naming_victim}); failed before any token {self.failed_before_tokens}; "
            f"other failures {len(self.other_failures)}",
            f"  calls tried again on another replica before their first token: {self.retries:.0f}",
            f"  recovery: {self.recovery_s:.2f} s (calls started within 2 s after the kill: "
            f"{self.succeeded_within_2s_after_kill} of {self.started_within_2s_after_kill} succeeded)",
            f"  SubmitTask: {self.submitted} submitted; {self.submitted_succeeded} succeeded, "
            f"{self.submitted_failed} failed with an error, {self.submitted_lost} lost",
        ]


def _metric(url: str, name: str) -> float:
    """The sample ``name`` summed over all its label sets (e.g. every priority class of a histogram's count)."""
    return total(read_metrics(url), name)


async def _worker(stub: Any, wid: int, t0: float, stop_at: float, max_tokens: int, calls: list[Call]) -> None:
    k = 0
    while time.monotonic() < stop_at:
        call = Call(start=time.monotonic() - t0)
        calls.append(call)
        request = agent_pb2.RunTaskRequest(task_id=f"fault-{wid}-{k}", agent_id=f"agent-{wid}-{k % 4}",
                                           payload="say hello", task_type="chat", max_tokens=max_tokens)
        k += 1
        try:
            async for event in stub.RunTask(request, timeout=60):
                if event.HasField("token"):
                    call.tokens += 1
        except grpc.aio.AioRpcError as err:
            call.code, call.details = err.code().name, err.details() or ""
        call.end = time.monotonic() - t0


async def run_fault(orchestrator: str, dispatchers: dict[str, tuple[str, str, int]], orchestrator_metrics: str,
                    victim: str, *, concurrency: int = 24, duration_s: float = 10.0, kill_at_s: float = 4.0,
                    max_tokens: int = 64, submit: int = 60) -> FaultReport:
    """Load ``orchestrator``, SIGKILL dispatcher ``victim`` at ``kill_at_s``, account for everything.

    Args:
        dispatchers: name -> (address, metrics URL, pid) of every dispatcher.
    """
    address, _, pid = dispatchers[victim]
    report = FaultReport(len(dispatchers), victim, address, kill_at_s)
    before = {name: _metric(url, "switchyard_ttft_seconds_count") for name, (_, url, _) in dispatchers.items()}
    retries_before = _metric(orchestrator_metrics, "switchyard_dispatcher_retries_total")
    calls: list[Call] = []
    submitted: list[str] = []
    async with open_channel(orchestrator, peer="orchestrator") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        t0 = time.monotonic()
        stop_at = t0 + duration_s

        run = uuid.uuid4().hex[:8]  # the task store outlives a run: another run's task ids are not this one's

        async def submitter() -> None:
            for i in range(submit):
                await asyncio.sleep(max(0.0, t0 + i * duration_s / max(1, submit) - time.monotonic()))
                request = agent_pb2.RunTaskRequest(task_id=f"submitted-{run}-{i}", agent_id=f"submitter-{i % 8}",
                                                   payload="say hello", task_type="chat", max_tokens=max_tokens)
                try:
                    await stub.SubmitTask(request, timeout=30)
                    submitted.append(request.task_id)
                except grpc.aio.AioRpcError as err:
                    report.submitted_errors.append(f"SubmitTask {request.task_id}: {err.code().name} {err.details()}")

        async def killer() -> None:
            await asyncio.sleep(kill_at_s)
            report.spread_before_kill = {
                name: _metric(url, "switchyard_ttft_seconds_count") - before[name]
                for name, (_, url, _) in dispatchers.items()
            }
            os.kill(pid, signal.SIGKILL)
            report.kill_at_s = time.monotonic() - t0

        await asyncio.gather(killer(), submitter(),
                             *(_worker(stub, w, t0, stop_at, max_tokens, calls) for w in range(concurrency)))
        report.submitted = len(submitted)
        pending = set(submitted)
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for task_id in sorted(pending):
                try:
                    status = await stub.GetTaskStatus(agent_pb2.GetTaskStatusRequest(task_id=task_id), timeout=10)
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.NOT_FOUND:
                        report.submitted_lost += 1
                        pending.discard(task_id)
                    continue
                if status.state == agent_pb2.SUCCEEDED:
                    report.submitted_succeeded += 1
                    pending.discard(task_id)
                elif status.state == agent_pb2.FAILED:
                    report.submitted_failed += 1
                    report.submitted_errors.append(f"{task_id}: {status.error}")
                    pending.discard(task_id)
            await asyncio.sleep(0.2)
        report.submitted_lost += len(pending)
    report.retries = _metric(orchestrator_metrics, "switchyard_dispatcher_retries_total") - retries_before
    report.calls = len(calls)
    failing_after_kill = []
    for call in calls:
        if call.code == "OK":
            report.succeeded += 1
        elif call.code == "UNAVAILABLE" and call.tokens:
            report.failed_after_tokens += 1
            report.failed_after_tokens_naming_victim += address in call.details
        elif call.code == "UNAVAILABLE":
            report.failed_before_tokens += 1
        else:
            report.other_failures.append(f"{call.code}: {call.details}")
        if call.code != "OK" and call.start >= report.kill_at_s:
            failing_after_kill.append(call.start)
        if report.kill_at_s <= call.start < report.kill_at_s + 2:
            report.started_within_2s_after_kill += 1
            report.succeeded_within_2s_after_kill += call.code == "OK"
    report.recovery_s = max(failing_after_kill) - report.kill_at_s if failing_after_kill else 0.0
    return report


def operator_config(folder: Path) -> Path:
    """A copy of the config folder (``SWITCHYARD_CONFIG_DIR``, else ``config/``) in ``folder`` whose orchestrator
    shows addresses to its callers (``orchestrator.show_addresses_to_callers``): the bench is the operator's, and
    counts the cut streams whose error names the killed replica's address, which callers otherwise read hidden."""
    config = folder / "config"
    shutil.copytree(envs.SWITCHYARD_CONFIG_DIR.get(), config)
    path = config / "switchyard.json"
    settings = json.loads(path.read_text())
    settings.setdefault("orchestrator", {})["show_addresses_to_callers"] = True
    path.write_text(json.dumps(settings))
    return config


def main(argv: list[str]) -> int:
    """Entry point of ``switchyard bench fault``."""
    parser = argparse.ArgumentParser(prog="switchyard bench fault", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dispatchers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=24, help="RunTask workers (24)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load (10)")
    parser.add_argument("--kill-at", type=float, default=4.0, help="seconds into the load (4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per call (64)")
    parser.add_argument("--submit", type=int, default=60, help="SubmitTask calls spread over the load (60)")
    parser.add_argument("--index-dir", help="retrieval index (default: the config's, data/index)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    outputs.refuse_unwritable(parser, ("--json", args.json))  # now, not after the run
    if not 2 <= args.dispatchers <= 64:  # switchyard up's bound
        parser.error(f"--dispatchers: expected 2 (one is killed) to 64, got {args.dispatchers}")
    if not 0 < args.duration < math.inf:  # inf loaded forever; nan read as no load
        parser.error(f"--duration: expected a finite number of seconds > 0, got {args.duration}")
    for flag, value, least in (("--concurrency", args.concurrency, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--submit", args.submit, 0)):
        if value < least:
            parser.error(f"{flag}: expected at least {least}, got {value}")
    if not 0 < args.kill_at < args.duration:
        parser.error(f"--kill-at: expected between 0 and --duration ({args.duration}), got {args.kill_at}")
    folder = tempfile.TemporaryDirectory()
    stack = UpProcess(args.index_dir, args=("--dispatchers", str(args.dispatchers),
                                            "--config-dir", str(operator_config(Path(folder.name)))))
    try:
        if not stack.started(300):
            print("switchyard bench fault: the stack did not become healthy:\n" + "".join(stack.lines), file=sys.stderr)
            return 1
        endpoints = stack.endpoints()
        dispatchers = {name: ep for name, ep in endpoints.items() if name.startswith("dispatcher")}
        report = asyncio.run(run_fault(
            endpoints["orchestrator"][0], dispatchers, endpoints["orchestrator"][1], sorted(dispatchers)[-1],
            concurrency=args.concurrency, duration_s=args.duration, kill_at_s=args.kill_at,
            max_tokens=args.max_tokens, submit=args.submit,
        ))
    finally:
        stack.stop()
        folder.cleanup()
    print("\n".join(report.lines()))
    for line in report.other_failures[:5] + report.submitted_errors[:5]:
        print(f"    {line}")
    if args.json:
        args.json.write_text(json_output.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
    ok = report.failed_before_tokens == 0 and not report.other_failures and report.submitted_lost == 0
    return 0 if ok else 1
