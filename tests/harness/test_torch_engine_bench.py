"""The torch engine's benchmark main (:mod:`switchyard_harness.bench.torch_engine`) on the configured
tiny CPU model: one table row per batch size, a checkpoint it writes loads back, bad flags are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from switchyard.common.config import load_config  # noqa: E402
from switchyard.dispatcher.engines.torch_model import build_model  # noqa: E402
from switchyard_harness.bench import torch_engine  # noqa: E402

pytestmark = pytest.mark.no_gpu

CONFIG = ["--config-dir", str(Path(__file__).resolve().parents[2] / "config"), "--device", "cpu"]


def test_prints_one_row_per_batch_size(capsys):
    assert torch_engine.main(["--batch", "1,2", "--steps", "2", "--prompt-tokens", "8", *CONFIG]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"], out
    assert all(float(row[3]) > 0 for row in rows), out  # decode tokens/s


def test_save_checkpoint_writes_the_weights(tmp_path, capsys):
    path = tmp_path / "tiny.pt"
    assert torch_engine.main(["--save-checkpoint", str(path), *CONFIG]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {path}"
    torch_config = load_config(CONFIG[1]).torch
    saved = build_model(torch_config.model_copy(update={"checkpoint": str(path), "device": "cpu"}))
    fresh = build_model(torch_config.model_copy(update={"device": "cpu"}))
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.parametrize("argv", [["--batch", "one"], ["--steps", "0"], ["--prompt-tokens", "100000"]])
def test_bad_flags_are_refused_naming_them(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        torch_engine.main([*argv, *CONFIG])
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err
