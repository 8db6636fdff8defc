"""RetrievalService over real gRPC: answers from the pydoc index, field errors, queue saturation, spans."""

import asyncio
import io
import json
import shutil
import contextlib
from pathlib import Path
from typing import AsyncIterator

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import load_config
from switchyard.common.server import running
from switchyard.retrieval import service as service_module
from switchyard.retrieval.index import IndexMismatchError, IndexNotFoundError, load_index
from switchyard.retrieval.indexer import main as index_main
from switchyard.retrieval.service import RetrievalService
from switchyard.common.channels import open_channel

pytestmark = pytest.mark.slow  # loads the embedding model and the index

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def _config(index_dir, **overrides):
    return load_config(CONFIG_DIR).with_overrides(**{"retrieval.index_dir": str(index_dir), **overrides})


@contextlib.asynccontextmanager
async def _serve(config) -> AsyncIterator[tuple[RetrievalService, agent_pb2_grpc.RetrievalServiceStub]]:
    service = RetrievalService(config)
    async with running([service], config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            yield service, agent_pb2_grpc.RetrievalServiceStub(channel)
        finally:
            await channel.close()


async def _hold_workers(service: RetrievalService, release: asyncio.Event, extra: int = 0) -> None:
    """Occupy every retrieval worker (and ``extra`` queue slots) until ``release`` is set."""
    for _ in range(service.queue.config.workers):
        service.queue.submit(release.wait)
    while service.queue.busy < service.queue.config.workers:
        await asyncio.sleep(0.001)
    for _ in range(extra):
        service.queue.submit(release.wait)


@pytest.mark.parametrize("hybrid", [True, False])
async def test_with_statement_question_retrieves_the_with_topic(pydoc_index_dir, hybrid):
    async with _serve(_config(pydoc_index_dir, **{"retrieval.hybrid": hybrid})) as (_, stub):
        reply = await stub.Retrieve(agent_pb2.RetrieveRequest(query="How does the with statement work?", top_k=5))
    titles = [p.title for p in reply.passages]
    print("top titles:", titles, "embed_s", reply.embed_s, "search_s", reply.search_s)
    assert "with" in titles
    with_passage = next(p for p in reply.passages if p.title == "with")
    assert with_passage.source == "pydoc_data.topics:with"
    assert "with" in with_passage.text
    assert len(reply.passages) == 5
    scores = [p.score for p in reply.passages]
    assert all(-1 <= s <= 1 for s in scores)
    if not hybrid:  # hybrid orders by the fused ranking; the score stays each passage's cosine similarity
        assert scores == sorted(scores, reverse=True)
    assert reply.queue_wait_s >= 0 and reply.embed_s > 0 and reply.search_s > 0


async def test_top_k_zero_means_the_configured_default(pydoc_index_dir):
    async with _serve(_config(pydoc_index_dir, **{"retrieval.default_top_k": 3})) as (_, stub):
        reply = await stub.Retrieve(agent_pb2.RetrieveRequest(query="What does yield do?"))
    assert len(reply.passages) == 3


@pytest.mark.parametrize(
    "request_, field",
    [
        (agent_pb2.RetrieveRequest(query=""), "query"),
        (agent_pb2.RetrieveRequest(query="   \n"), "query"),
        (agent_pb2.RetrieveRequest(query="with", top_k=-1), "top_k"),
        (agent_pb2.RetrieveRequest(query="with", top_k=51), "top_k"),
        (agent_pb2.RetrieveRequest(query="with " * 2_001), "query"),  # past retrieval.max_query_chars (10,000)
    ],
)
async def test_bad_request_is_invalid_argument_naming_the_field(pydoc_index_dir, request_, field):
    async with _serve(_config(pydoc_index_dir)) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Retrieve(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: expected")


async def test_full_queue_is_resource_exhausted_naming_the_retrieval_queue(pydoc_index_dir):
    config = _config(pydoc_index_dir, **{"queues.retrieval": {"capacity": 1, "workers": 1, "timeout_ms": 5000}})
    async with _serve(config) as (service, stub):
        release = asyncio.Event()
        await _hold_workers(service, release, extra=1)  # the worker busy, the one slot taken
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Retrieve(agent_pb2.RetrieveRequest(query="with"))
        finally:
            release.set()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retrieval queue full" in err.value.details()
        reply = await stub.Retrieve(agent_pb2.RetrieveRequest(query="with"))  # serves again once drained
        assert reply.passages


def _span_exporter(monkeypatch) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(service_module, "tracer", provider.get_tracer("test"))
    return provider, exporter


async def test_queue_timeout_is_deadline_exceeded_naming_the_retrieval_queue(pydoc_index_dir, monkeypatch):
    provider, exporter = _span_exporter(monkeypatch)
    config = _config(pydoc_index_dir, **{"queues.retrieval": {"capacity": 8, "workers": 1, "timeout_ms": 50}})
    async with _serve(config) as (service, stub):
        release = asyncio.Event()
        await _hold_workers(service, release)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Retrieve(agent_pb2.RetrieveRequest(query="with"))
        finally:
            release.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "retrieval queue" in err.value.details() and "timeout_ms = 50" in err.value.details()
    wait_span, = [s for s in exporter.get_finished_spans() if s.name == "retrieval.queue_wait"]
    provider.shutdown()
    assert not wait_span.status.is_ok and "timeout_ms = 50" in wait_span.status.description


async def test_concurrent_calls_each_get_their_own_answer(pydoc_index_dir):
    questions = {"How does the with statement work?": "with", "What does the yield expression do?": "yield"}
    async with _serve(_config(pydoc_index_dir)) as (service, stub):
        replies = await asyncio.gather(
            *(stub.Retrieve(agent_pb2.RetrieveRequest(query=q, top_k=5)) for q in list(questions) * 4)
        )
        # each distinct question is embedded once: repeats join it in flight or come from the query cache
        assert sum(service.batcher.batch_sizes) == 2
    for question, reply in zip(list(questions) * 4, replies):
        assert questions[question] in [p.title for p in reply.passages]


async def test_stages_are_spans_with_the_queue_wait_timed_explicitly(pydoc_index_dir, monkeypatch):
    provider, exporter = _span_exporter(monkeypatch)
    async with _serve(_config(pydoc_index_dir)) as (_, stub):
        await stub.Retrieve(agent_pb2.RetrieveRequest(query="with"))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    provider.shutdown()
    assert set(spans) == {"retrieval.queue_wait", "retrieval.embed", "retrieval.search"}
    wait, embed, search = spans["retrieval.queue_wait"], spans["retrieval.embed"], spans["retrieval.search"]
    assert wait.start_time <= wait.end_time <= embed.start_time <= embed.end_time <= search.start_time
    assert wait.attributes["switchyard.queue"] == "retrieval"  # as the other services' queue waits
    assert search.attributes["retrieval.top_k"] == 4


async def test_missing_index_fails_start_naming_the_folder_and_the_fix(tmp_path):
    service = RetrievalService(_config(tmp_path / "no-index"))
    with pytest.raises(IndexNotFoundError) as err:
        await service.start()
    assert str(tmp_path / "no-index") in str(err.value) and "run `switchyard index`" in str(err.value)


def test_index_command_indexes_given_files(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "flush.md").write_text("# Double buffer\n\nThe active buffer flushes on size or interval.\n")
    (docs / "admission.rst").write_text("Admission\n=========\n\nWork is admitted by compute score.\n")
    (docs / "long.txt").write_text("\n".join(f"line {i}: a batch joins the next engine step" for i in range(200)))
    out = tmp_path / "index"
    assert index_main([str(docs), "--out", str(out), "--config-dir", str(CONFIG_DIR), "--no-progress"]) == 0
    summary = capsys.readouterr().out
    assert "passages from 3 documents (384 dims" in summary and str(out) in summary
    assert "passages truncated: 0 (window 256 word pieces, longest passage " in summary
    manifest = load_index(out).manifest
    assert manifest.count > 3 and manifest.truncated == 0 and manifest.longest_tokens <= manifest.window_tokens == 256
    assert index_main([str(tmp_path / "absent"), "--out", str(out), "--config-dir", str(CONFIG_DIR)]) == 2
    assert "absent" in capsys.readouterr().err


def test_chunk_tokens_above_the_model_window_is_refused_naming_the_key(tmp_path, capsys):
    (tmp_path / "a.md").write_text("# A\n\ntext\n")
    config = tmp_path / "config"
    shutil.copytree(CONFIG_DIR, config)
    service = json.loads((config / "switchyard.json").read_text())
    service["retrieval"]["chunk_tokens"] = 512
    (config / "switchyard.json").write_text(json.dumps(service))
    assert index_main([str(tmp_path / "a.md"), "--out", str(tmp_path / "i"), "--config-dir", str(config)]) == 2
    assert "retrieval.chunk_tokens=512 is above the window of" in capsys.readouterr().err


def test_an_out_that_is_no_folder_is_refused_before_the_work(tmp_path, capsys):
    """--out naming a file, or a folder under one, is exit 2 naming --out and what is there, before anything is
    embedded; it embedded every passage and then failed with a traceback (FileExistsError, NotADirectoryError)."""
    (tmp_path / "a.md").write_text("# A\n\ntext\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "index"):
        assert index_main([str(tmp_path / "a.md"), "--out", str(out), "--config-dir", str(CONFIG_DIR),
                           "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"--out: expected a folder this user can make or write, got '{out}' ({blocker} is not a folder)" in err
        assert "embedding" not in err
    assert blocker.read_text() == "x"


def test_a_binary_file_is_refused_naming_it_before_the_work(tmp_path, capsys):
    """A PDF given by name, or a .txt of binary bytes in a folder, was indexed as passages of U+FFFD garbage."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\ntext\n")
    (tmp_path / "docs" / "dump.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "paper.pdf").write_bytes(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\x00")
    for path, offset in ((tmp_path / "paper.pdf", 22), (tmp_path / "docs", 8)):
        assert index_main([str(path), "--out", str(tmp_path / "index"), "--config-dir", str(CONFIG_DIR),
                           "--no-progress"]) == 2
        shown = path / "dump.txt" if path.is_dir() else path
        assert f"{shown}: a binary file (a NUL byte at offset {offset}); expected text, Markdown or rst" \
            in capsys.readouterr().err
    assert not (tmp_path / "index" / "manifest.json").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream_type", [io.StringIO, _Terminal])
def test_progress_is_a_bar_only_on_a_terminal(stream_type):
    from switchyard.retrieval.embedder import load_embedder
    from switchyard.retrieval.indexer import embed_passages

    stream = stream_type()
    vectors = embed_passages(load_embedder(), [f"passage {i}" for i in range(70)], 32, progress=True, stream=stream)
    assert vectors.shape == (70, 384)
    written = stream.getvalue()
    if stream_type is _Terminal:
        assert "\r" in written and "70/70" in written  # tqdm redraws its bar in place
    else:
        assert "\r" not in written and "\x1b" not in written
        assert written.splitlines()[-1] == "embedding: 70/70 passages"


async def test_hybrid_on_with_an_index_without_bm25_fails_start_naming_the_fix(pydoc_index_dir, tmp_path):
    copy = tmp_path / "index"
    shutil.copytree(pydoc_index_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "lexical": ""}))
    service = RetrievalService(_config(copy))
    with pytest.raises(IndexMismatchError, match="no BM25 part but retrieval.hybrid is on"):
        await service.start()
    service = RetrievalService(_config(copy, **{"retrieval.hybrid": False}))
    await service.start()
    await service.stop()


def test_the_exported_query_encoder_gives_the_models_vectors(pydoc_index_dir):
    """ONNX Runtime on the index's export = sentence-transformers, alone and in padded batches of mixed lengths."""
    from switchyard.retrieval.embedder import OnnxEmbedder, load_embedder
    from switchyard.retrieval.quality import load_queries

    # every fourth labelled question (68 of mixed lengths), then empty, one piece, past the window
    texts = [q.query for q in load_queries(None)][::4] + ["", "x", "word " * 400]
    model, encoder = load_embedder(), OnnxEmbedder(pydoc_index_dir, threads=1)
    expected = model.encode(texts, batch_size=32)
    for batch_size in (1, 32):
        got = encoder.encode(texts, batch_size=batch_size)
        assert got.shape == expected.shape == (len(texts), 384) and got.dtype == expected.dtype
        assert float(np.max(1 - np.sum(got * expected, axis=1))) < 1e-5  # cosine distance
    assert encoder.name == model.name and encoder.window == model.window


async def test_an_index_without_the_exported_encoder_fails_start_naming_the_fix(pydoc_index_dir, tmp_path):
    service = RetrievalService(_config(pydoc_index_dir))
    await service.start()
    assert type(service.batcher.embedder).__name__ == "OnnxEmbedder"  # the shipped retrieval.embed_backend
    await service.stop()
    copy = tmp_path / "index"
    shutil.copytree(pydoc_index_dir, copy)
    (copy / "query_encoder.onnx").unlink()
    service = RetrievalService(_config(copy))
    with pytest.raises(IndexMismatchError, match=r"query_encoder.onnx not found.*`switchyard index --encoder-only "
                       r"--out .*`.*\"torch\""):
        await service.start()
    service = RetrievalService(_config(copy, **{"retrieval.embed_backend": "torch"}))
    await service.start()
    assert type(service.batcher.embedder).__name__ == "Embedder"
    await service.stop()


async def test_encoder_only_adds_the_encoder_to_an_older_index_and_a_broken_one_is_named(pydoc_index_dir, tmp_path):
    """`switchyard index --encoder-only` (what `make run` does for an index built before the export) leaves the
    passages as they are; a truncated export fails start naming the file and the command."""
    copy = tmp_path / "index"
    shutil.copytree(pydoc_index_dir, copy)
    (copy / "query_encoder.onnx").unlink()
    passages = (copy / "passages.jsonl").read_bytes()
    assert index_main(["--encoder-only", "--out", str(copy), "--config-dir", str(CONFIG_DIR)]) == 0
    assert (copy / "query_encoder.onnx").stat().st_size > 1_000_000 and (copy / "passages.jsonl").read_bytes() == passages
    assert index_main(["--encoder-only", "--out", str(tmp_path / "absent"), "--config-dir", str(CONFIG_DIR)]) == 2
    import onnx

    exported = onnx.load(str(copy / "query_encoder.onnx"))
    del exported.metadata_props[:]  # an export that does not say which model it is
    onnx.save(exported, str(copy / "query_encoder.onnx"))
    with pytest.raises(IndexMismatchError, match=r"does not say which model it is.*--encoder-only"):
        await RetrievalService(_config(copy)).start()
    encoder = (copy / "query_encoder.onnx").read_bytes()
    (copy / "query_encoder.onnx").write_bytes(encoder[: len(encoder) // 3])
    service = RetrievalService(_config(copy))
    with pytest.raises(IndexMismatchError, match=r"query_encoder.onnx could not be loaded.*--encoder-only"):
        await service.start()
