"""The up files of ``switchyard up`` whose launcher is gone.

``switchyard up`` records its stack's endpoints in an up file (``up.json`` in
the per-user folder, ``up-<pid>.json`` beside it for a second stack; see
switchyard.launcher) and removes it when it stops. A launcher killed with
``kill -9`` runs no clean-up, so its file stays, naming ports nothing serves:
``switchyard top`` and the locust watch file read a dead stack, and the next
``up`` found the folder holding a stack that is not there. Whoever reads the
shared up file next (``switchyard up``, ``switchyard top``, ``switchyard run``
and ``profile``, the locustfile, ``switchyard bench http``) ignores such a file
and removes it (:func:`remove_stale`). A file the user names to a viewer
(``switchyard top --up-file``, ``switchyard profile --up-file``) is the user's:
it is never removed, only said to be stale (:func:`gone_launcher`).

Light on imports: the locustfile calls it under gevent, without gRPC.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from switchyard.common import envs
from switchyard.common.children import pid_alive

SECOND_STACK = re.compile(r"up-\d+\.json")
"""The name of a second stack's up file (``up-<launcher pid>.json``)."""


def default_path() -> Path:
    """The up file ``switchyard up`` writes and its readers read: ``$SWITCHYARD_UP_FILE``, else
    ``<temp dir>/switchyard-<uid>/up.json`` (a second stack's is ``up-<pid>.json`` beside it)."""
    configured = envs.SWITCHYARD_UP_FILE.get()
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"switchyard-{os.getuid()}" / "up.json"


def recorded_services(path: Path) -> dict[str, dict[str, Any]]:
    """The services an up file records, by name (``orchestrator``, ``dispatcher``, ``dispatcher-2``...): each
    ``{"address": "host:port", "metrics_url": URL, "pid": int}``, the orchestrator's with ``http_port``.

    Raises:
        OSError: the file cannot be read (FileNotFoundError, IsADirectoryError...).
        ValueError: it is not an up file: not UTF-8 JSON (UnicodeDecodeError, JSONDecodeError), or no
            ``services`` object of objects in it.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services or not all(isinstance(s, dict) for s in services.values()):
        raise ValueError(f"{path} records no services")
    return services


def launcher_pid(path: Path) -> int | None:
    """The ``pid`` an up file records (its launcher's); None when it cannot be read (absent, being replaced,
    not an up file)."""
    try:
        pid = json.loads(path.read_text())["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def gone_launcher(path: Path) -> int | None:
    """The ``pid`` a stale up file records, its launcher's, which is no live process any more; None when the file
    cannot be read (absent, being replaced, not an up file) or its launcher lives. Removes nothing."""
    pid = launcher_pid(path)
    return None if pid is None or pid_alive(pid) else pid


def remove_stale(path: Path) -> list[tuple[Path, int]]:
    """Remove ``path`` and the ``up-<pid>.json`` files in its folder whose launcher is gone (their ``pid`` is no
    live process); a file that cannot be read, or whose launcher lives, is left as it is. For the shared up file
    only (:func:`default_path`): a file the user named is theirs (:func:`gone_launcher` says it is stale).

    Returns:
        (path, launcher pid) of each file removed, for the caller to say so; a file another reader removed first
        is not listed.
    """
    try:
        beside = sorted(p for p in path.parent.iterdir() if SECOND_STACK.fullmatch(p.name))
    except OSError:  # no folder yet: nothing to remove
        beside = []
    removed: list[tuple[Path, int]] = []
    for candidate in dict.fromkeys([path, *beside]):
        pid = gone_launcher(candidate)
        if pid is None:
            continue
        try:
            candidate.unlink()
        except OSError:
            continue
        removed.append((candidate, pid))
    return removed
