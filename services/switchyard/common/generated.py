"""Files generated from code and committed (the Grafana dashboard, the Prometheus rules)."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(out: Path, text: str, *, check: bool, root: Path, command: str) -> int:
    """Write ``text`` to ``out``, or with ``check`` only compare: 1 when ``out`` is stale, naming ``command``.

    Returns:
        The exit status: 0 written or up to date, 1 stale.
    """
    shown = out.relative_to(root) if out.is_relative_to(root) else out
    if check:
        if not out.is_file() or out.read_text() != text:
            print(f"{shown} is stale: run {command}", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {shown}")
    return 0
