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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama and its BPE tokenizer, built offline once per test session."""
    from switchyard_harness.testing.transformers_serve import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def transformers_server(tiny_llama_dir: Path):
    """A real ``transformers serve --continuous-batching --device cpu`` on 127.0.0.1.

    One server for the session (it takes about 10 s to start); tests must not depend on
    what other tests sent it before.
    """
    from switchyard_harness.testing.transformers_serve import TransformersServer

    with TransformersServer(tiny_llama_dir) as server:
        yield server
