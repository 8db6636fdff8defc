"""Shared fixtures.

``pydoc_index_dir`` builds the default retrieval index (CPython's documentation
topics, embedded with all-MiniLM-L6-v2) once per test session.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "config"


@pytest.fixture(scope="session")
def pydoc_index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the default index (pydoc_data topics), built once per session."""
    from switchyard.common.config import load_config
    from switchyard.retrieval.indexer import build_index

    out = tmp_path_factory.mktemp("pydoc-index")
    started = time.monotonic()
    manifest = build_index([], out, load_config(CONFIG_DIR), progress=False)
    print(f"\npydoc index: {manifest.count} passages, {manifest.dims} dims, built in {time.monotonic() - started:.1f} s")
    return out
