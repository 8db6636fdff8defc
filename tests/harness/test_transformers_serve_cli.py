"""``python -m switchyard_harness.testing.transformers_serve``: the command line that serves a tiny Llama by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from switchyard_harness.testing import transformers_serve

pytestmark = pytest.mark.no_gpu


class _DiesAfterStart(transformers_serve.TransformersServer):
    """:class:`TransformersServer` (its settings, ``base_url`` and ``model``) whose server process exits on its own
    once ready."""

    def log_tail(self, chars: int = 4000) -> str:
        return "CB worker is dead and cannot accept request r-1"

    def __enter__(self) -> "_DiesAfterStart":
        self.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.wait()


def test_a_server_that_dies_is_reported_with_its_status_and_log_and_exit_status_1(tmp_path, monkeypatch, capsys):
    """The server killed (or crashed) while serving: the command exited 0 with nothing said after its 'ready' line,
    as if it had been stopped on purpose."""
    monkeypatch.setattr(transformers_serve, "build_tiny_llama", lambda model_dir: model_dir)
    monkeypatch.setattr(transformers_serve, "TransformersServer", _DiesAfterStart)
    code = transformers_serve.main(["--model-dir", str(tmp_path), "--port", "18999"])
    out = capsys.readouterr()
    assert "transformers serve ready" in out.out
    assert code == 1
    assert "transformers serve exited with status 3" in out.err, out.err
    assert "CB worker is dead" in out.err
