"""switchyard.common.outputs.unwritable: a path no file can be written at is found before the work it ends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from switchyard.common import outputs
from switchyard_harness.bench import diff

pytestmark = pytest.mark.no_gpu

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


@linux_only
def test_a_missing_folder_that_cannot_be_made_is_named():
    """/proc/x/y.png: os.access said a folder could be made in /proc (and says so of every folder to root)."""
    assert outputs.unwritable("/proc/x/y.png") == "cannot make the folder /proc/x (No such file or directory)"


def test_missing_folders_that_can_be_made_are_no_problem_and_are_not_left_made(tmp_path):
    assert outputs.unwritable(tmp_path / "a" / "b" / "report.json") == ""
    assert not (tmp_path / "a").exists()


def test_a_file_on_the_way_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    assert outputs.unwritable(tmp_path / "file" / "sub" / "out.json") == f"{tmp_path / 'file'} is not a folder"


@linux_only
def test_bench_diff_refuses_a_plot_path_before_printing_the_comparison(tmp_path, capsys):
    """It printed the whole comparison, then 'could not write the plot (No such file or directory)', exit 0."""
    ghz = Path(__file__).resolve().parent / "data" / "ghz"
    with pytest.raises(SystemExit) as caught:
        diff.main([str(ghz / "greeter_before.json"), str(ghz / "greeter_after.json"), "--plot", "/proc/x/d.png"])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert "--plot: expected a PNG file that can be written (cannot make the folder /proc/x" in captured.err
    assert "latency P95" not in captured.out
