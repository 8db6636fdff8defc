"""`switchyard up --free-ports` as a test fixture: three real processes, output collected."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path


class UpStack:
    """``switchyard up --free-ports`` on ``index_dir``; output collected on a thread.

    ``env`` adds variables, ``args`` options of ``switchyard up``; the caller's ``OTEL_*`` variables are dropped so that
    only a test that asks for tracing gets it.
    """

    def __init__(self, index_dir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        full = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
        full.update(SWITCHYARD_INDEX_DIR=str(index_dir), PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard.cli", "up", "--free-ports", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("Try: switchyard run"):
                self.ready.set()

    def _line(self, name: str) -> re.Match[str]:
        for line in self.lines:
            if m := re.match(rf"\s+{name}\s+(\S+:\d+)\s+metrics (\S+)", line):
                return m
        raise AssertionError(f"{name} endpoints not printed:\n{''.join(self.lines)}")

    def address(self, name: str) -> str:
        return self._line(name).group(1)

    def metrics_url(self, name: str) -> str:
        return self._line(name).group(2)

    def redis_address(self) -> str:
        """host:port of the embedded DRAM-tier Redis that ``switchyard up`` started."""
        for line in self.lines:
            if m := re.match(r"\s+redis\s+(\S+:\d+)\s+DRAM tier, embedded", line):
                return m.group(1)
        raise AssertionError(f"no embedded Redis printed:\n{''.join(self.lines)}")

    def wait_ready(self, timeout: float = 240) -> None:
        if not self.ready.wait(timeout):
            self.stop()
            raise AssertionError("switchyard up did not become healthy:\n" + "".join(self.lines))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
