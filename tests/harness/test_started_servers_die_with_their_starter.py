"""Servers a benchmark or tool starts end when it ends, however it ends (``kill -9``, a timeout's SIGKILL).

Before: ``UpProcess`` (``switchyard bench fault``, ``tools/upstream_soak.py``, tests) left its ``switchyard up``
serving, orphaned, with its Redis and ports; ``sim_openai.spawn`` (``bench agents --stack --stack-engine
openai``) left its sim-openai; ``tools/soak.py`` left its sim-openai and three services. Each now asks for
the parent-death signal (``switchyard.common.children.dying_with_parent``), as ``switchyard up``'s own
children do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from stack_fixtures import loop_executor_config

from switchyard.common import children

pytestmark = pytest.mark.no_gpu

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT / "harness")])}


def _orphans_after_kill_9(script: str, tmp_path: Path, **env: str) -> list[int]:
    """Run ``script`` (it prints the pids it started on its last line, then sleeps) in a child Python, kill -9
    it once the line comes, and return the pids still alive after a wait for the parent-death signal's work."""
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**ENV, **env}, cwd=tmp_path)
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line.startswith("pids "), line
        pids = [int(p) for p in line.split()[1:]]
        assert pids and all(children.pid_alive(p) for p in pids)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 60  # a stack drains before it exits: a bound on the wait, not a timing
    while time.monotonic() < deadline and any(children.pid_alive(p) for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if children.pid_alive(p)]
    for pid in alive:  # clean-up of a failed run
        os.kill(pid, signal.SIGKILL)
    return alive


def test_a_spawned_sim_openai_ends_with_its_starter(tmp_path):
    script = ("import time\n"
              "from switchyard_harness import sim_openai\n"
              "server = sim_openai.spawn()\n"
              "print('pids', server.process.pid, flush=True)\n"
              "time.sleep(600)\n")
    assert _orphans_after_kill_9(script, tmp_path) == []


def test_an_up_process_ends_with_its_starter(tmp_path, pydoc_index_dir):
    # the pids checked are the launcher's and its services': the CPU pool's spawned workers (whose kill -9 cases
    # test_up_durability checks) would only add seconds to the start
    config = loop_executor_config(tmp_path)
    script = ("import sys, time\n"
              "from switchyard.launcher import UpProcess\n"
              f"stack = UpProcess({str(pydoc_index_dir)!r})\n"
              "if not stack.ready.wait(240):\n"
              "    sys.exit(''.join(stack.lines))\n"
              "print('pids', stack.proc.pid, *(pid for _, _, pid in stack.endpoints().values()), flush=True)\n"
              "time.sleep(600)\n")
    assert _orphans_after_kill_9(script, tmp_path, SWITCHYARD_CONFIG_DIR=str(config)) == []


def test_the_soak_tools_stack_ends_with_the_tool(tmp_path, pydoc_index_dir):
    script = ("import importlib.util, sys, time\n"
              "from pathlib import Path\n"
              f"spec = importlib.util.spec_from_file_location('soak', {str(ROOT / 'tools' / 'soak.py')!r})\n"
              "soak = importlib.util.module_from_spec(spec)\n"
              "spec.loader.exec_module(soak)\n"
              "stack = soak.Stack(Path('.'))\n"
              "stack.start()\n"
              "print('pids', *(p.pid for p in stack.procs.values()), flush=True)\n"
              "time.sleep(600)\n")
    assert _orphans_after_kill_9(script, tmp_path, SWITCHYARD_INDEX_DIR=str(pydoc_index_dir)) == []


def test_no_parent_death_signal_is_asked_off_the_main_thread():
    """The kernel sends it when the thread that forked ends: a child started from a worker thread would be
    stopped as that thread ends, so none is asked there (its starter's own stop ends it)."""
    found: list[object] = []
    worker = threading.Thread(target=lambda: found.append(children.dying_with_parent(["true"])))
    worker.start()
    worker.join()
    assert found == [["true"]]
    assert (children.dying_with_parent(["true"]) != ["true"]) == children.SUPPORTED


async def test_children_started_beside_a_running_grpc_server_start():
    """A ``preexec_fn`` runs the interpreter's at-fork hooks in the child, gRPC's among them: beside a running
    gRPC server (a test restarting its model server while the stack runs, a service starting its Redis), 2 to 3
    children in 20 died of SIGSEGV before their program started. The stub execs them with no Python run
    between fork and exec in this process."""
    import asyncio

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def busy() -> None:
                while True:
                    await stub.Check(health_pb2.HealthCheckRequest())

            caller = asyncio.ensure_future(busy())
            await asyncio.sleep(0.1)
            codes = []
            for _ in range(30):
                child = subprocess.Popen(children.dying_with_parent([sys.executable, "-I", "-S", "-c", "pass"]))
                while child.poll() is None:
                    await asyncio.sleep(0.005)  # the gRPC calls go on meanwhile
                codes.append(child.returncode)
            caller.cancel()
    finally:
        await server.stop(None)
    assert codes == [0] * 30


@pytest.mark.skipif(not children.SUPPORTED, reason="no parent-death signal here: the command runs as it is")
def test_the_stub_hands_its_command_the_signal_dispositions_popen_would():
    """Popen restores the signals Python ignores (SIGPIPE, SIGXFSZ) before it execs a command (restore_signals);
    the stub is a Python whose own start ignores them again, and an ignored signal stays ignored across execve:
    a command behind it ran with SIGPIPE ignored (a writer to a closed pipe got EPIPE for ever instead of ending)."""
    command = ["grep", "^SigIgn:", "/proc/self/status"]
    direct = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    behind = subprocess.run(children.dying_with_parent(command), capture_output=True, text=True, check=True).stdout
    assert behind == direct, (behind, direct)


@pytest.mark.skipif(not children.SUPPORTED, reason="no parent-death signal here: the command is returned as it is")
def test_a_command_that_is_no_executable_is_refused_here_as_popen_refuses_it(tmp_path):
    """Behind the stub, a missing or non-executable program failed in the child (exit status 1, nothing said), where
    Popen raises FileNotFoundError in the starter, which the embedded Redis names."""
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    for program in (str(tmp_path / "missing"), str(script)):
        with pytest.raises(FileNotFoundError) as caught:
            children.dying_with_parent([program, "--port", "0"])
        assert caught.value.filename == program
