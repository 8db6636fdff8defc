"""The up file's one reader (switchyard.common.up_files): where it is and what it records.

switchyard run, top, profile, bench http and the locustfile's watch all read it through
default_path and recorded_services; the locustfile had worked out the default path itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard.common.up_files import default_path, recorded_services

STACK = {"pid": 1, "services": {
    "orchestrator": {"address": "127.0.0.1:50051", "metrics_url": "http://127.0.0.1:9101/metrics", "pid": 2,
                     "http_port": 8080},
    "dispatcher": {"address": "127.0.0.1:50053", "metrics_url": "http://127.0.0.1:9103/metrics", "pid": 3},
}}


def test_default_path_is_the_variables_else_the_per_user_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHYARD_UP_FILE", str(tmp_path / "mine.json"))
    assert default_path() == tmp_path / "mine.json"
    monkeypatch.delenv("SWITCHYARD_UP_FILE")
    assert default_path().name == "up.json" and default_path().parent.name == f"switchyard-{os.getuid()}"


def test_the_locustfile_reads_the_same_default_path(tmp_path):
    """The locustfile runs under gevent with light imports; it reads the path through up_files too."""
    locustfile = Path(__file__).resolve().parent.parent / "locust" / "locustfile.py"
    assert "tempfile" not in locustfile.read_text()  # no second rule for where the file is
    env = {**os.environ, "SWITCHYARD_UP_FILE": str(tmp_path / "up.json")}
    (tmp_path / "up.json").write_text(json.dumps({**STACK, "pid": os.getpid()}))
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('lf', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.dispatcher_metrics_url('', 'http://127.0.0.1:8080'))")
    out = subprocess.run([sys.executable, "-c", code, str(locustfile)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "http://127.0.0.1:9103/metrics" in out.stdout and str(tmp_path / "up.json") in out.stdout


def test_recorded_services_reads_an_up_file(tmp_path):
    path = tmp_path / "up.json"
    path.write_text(json.dumps(STACK))
    services = recorded_services(path)
    assert services["orchestrator"]["http_port"] == 8080 and set(services) == {"orchestrator", "dispatcher"}


@pytest.mark.parametrize(("content", "error"), [
    (b"{not json", ValueError),
    (b"\xff\xfe binary", ValueError),
    (json.dumps({"pid": 1}).encode(), ValueError),  # a claim with no services yet, or another JSON file
    (json.dumps({"services": []}).encode(), ValueError),
    (json.dumps({"services": {"orchestrator": "127.0.0.1:1"}}).encode(), ValueError),
    (json.dumps([1, 2]).encode(), ValueError),
])
def test_a_file_that_is_not_an_up_file_is_a_value_error(tmp_path, content, error):
    path = tmp_path / "up.json"
    path.write_bytes(content)
    with pytest.raises(error):
        recorded_services(path)


def test_a_missing_file_or_a_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        recorded_services(tmp_path / "absent.json")
    with pytest.raises(IsADirectoryError):
        recorded_services(tmp_path)
