"""A config folder whose DRAM tier and task store are another stack's: what a bench or tool run beside a running
``switchyard up`` finds in ``config/`` (its Redis on ``[dram] port``, its ``data/tasks.sqlite3``). A run that
keeps to its own leaves both alone."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def other_stack_config(tmp_path: Path, redis_port: int | None = None) -> tuple[Path, Path]:
    """(config folder, the other stack's task store path, which no run may create): a copy of the shipped config
    whose ``[dram] port`` is ``redis_port`` (the other stack's Redis; not embedded here) or, by default, a port
    nothing listens on, and whose ``orchestrator.task_store.sqlite_path`` is under ``tmp_path/theirs``."""
    config_dir = tmp_path / "config"
    shutil.copytree(ROOT / "config", config_dir)
    policy_file = config_dir / "memory_policy.toml"
    policy = policy_file.read_text()
    if redis_port is None:
        with socket.socket() as sock:  # a port nothing listens on: the configured Redis, absent
            sock.bind(("127.0.0.1", 0))
            redis_port = sock.getsockname()[1]
    else:
        policy = policy.replace("embedded = true", "embedded = false", 1)
    policy_file.write_text(policy.replace("port = 6379", f"port = {redis_port}", 1))
    their_store = tmp_path / "theirs" / "tasks.sqlite3"
    settings = config_dir / "switchyard.json"
    settings.write_text(settings.read_text().replace('"data/tasks.sqlite3"', json.dumps(str(their_store)), 1))
    return config_dir, their_store
