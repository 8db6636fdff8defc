"""switchyard.common.outputs.unwritable: a path no file can be written at is found before the work it ends."""

from __future__ import annotations

import sys

import pytest

from switchyard.common import outputs

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
