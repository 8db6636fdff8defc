"""`switchyard up --free-ports` as a test fixture: three real processes, output collected."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from switchyard.launcher import UpProcess

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def loop_executor_config(folder: Path) -> Path:
    """A copy of the shipped ``config/`` in ``folder``, its orchestrator's CPU work on the event loop
    (``orchestrator.cpu_executor`` loop): for a stack whose test is not of the CPU pool, whose spawned
    workers cost seconds of every start. Pass it as ``args=("--config-dir", str(...))``."""
    config = folder / "config"
    shutil.copytree(CONFIG_DIR, config)
    path = config / "switchyard.json"
    settings = json.loads(path.read_text())
    settings["orchestrator"]["cpu_executor"] = "loop"
    path.write_text(json.dumps(settings))
    return config


class UpStack(UpProcess):
    """``switchyard up --free-ports`` on ``index_dir`` (see :class:`switchyard.launcher.UpProcess`),
    with lookups by service name for tests."""

    def __init__(self, index_dir: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        super().__init__(str(index_dir), env, args)

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
        if not self.started(timeout):
            self.stop()
            raise AssertionError("switchyard up did not become healthy:\n" + "".join(self.lines))

