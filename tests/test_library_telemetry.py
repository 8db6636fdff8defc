"""No library of a Switchyard process calls home: ONNX Runtime's usage telemetry (1DS events to
mobile.events.data.microsoft.com) stays off in every process that imports ``switchyard``.

ONNX Runtime's official builds start their uploader as the module loads and send a first batch
some seconds later, through ``HTTPS_PROXY`` when set, so a refusing proxy records it as
``CONNECT mobile.events.data.microsoft.com:443``. Each check runs two interpreters side by side
under their own refusing proxies: a witness that imports onnxruntime alone (it shows this build does
call home, and how long it takes) and the one under test, which imports it the way Switchyard does. The two
start with the test session (tests/conftest.py), so that the wait passes while other tests run.
``tests/test_e2e.py`` checks the same for the whole stack of ``switchyard up``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from proxy_fixtures import NO_PROXY_VARIABLES, RefusingProxy, start_refusing_proxy
from switchyard.common.envs import LIBRARY_DEFAULTS

pytestmark = pytest.mark.slow

WITNESS_DEADLINE_S = 180  # how long the witness may take to call home before the check is skipped

# The import paths of the stack that can load onnxruntime: the retrieval service's query encoder.
UNDER_TEST = "import switchyard.retrieval.embedder; import onnxruntime"
WITNESS = "import onnxruntime"


def _start(code: str, proxy: RefusingProxy) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in (*NO_PROXY_VARIABLES, *LIBRARY_DEFAULTS)}
    env.update(proxy.environment())
    return subprocess.Popen(
        [sys.executable, "-c", f"{code}; import sys, time; print('imported', flush=True); time.sleep(3600)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


class TelemetryWatch:
    """The witness and the interpreter under test, each under its own refusing proxy, watched on a thread.

    The check waits for the witness's first batch (seconds) and as long again: started with the test session
    (tests/conftest.py, when the check is collected) that wait passes while other tests run.
    """

    def __init__(self) -> None:
        self.witness_proxy, self.proxy = start_refusing_proxy(), start_refusing_proxy()
        self.witness, self.proc = _start(WITNESS, self.witness_proxy), _start(UNDER_TEST, self.proxy)
        self.not_imported: str | None = None
        """Why an interpreter did not import onnxruntime (its first line, its stderr), if one did not."""
        self.imported_at: float | None = None
        """When both had imported it (time.monotonic())."""
        self.called_home_at: float | None = None
        """When the witness's proxy first saw a request (polled every 0.5 s from imported_at)."""
        self.done = threading.Event()
        """Set once imported_at and called_home_at are known, or the import failed, or WITNESS_DEADLINE_S passed."""
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        try:
            for proc in (self.witness, self.proc):
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if line != "imported\n":
                    proc.kill()
                    self.not_imported = f"{line!r}{proc.communicate()[1][-2000:]}"
                    return
            self.imported_at = time.monotonic()
            while not self.witness_proxy.requests and time.monotonic() - self.imported_at < WITNESS_DEADLINE_S:
                time.sleep(0.5)
            if self.witness_proxy.requests:
                self.called_home_at = time.monotonic()
        finally:
            self.done.set()

    def close(self) -> None:
        for p in (self.witness, self.proc):
            p.kill()
            p.communicate()
        for server in (self.witness_proxy, self.proxy):
            server.shutdown()
            server.server_close()


def test_onnxruntime_imported_by_switchyard_sends_no_telemetry(onnxruntime_telemetry_watch):
    watch: TelemetryWatch = onnxruntime_telemetry_watch
    watch.done.wait(WITNESS_DEADLINE_S + 120)  # the imports, then the witness's deadline
    if watch.not_imported is not None:
        pytest.fail(f"the interpreter did not import onnxruntime: {watch.not_imported}")
    if watch.called_home_at is None:
        pytest.skip(f"this onnxruntime build sent no telemetry in {WITNESS_DEADLINE_S} s: nothing to guard")
    assert watch.imported_at is not None
    assert any("events.data.microsoft.com" in line for line in watch.witness_proxy.requests), \
        watch.witness_proxy.requests
    # as long again as the witness needed, so a late first batch is caught too
    until = watch.called_home_at + (watch.called_home_at - watch.imported_at)
    time.sleep(max(0.0, until - time.monotonic()))
    assert watch.proc.poll() is None, watch.proc.communicate()[1][-2000:]
    assert watch.proxy.requests == [], watch.proxy.requests


def test_an_explicit_value_in_the_environment_is_kept():
    env = {**os.environ, "ORT_DISABLE_TELEMETRY": "0"}
    out = subprocess.run(
        [sys.executable, "-c", "import os, switchyard; print(os.environ['ORT_DISABLE_TELEMETRY'])"],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )
    assert out.stdout.strip() == "0"


def test_grpc_fork_support_is_off_in_every_switchyard_process_unless_asked_for():
    """Its fork handlers ran around the CPU pool's fork+exec and once aborted an orchestrator at start-up."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    script = "import os, switchyard; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                         check=True)
    assert out.stdout.strip() == "false"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                         env={**env, "GRPC_ENABLE_FORK_SUPPORT": "true"})
    assert out.stdout.strip() == "true"
