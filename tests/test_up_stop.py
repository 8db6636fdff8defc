"""``switchyard up``'s stop: how long it lets each service take before it kills it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from switchyard.launcher import Child, _stop

pytestmark = pytest.mark.no_gpu

# A service that drains as the orchestrator does on SIGTERM: it takes ``seconds`` before it exits 0.
SLOW_STOP = """
import signal, sys, time
def stop(*_):
    time.sleep({seconds})
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _child(kind: str, seconds: float) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_STOP.format(seconds=seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # its handler is installed
    return Child(name=kind, port=0, metrics_port=0, proc=proc, kind=kind)


def test_the_orchestrator_gets_the_whole_of_its_own_stop_before_it_is_killed(capsys):
    """The orchestrator's stop is the streams' drain (server.shutdown_grace_s), then the running submitted tasks'
    (server.shutdown_grace_s again), then recording them FAILED: with both kinds of work in flight it took over
    grace + 5 s, and `switchyard up` killed it ('orchestrator did not stop within 15 s; killing it') before it had
    recorded its tasks, which were left to the orphan rule. Here grace is 0.5 s: its stop takes 6.5 s, past the
    5.5 s it was given, and within the 2 x grace + 11 s (12 s) it now gets."""
    orchestrator = _child("orchestrator", 6.5)
    try:
        _stop([orchestrator], 0.5)
    finally:
        orchestrator.proc.kill()
        orchestrator.proc.wait()
    assert "killing it" not in capsys.readouterr().err
    assert orchestrator.proc.returncode == 0
