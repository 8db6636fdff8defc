"""The retrieval benchmarks: the query micro-batcher's (:mod:`switchyard_harness.bench.retrieval_batcher`)
and answer quality on the labelled questions (``switchyard bench retrieval``,
:mod:`switchyard_harness.bench.retrieval_quality`), which holds the default index to its targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard_harness.bench.retrieval_batcher import main as bench_main
from switchyard_harness.bench.retrieval_quality import main as quality_main

pytestmark = pytest.mark.slow  # loads the embedding model and the index

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def test_batching_benchmark_prints_one_line_per_setting(pydoc_index_dir, capsys):
    argv = ["--config-dir", str(CONFIG_DIR), "--index-dir", str(pydoc_index_dir), "--queries", "8", "--batch-sizes", "1,4"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    print(out)
    assert "embed_batch_size=1 " in out and "8 forward passes" in out
    assert "embed_batch_size=4 " in out


def test_the_default_index_meets_the_answer_quality_targets_on_the_labelled_questions(pydoc_index_dir, capsys):
    """Recall@5 >= 0.9 and MRR@10 >= 0.75 (hybrid, the default), 0 truncated passages; the CLI prints the table."""
    assert quality_main(["--config-dir", str(CONFIG_DIR), "--index-dir", str(pydoc_index_dir)]) == 0
    out = capsys.readouterr().out
    print(out)
    # columns: "built index" flat MODE passages truncated R@1 R@5 MRR@10 nDCG@10 tail-R@5 search retrieval
    table = [line.split() for line in out.splitlines() if line.startswith("built index ")]
    by_mode = {cols[3]: cols for cols in table}
    hybrid, vectors = by_mode["hybrid"], by_mode["vectors"]
    assert hybrid[5] == "0"  # truncated passages
    assert float(hybrid[7]) >= 0.9 and float(hybrid[8]) >= 0.75, out
    assert float(hybrid[7]) > float(vectors[7])  # BM25 adds to the vectors


def test_a_bad_query_file_fusion_constant_or_chunk_size_is_refused_naming_its_flag(tmp_path, capsys):
    """--queries of a missing file said only "[Errno 2] No such file or directory: '0'"; --rrf-k nan passed the
    '<= 0' check; --chunk-tokens above the model's window embedded the whole corpus truncated, for minutes, where
    switchyard index refuses the same size."""
    from switchyard.retrieval.quality import QUERIES_FILE, load_queries

    edited = tmp_path / "edited.jsonl"  # an editor's UTF-8 BOM: the first line was 'not JSON'
    edited.write_bytes(b"\xef\xbb\xbf" + QUERIES_FILE.read_bytes())
    assert load_queries(edited) == load_queries()
    missing = tmp_path / "absent.jsonl"
    assert quality_main(["--config-dir", str(CONFIG_DIR), "--queries", str(missing)]) == 2
    assert f"--queries {missing}: cannot read it (No such file or directory)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        quality_main(["--config-dir", str(CONFIG_DIR), "--rrf-k", "60,nan"])
    assert caught.value.code == 2 and "argument --rrf-k: expected comma-separated numbers > 0" in \
        capsys.readouterr().err
    assert quality_main(["--config-dir", str(CONFIG_DIR), "--chunk-tokens", "128,300", "--no-baseline"]) == 2
    assert "--chunk-tokens 300 is above the window of sentence-transformers/all-MiniLM-L6-v2 (256 word pieces)" in \
        capsys.readouterr().err
