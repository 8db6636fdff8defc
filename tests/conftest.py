"""Shared fixtures.

``pydoc_index_dir`` is the default retrieval index (CPython's documentation
topics, embedded with all-MiniLM-L6-v2): a copy of the one ``make index`` built
(``make test`` builds it first) where that one is current, else built once per
test session.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "config"


def pytest_sessionstart(session) -> None:
    """Ctrl-C reaches the commands the tests start, however the suite itself was started. A process started in
    the background by a shell without job control (``cmd &`` in a script, ``( cmd & )``) inherits SIGINT ignored,
    and every process it starts keeps it ignored across exec: the tests that send a command SIGINT (as a
    terminal's Ctrl-C) and wait for its exit 130 waited out their timeouts and failed. A handled signal is reset
    to its default at exec, so the suite's own process handles it (Python's KeyboardInterrupt, as in a
    terminal)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _current_default_index(config) -> Path | None:
    """``data/index`` when it holds the default index as this tree builds it, else None.

    Current: complete (a manifest, written last, and the query encoder), built from
    the default corpus (not a user's own files) with this config's chunking and the
    index format, and newer than every source file of the indexer (an index from
    older code is rebuilt, not reused).
    """
    from switchyard.retrieval.index import DEFAULT_CORPUS, FORMAT_VERSION, MANIFEST_FILE, Manifest

    folder = REPO / "data" / "index"
    manifest_file, encoder = folder / MANIFEST_FILE, folder / "query_encoder.onnx"
    if not (manifest_file.is_file() and encoder.is_file()):
        return None
    manifest = Manifest.model_validate_json(manifest_file.read_text())
    settings = config.retrieval
    if (manifest.format_version, manifest.corpus, manifest.chunk_tokens, manifest.chunk_overlap_tokens,
            manifest.lexical) != (FORMAT_VERSION, DEFAULT_CORPUS, settings.chunk_tokens,
                                  settings.chunk_overlap_tokens, "bm25"):  # not a user's own index either
        return None
    built = min(manifest_file.stat().st_mtime, encoder.stat().st_mtime)
    sources = [*(REPO / "services" / "switchyard" / "retrieval").glob("*.py"), *CONFIG_DIR.glob("*")]
    if any(source.stat().st_mtime > built for source in sources):
        return None
    return folder


@pytest.fixture(scope="session")
def pydoc_index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the default index (pydoc_data topics): ``make index``'s copy, else built once."""
    from switchyard.common.config import load_config
    from switchyard.retrieval.indexer import build_index

    config = load_config(CONFIG_DIR)
    out = tmp_path_factory.mktemp("pydoc-index")
    started = time.monotonic()
    built = _current_default_index(config)
    if built is not None:  # a copy: tests may add to or break their index folder
        shutil.copytree(built, out, dirs_exist_ok=True)
        print(f"\npydoc index: copied from {built.relative_to(REPO)} in {time.monotonic() - started:.1f} s")
        return out
    manifest = build_index([], out, config, progress=False)
    print(f"\npydoc index: {manifest.count} passages, {manifest.dims} dims, built in {time.monotonic() - started:.1f} s")
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama and its BPE tokenizer, built offline once per test session."""
    from switchyard_harness.testing.transformers_serve import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def transformers_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real ``transformers serve --continuous-batching --device cpu`` on 127.0.0.1.

    One server for the session (it takes about 10 s to start); tests must not depend on
    what other tests sent it before. Its continuous-batching logger is set to DEBUG (by a
    ``sitecustomize`` on its PYTHONPATH; ``--log-level`` does not reach that logger), so that it
    logs "Request <id> finished: ... decode_len = N" when a request ends by itself (max_tokens,
    EOS); a request cancelled because its client went away is dropped from the batch without that
    line (transformers ``continuous_batching/requests.py`` ``RequestStatus`` setter,
    ``scheduler.py`` ``clear_cancelled_requests``). The request id is the X-Request-Id the gateway
    sends. That logger's DEBUG lines are a few per request, not per step.
    """
    import os

    from switchyard_harness.testing.transformers_serve import TransformersServer

    site = tmp_path_factory.mktemp("cb-debug-logging")
    (site / "sitecustomize.py").write_text(
        "import logging\nlogging.getLogger('ContinuousBatchingLogger').setLevel(logging.DEBUG)\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    with TransformersServer(tiny_llama_dir, env={"PYTHONPATH": path}) as server:
        yield server


TELEMETRY_CHECK = "test_library_telemetry.py::test_onnxruntime_imported_by_switchyard_sends_no_telemetry"


@pytest.fixture(scope="session", autouse=True)
def onnxruntime_telemetry_watch(request: pytest.FixtureRequest):
    """tests/test_library_telemetry.py's witness and interpreter under test, started with the session when that
    check is collected (else None): the check waits for the witness's first upload and as long again (about
    20 s), a wait that then passes while the other tests run."""
    if not any(item.nodeid.endswith(TELEMETRY_CHECK) for item in request.session.items):
        yield None
        return
    from test_library_telemetry import TelemetryWatch

    watch = TelemetryWatch()
    try:
        yield watch
    finally:
        watch.close()
