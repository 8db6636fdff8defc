"""Which processes export the DRAM tier's series: those that use the tier."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from switchyard.launcher import free_port, healthy

pytestmark = pytest.mark.no_gpu


def test_a_dispatcher_whose_engine_keeps_no_kv_exports_no_dram_tier_series():
    """The openai engine keeps no KV state, so its dispatcher opens no DRAM tier: it exported switchyard_dram_up
    0 from its start to its end, Redis up, read as 'down' on the dashboard's DRAM panel beside the orchestrator's
    1 (and by any alert on it)."""
    port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
    env.update(SWITCHYARD_ENGINE="openai", SWITCHYARD_UPSTREAM_BASE_URL="http://127.0.0.1:1/v1",
               SWITCHYARD_UPSTREAM_MODEL="m", SWITCHYARD_UPSTREAM_FALLBACK_MODEL="none",
               SWITCHYARD_UPSTREAM_API_KEY_REQUIRED="false")
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "serve", "dispatcher", "--port", str(port),
                             "--metrics-port", str(metrics_port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # start-up (a hang guard of 120 s)
            if healthy(f"127.0.0.1:{port}", "agent.InferenceService"):
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        proc.terminate()
        proc.wait(60)
    assert "switchyard_upstream_in_flight" in scrape  # the openai engine's own series are there
    assert "switchyard_dram_up" not in scrape and "switchyard_dram_outages_total" not in scrape
