"""Debian's Prometheus tools for the tests: ``promtool`` and the ``prometheus`` server.

``.ci/run`` installs them (``apt-get install prometheus``). Outside CI a test
that needs one skips, naming the package, when it is absent; in CI (``CI`` set)
it fails instead, so a CI run can never pass without having run them.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str) -> str:
    """The path of ``tool`` (promtool or prometheus); skip, or fail in CI, when it is not installed."""
    path = shutil.which(tool)
    if path is not None:
        return path
    why = f"{tool} not found: install Debian's prometheus package (apt-get install prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; .ci/run installs it, so CI must have it")
    pytest.skip(why)
